"""`phoenixft ckpt` on a URL where nothing is: exit 2 and one line for every verb (`ls`
exited 0 as if it were an empty checkpoint directory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import ROOT


@pytest.mark.parametrize("verb", [["ls"], ["verify"], ["inspect"], ["export", "--to", "OUT"]])
def test_a_url_where_nothing_is_exits_2_in_one_line(tmp_path, verb):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in verb]
    p = subprocess.run([sys.executable, "-m", "phoenixft.cli", "ckpt", *args,
                        str(tmp_path / "nonexistent")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"phoenixft ckpt {verb[0]}: error: {tmp_path / 'nonexistent'}: no such directory (or "
        "object-store prefix): nothing to read"]

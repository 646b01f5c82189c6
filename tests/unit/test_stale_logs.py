"""Recovery logs of serving fronts that are gone are named (`stale_logs.py`), with real
processes: a dead front, a live one, a pid reused by another process, a log with no owner
record (a front still starting)."""

from __future__ import annotations

import json
import subprocess
import sys

from phoenixft.platform import process_start
from phoenixft.serve.server.stale_logs import OWNER, claim, stale_logs


def owned_by(root, name: str, pid: int, start) -> None:
    d = root / f"phoenixft-serve-{name}"
    d.mkdir()
    (d / "seg-0000.log").write_bytes(b"x" * 3000)
    (d / OWNER).write_text(json.dumps({"front_pid": pid, "start": start, "run_dir": f"/runs/{name}"}))


def test_only_logs_whose_front_is_gone_are_named(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_start = process_start(gone.pid)
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owned_by(tmp_path, "dead", gone.pid, gone_start)
        owned_by(tmp_path, "live", live.pid, process_start(live.pid))
        owned_by(tmp_path, "reused", live.pid, process_start(live.pid) - 1)  # another process
        (tmp_path / "phoenixft-serve-starting").mkdir()  # no owner record yet
        claim(tmp_path / "phoenixft-serve-mine", "/runs/mine")  # this process: alive
        found = {s.path.name: s for s in stale_logs(tmp_path)}
        # a log named with --log-dir of the server asking is never its own stale log
        mine = stale_logs(tmp_path, exclude=tmp_path / "phoenixft-serve-dead")
    finally:
        live.kill()
        live.wait()
    assert sorted(found) == ["phoenixft-serve-dead", "phoenixft-serve-reused"], found
    s = found["phoenixft-serve-dead"]
    assert s.run_dir == "/runs/dead" and s.nbytes == 3000 + len((s.path / OWNER).read_bytes())
    advice = s.advice()
    assert f"rm -rf {s.path}" in advice and "--run-dir /runs/dead" in advice, advice
    assert [s.path.name for s in mine] == ["phoenixft-serve-reused"]

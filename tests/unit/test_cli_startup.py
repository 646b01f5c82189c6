"""The command line is built, and `phoenixft run`'s arguments checked, without importing
torch (1.5 s here): `phoenixft --help` and a refused run answer at once. A part that
imports torch at module level where the parser is built fails this."""

from __future__ import annotations

import subprocess
import sys

from tests.support.jobs import ROOT

PROBE = """
import sys
from phoenixft.cli import build_parser
from phoenixft.launch.options import agent_config_from_args
from phoenixft.launch.forkserver import ForkServer
from phoenixft.launch.rundir import RunDirLock
from phoenixft.launch.config import LaunchError
build_parser()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_building_the_command_line_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout

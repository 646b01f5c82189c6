"""`python -m phoenixft.serve.server.janitor FRONT_PID PATH...`: removes what a serving front
leaves behind once it has exited, however it exited.

A front creates an engines' socket directory (`/tmp/phoenixft-serve-<pid>-*`), a run
directory when none is given (`/tmp/phoenixft-serve-run-*`) and a recovery log in
`/dev/shm` (which, with a `--run-dir`, is kept on purpose: a restarted server resumes
from it, and then it is not given here). A clean stop removes them itself, but a
SIGKILLed front runs no code, and a start that fails part-way may not get to. So the front
starts this small process first, in a session of its own (a signal to the front's process
group does not reach it). It waits for the front's exit (pidfd), then for the processes
that may still write there (the engines and their log executors die with the front by
their parent-death signal, a moment later; they are those whose command line names one
of the paths), then removes the paths and exits. It imports nothing heavy and holds
nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from phoenixft.platform import wait_for_exit


def start_janitor(paths: list[str | Path]) -> subprocess.Popen:
    """Start the janitor for this process and `paths`."""
    return subprocess.Popen([sys.executable, "-m", "phoenixft.serve.server.janitor", str(os.getpid()),
                             *map(str, paths)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def users(paths: list[str]) -> list[int]:
    """Pids of the processes (other than this one) whose command line names a path."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(p in cmd for p in paths):
            found.append(int(entry.name))
    return found


def clean(paths: list[str], wait_s: float = 30.0) -> None:
    """Remove `paths` once no process names them (or after `wait_s`: a process that
    outlives its parent-death signal that long is stuck, and the files go regardless)."""
    deadline = time.monotonic() + wait_s
    for pid in users(paths):
        wait_for_exit(pid, max(0.0, deadline - time.monotonic()))
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def main() -> None:
    front, paths = int(sys.argv[1]), sys.argv[2:]
    wait_for_exit(front)
    clean(paths)


if __name__ == "__main__":
    main()

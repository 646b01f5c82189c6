"""The run directory of one agent: locked while the job runs, the previous run set aside.

Two jobs writing one run directory would mix their events and overwrite each other's
summary and model, both exiting 0. So each agent holds an exclusive lock on
``.lock.n{node}`` for as long as it runs (agents of one multi-node job on one machine
share the directory, one lock per node); a second job on the same directory stops at once,
naming the process that holds it. The lock is an `flock`: the kernel drops it when the
holder dies, so a killed job never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from phoenixft.launch.config import LaunchError

_RUN_FILES = ("events.jsonl", "status.json", "summary.json", "audit.jsonl", "model")


class RunDirLock:
    def __init__(self, run_dir: Path, node: int) -> None:
        self.path = run_dir / f".lock.n{node}"
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise LaunchError(f"--run-dir {run_dir} cannot be used: {exc.strerror} "
                              f"({exc.filename})") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise LaunchError(f"--run-dir {run_dir} is in use by a running job (pid {holder}); "
                              "give this run its own --run-dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def set_aside_previous_run(run_dir: Path) -> Path | None:
    """Move the last run's files into previous/<time>/ rather than mixing two runs in one
    events.jsonl (nothing is deleted). Returns where they went, if anywhere."""
    old = [run_dir / n for n in _RUN_FILES]
    if not any(p.exists() and (p.is_dir() or p.stat().st_size) for p in old):
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        n += 1
    dest.mkdir(parents=True)
    for p in old:
        if p.exists():
            p.rename(dest / p.name)
    return dest

"""Linux process plumbing shared by the launcher's workers and the serving engines (a
layer of its own: every part may import it, it imports nothing of phoenixft)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (PR_SET_CHILD_SUBREAPER), so a
    process forked by a child of ours becomes our child when that child exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def wait_for_exit(pid: int, timeout_s: float | None = None) -> bool:
    """Wait until process `pid` has exited (through a pidfd: no polling, and no pid reuse
    race); True if it has (or was already gone), False at the timeout. It need not be our
    child, which is what a janitor watching the process it cleans up after needs."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), or None when
    there is no such process: with the pid, it names one process, never a later one that
    reused the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # (the command name, field 2, is in parentheses and may hold spaces)
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (bound and released: another process may take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

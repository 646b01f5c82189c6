"""The `freeze` fault: a process stopped with SIGSTOP for `ms` of every `period` ms, by a
helper process (a process cannot continue itself), as a host that keeps pausing would
(a throttled container, a VM losing its core, a swap storm).

`start(pid, ms, period_ms)` starts the helper as a child of `pid` (the worker that
fires the fault): it stops and continues its parent until the parent is gone (it is then
re-parented), and continues it on SIGTERM before it leaves, so a stop never outlives it.
Only the standard library is imported: the helper starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start(pid: int, ms: float, period_ms: float) -> subprocess.Popen:
    if not 0 < ms < period_ms:
        raise ValueError(f"a freeze needs 0 < ms < period, got ms={ms}, period={period_ms}")
    return subprocess.Popen([sys.executable, "-m", "phoenixft.faults.freezer", str(pid),
                             str(ms / 1000), str(period_ms / 1000)],
                            stdin=subprocess.DEVNULL, close_fds=True)


def _main(pid: int, stop_s: float, period_s: float) -> None:
    try:  # (signals through a pidfd never reach another process that reused the PID)
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return

    def send(sig: int) -> None:
        signal.pidfd_send_signal(fd, sig)

    def cont(*_) -> None:
        try:
            send(signal.SIGCONT)
        except ProcessLookupError:
            pass
        os._exit(0)
    signal.signal(signal.SIGTERM, cont)
    try:
        while os.getppid() == pid:
            send(signal.SIGSTOP)
            time.sleep(stop_s)
            send(signal.SIGCONT)
            time.sleep(period_s - stop_s)
    except ProcessLookupError:
        pass
    cont()


if __name__ == "__main__":
    _main(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))

"""How a worker process ends: an uncaught exception in the user's script is recorded in
the store (the leader stops the job and shows it, since a spare would only raise it
again), and a clean end is marked so the agent can tell it from a crash."""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable

import torch.distributed as dist

from phoenixft.cluster.keys import Keys


class JobAborted(SystemExit):
    """The leader stopped the job (no spare left, a script error elsewhere)."""


class ExitGuard:
    """Installs the excepthook and the exit handler of a worker process."""

    def __init__(self, store: dist.Store, wid: str, shutdown: Callable[[], None]) -> None:
        self.store = store
        self.wid = wid
        self.exit_code = 0
        self._shutdown = shutdown
        previous = sys.excepthook

        def hook(tp, value, tb):
            self.exit_code = 1
            if not issubclass(tp, (KeyboardInterrupt, JobAborted)):
                text = "".join(traceback.format_exception(tp, value, tb))
                try:
                    self.store.set(Keys.error(self.wid), text[-4000:])
                except Exception:
                    pass
            previous(tp, value, tb)

        sys.excepthook = hook
        atexit.register(self._at_exit)

    def fail(self) -> None:
        """This process is going to exit with an error (set before raising JobAborted)."""
        self.exit_code = 1

    def _at_exit(self) -> None:
        """Mark a clean exit, then leave without interpreter teardown: our daemon threads
        may sit in C++ (a store wait, an abandoned gloo wait), and tearing the runtime
        down under them aborts the process (std::terminate)."""
        try:
            if self.exit_code == 0:
                self.store.set(Keys.exit(self.wid), "done")
        except Exception:
            pass
        self._shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.exit_code)

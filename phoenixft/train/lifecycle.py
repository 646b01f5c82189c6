"""How a worker process ends.

Under `phoenixft run`, `phoenixft.launch.worker` runs the script and reports its exit code
or traceback to the leader; the session only has to stop its own threads at exit (an
`atexit` handler), which is also all a standalone session (a notebook, a plain
`python train.py`) needs so the interpreter can tear down cleanly.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable


class JobAborted(SystemExit):
    """The job cannot go on (the leader stopped it: no spare left, a script error
    elsewhere; or the job store is gone). Its message is the reason; exit status 1."""


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Run `stop` (idempotent) when the process exits normally."""
    atexit.register(stop)

"""Tests wait for a state, bounded by a deadline, never for a number of seconds."""

from __future__ import annotations

import time
from collections.abc import Callable

from phoenixft.platform import free_port as free_port  # (one place: the package's)


def wait_until(check: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    """Poll `check` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)



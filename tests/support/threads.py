"""Threads as ranks, for unit tests where a real process is not the point."""

from __future__ import annotations

import threading


def ranks(fn, n: int = 2):
    """Run fn(rank) in n threads and return their results; re-raise the first error."""
    out, errs = [None] * n, []

    def body(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errs:
        raise errs[0]
    return out

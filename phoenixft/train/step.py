"""One optimizer step as the user's loop sees it: microbatch ids to compute, and a
`backward` that records each one (for the audit, the quota bookkeeping and in-step
recovery)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from phoenixft.cluster.store import Keys

if TYPE_CHECKING:
    from phoenixft.train.session import Session


class Step:
    """One optimizer step of M microbatches. Iterate `microbatches()` and call
    `backward(loss)` once per microbatch, with the mean loss of that microbatch.

    After an in-step recovery the same step is yielded again (`retry` is True) with only
    the microbatches this rank still has to compute; gradients of the ones it finished
    are kept."""

    def __init__(self, session: Session, index: int, ids: list[int], m: int) -> None:
        self.session = session
        self.index = index
        self.ids = ids
        self.m = m  # microbatches in this step, over all ranks
        self.loss_sum = 0.0
        self.done: list[int] = []
        self.phase = "compute"  # -> "reduce" -> "update"
        self.retry = False

    def microbatches(self) -> Iterator[int]:
        """The microbatch ids j (0 <= j < M) this rank computes in this step; the data of
        (step.index, j) should be a pure function of them if the world may shrink."""
        for j in list(self.ids):
            if j not in self.done:
                self._current = j
                yield j

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.loss_sum += float(loss.detach())
        j = getattr(self, "_current", None)
        if j is None or j in self.done:
            j = next(k for k in self.ids if k not in self.done)
        self.done.append(j)
        s = self.session
        s.store.add(Keys.MB_COUNT, 1)
        s._injector.at_microbatch(s.rank, self.index, len(self.done) - 1)

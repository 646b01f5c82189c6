"""The layout of the one buffer every rank all-reduces per step.

One all-reduce carries everything a step must agree on, so a step costs one collective:

    [grads: size)        gradient sums over this rank's microbatches (flat, padded)
    [mask: m)            1.0 for each microbatch id this rank contributed (the audit)
    [grow]               rank 0 sets 1.0 when the leader asked to admit new members
    [loss]               sum of this rank's microbatch losses
    [count]              how many microbatches this rank contributed
    [times: world)       each rank's seconds of the step, in its own slot (the straggler
                         watch, train/straggler.py)
    [stalls: world)      each rank's seconds its process stood still in the step
    [votes: world x k)   each rank's fingerprints in its own k slots: the digests of the
                         step before's reduced gradients and of its state now, and its
                         seal (train/fingerprints.py; k = 0 when the vote is not carried)

After the sum, every id must appear exactly once and the counts must add up to m.
"""

from __future__ import annotations

from dataclasses import dataclass

_TAIL = 3  # grow, loss, count


@dataclass(frozen=True, slots=True)
class ReduceLayout:
    size: int  # the flat parameter buffer's length (padded to the world size)
    m: int  # microbatches in the step
    world: int = 0  # ranks, one time slot and one stall slot each
    votes: int = 0  # slots per rank for the carried fingerprints

    @staticmethod
    def capacity(size: int, max_m: int, world: int = 0, votes: int = 0) -> int:
        """Buffer length that fits any step of up to `max_m` microbatches."""
        return size + max_m + _TAIL + (2 + votes) * world

    @property
    def total(self) -> int:
        return self.size + self.m + _TAIL + (2 + self.votes) * self.world

    @property
    def fingerprints(self) -> slice:
        start = self.stalls.stop
        return slice(start, start + self.votes * self.world)

    @property
    def times(self) -> slice:
        start = self.size + self.m + _TAIL
        return slice(start, start + self.world)

    @property
    def stalls(self) -> slice:
        start = self.times.stop
        return slice(start, start + self.world)

    @property
    def grads(self) -> slice:
        return slice(0, self.size)

    @property
    def mask(self) -> slice:
        return slice(self.size, self.size + self.m)

    @property
    def grow(self) -> int:
        return self.size + self.m

    @property
    def loss(self) -> int:
        return self.size + self.m + 1

    @property
    def count(self) -> int:
        return self.size + self.m + 2

"""Silent data corruption found by consensus (data parallel).

After the step's all-reduce every data-parallel rank holds the same reduced gradients,
bit for bit, and with ZeRO-1 each rank updates its own shard of the parameters from them:
a bit flipped there (bad memory, a faulty core) would be all-gathered into every rank's
parameters at once, after which the ranks agree again on the wrong values. So the vote is
before the update. Every `every` steps each rank digests the buffer (the sum of its
elements read as integers: one flipped bit changes it by a power of two, so a single flip
always shows), the digests ride in one tiny all-reduce (each rank its own slot), and a strict
majority names the ranks that differ. With no strict majority (two ranks, or a split
vote) nobody can be named: the job stops before the update, its committed state intact.
"""

from __future__ import annotations

from collections import Counter

import torch

from phoenixft.comm.collectives import CommFailure, GroupOps


class Outvoted(CommFailure):
    """The step's fingerprint vote named ranks whose reduced gradients differ from the
    majority's: the step is abandoned before its update (its finished microbatches are
    kept by the others) and the leader replaces those ranks."""


class NoMajority(RuntimeError):
    """The ranks' reduced gradients disagree and no strict majority says which are right."""


_CHUNK = 1 << 20  # integers < 2**31 each: a chunk's sum < 2**51, exact in a double


def digest(t: torch.Tensor) -> int:
    """The sum of the tensor's elements read as integers of their own width (int32 for
    fp32, int16 for bf16): any single flipped bit changes it by a power of two. Summed in
    doubles per chunk of 2**20 (exact, and 3.5x faster than an int64 sum here), then
    exactly in Python."""
    x = t.detach().contiguous().view(-1)
    ints = x.view({4: torch.int32, 2: torch.int16}.get(x.element_size(), torch.uint8))
    return sum(int(c.double().sum()) for c in ints.split(_CHUNK))


def vote(ops: GroupOps, rank: int, world_size: int, mine: int, what: str) -> list[int]:
    """Every rank's digest (one all-reduce); the ranks outside a strict majority, or
    NoMajority when there is none."""
    slots = torch.zeros(world_size, dtype=torch.int64)
    slots[rank] = mine
    ops.allreduce(slots, what)
    values = slots.tolist()
    value, n = Counter(values).most_common(1)[0]
    if n == world_size:
        return []
    if 2 * n <= world_size:
        each = ", ".join(f"rank {r}: {v:#x}" for r, v in enumerate(values))
        raise NoMajority(
            f"the ranks' reduced gradients disagree ({each}) and no strict majority says "
            "which are right; the job stops before the update, its last committed step "
            "intact (more data-parallel ranks give a majority)")
    return [r for r, v in enumerate(values) if v != value]

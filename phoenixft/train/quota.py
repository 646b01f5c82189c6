"""ReCoVer quota plans: which microbatch ids of a step each rank computes.

A step consumes exactly M microbatches, ids 0..M-1, whatever the world size; the data of
an id is a pure function of (step, id), so any rank can compute any id. Plans are
deterministic functions of their inputs, so every member computes the same plan without
talking to the others.
"""

from __future__ import annotations

from phoenixft.config import Policy


def plan(m: int, world_size: int) -> list[list[int]]:
    """Contiguous, as even as possible: the first m % world_size ranks get one more."""
    if m < 1 or world_size < 1:
        raise ValueError(f"need m >= 1 and world_size >= 1, got m={m}, world_size={world_size}")
    base, extra = divmod(m, world_size)
    out, start = [], 0
    for r in range(world_size):
        n = base + (1 if r < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def plan_weighted(m: int, weights: list[float]) -> list[list[int]]:
    """Contiguous ids, each rank's count in proportion to its weight (largest
    remainders; ties to the lower rank): a faster rank gets more of the step's m."""
    if m < 1 or not weights or any(not w > 0 for w in weights):
        raise ValueError(f"need m >= 1 and weights > 0, got m={m}, weights={weights}")
    total = sum(weights)
    exact = [m * w / total for w in weights]
    counts = [int(x) for x in exact]
    for r in sorted(range(len(weights)), key=lambda r: (counts[r] - exact[r], r))[:m - sum(counts)]:
        counts[r] += 1
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def plan_in_rounds(m: int, groups: int, size: int) -> list[list[int]]:
    """Ids in rounds of `size` consecutive ids, one round per group in turn; the
    round's ids go to the group's places 0..size-1 (rank u * size + i holds place i of
    group u). Every place of a group gets as many ids when m is a multiple of `size`."""
    if m < 1 or groups < 1 or size < 1:
        raise ValueError(f"need m, groups, size >= 1, got {m}, {groups}, {size}")
    out: list[list[int]] = [[] for _ in range(groups * size)]
    for k, start in enumerate(range(0, m, size)):
        u = k % groups
        for i, j in enumerate(range(start, min(start + size, m))):
            out[u * size + i].append(j)
    return out


def reassign(remaining: list[int], old_plan: list[list[int]], world_size: int) -> list[list[int]]:
    """Give the unfinished ids of an interrupted step to the new generation's ranks: an id
    stays with its old rank number when that rank exists (a spare took it over), the rest
    are dealt round-robin from the least loaded rank up."""
    owner = {j: r for r, ids in enumerate(old_plan) for j in ids}
    out: list[list[int]] = [[] for _ in range(world_size)]
    orphans = []
    for j in sorted(remaining):
        r = owner.get(j, -1)
        if 0 <= r < world_size and r < len(old_plan):
            out[r].append(j)
        else:
            orphans.append(j)
    for j in orphans:
        r = min(range(world_size), key=lambda k: (len(out[k]), k))
        out[r].append(j)
    return out


def effective_m(m: int, initial_world: int, world_size: int, policy: Policy | str) -> int:
    """Microbatches per step under a policy: `constant` keeps M (ReCoVer); `shrink-batch`
    keeps each rank's share, so the global batch shrinks with the world (the old way:
    the optimisation trajectory changes)."""
    if Policy(policy) is Policy.CONSTANT:
        return m
    return max(1, m * world_size // initial_world)

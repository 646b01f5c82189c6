"""Which groups a recovery may keep or shrink (`train/kept_groups.py`), decided from the
members' worker ids: a shrink is the old group less members that left the job, the rest
in order; gloo never shrinks (the NCCL path is in scripts/gpu-check's report)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from phoenixft.cluster.membership import Plan
from phoenixft.comm.collectives import GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from phoenixft.train.kept_groups import KeptGroups, can_shrink, shrink_of


def test_a_shrink_is_the_old_group_less_members_that_left():
    gone = {"n1w0", "n2w0"}.__contains__
    old = ("n0w0", "n1w0", "n2w0", "n3w0")
    assert shrink_of(old, ("n0w0", "n2w0", "n3w0"), gone) == [1]
    assert shrink_of(old, ("n0w0", "n3w0"), gone) == [1, 2]
    assert shrink_of(old, ("n0w0", "n3w0", "n2w0"), gone) is None  # reordered
    assert shrink_of(old, ("n0w0", "n1w0", "n2w0"), gone) is None  # n3w0 is alive
    assert shrink_of(old, ("n0w0", "n9w0", "n3w0"), gone) is None  # someone added
    assert shrink_of(old, old, gone) is None  # not smaller


def test_gloo_groups_are_kept_when_whole_but_never_shrunk():
    store, pgs = dist.HashStore(), [None, None, None]

    def build(r: int) -> None:
        pgs[r] = new_group(store, "shrink/", r, 3, device=torch.device("cpu"), timeout_s=30)
    threads = [threading.Thread(target=build, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not can_shrink(pgs[0])
    # HSDP-like: 3 replica groups of 1; the dp_replicate group is every rank
    kept = KeptGroups(lambda r, n: {"dp_replicate.0": (r, n)})
    old = Plan(1, members={0: "n0w0", 1: "n1w0", 2: "n2w0"})
    kept.park({"dp_replicate.0": GroupOps(pgs[0], Interrupt(), 30.0)}, old)
    same = Plan(2, members={0: "n0w0", 1: "n1w0", 2: "n2w0"})
    fewer = Plan(2, members={0: "n0w0", 1: "n2w0"})  # n1w0 left without a spare
    assert kept.candidates(same, ["dp_replicate.0"]) == {"dp_replicate.0"}
    assert kept.candidates(fewer, ["dp_replicate.0"]) == set()  # gloo: built anew

"""A spare computing ahead: before it joins, the newest step t of which its node holds a
verified copy of every rank's snapshot (`Member._speculate` then loads the dead rank's
state of t from them and computes its microbatches of t+1 while the survivors finish
theirs)."""

from __future__ import annotations

import time

from phoenixft.checkpoint.record import Snapshot
from phoenixft.checkpoint.restore import RestorePlanner
from phoenixft.checkpoint.slots import SlotFile, SlotKind, slot_path

# A spare waits at most this long for survivors' in-flight snapshot copies before it
# computes ahead (`local_step_of_every_rank`); the survivors meanwhile finish their
# microbatches, which take a step's compute
AHEAD_WAIT_S = 0.5


def local_step_of_every_rank(planner: RestorePlanner, shm_dir: str, r: int, world: int,
                             numel: int):
    """(t, [snapshot (views of its slot)] by rank) for the newest step t of which this node holds a
    verified copy of every rank's snapshot, all written by one generation; or None.

    When rank r's newest copy, of step t, is here but some survivor's is not yet, that
    survivor is still copying it: rank r finished step t, so every rank got through
    t's all-gather, and a survivor copies a snapshot it began even after the failure.
    So wait for it, up to `AHEAD_WAIT_S`, rather than compute ahead from an older
    step, work the restore of t would then drop (seen: a spare computed from 6 while
    everyone restored 7)."""
    deadline = time.monotonic() + AHEAD_WAIT_S
    while True:
        newest, got = _scan_local_steps(planner, shm_dir, r, world, numel)
        if (got is not None and got[0] == newest) or newest < 0 \
                or time.monotonic() > deadline:
            return got
        time.sleep(0.005)  # the survivors' snapshot threads finish their copies
        planner.forget()  # (a copy found missing is looked for again)


def _scan_local_steps(planner: RestorePlanner, shm_dir: str, r: int, world: int, numel: int):
    """(the newest step of rank r's own copies here, the newest step found whole
    as `local_step_of_every_rank` returns it, or None)."""
    steps = set()
    for kind in (SlotKind.SNAP, SlotKind.REP):
        for parity in (0, 1):
            complete, step = SlotFile(slot_path(shm_dir, kind, r, parity)).peek()
            if complete and step >= 0:
                steps.add(step)
    for t in sorted(steps, reverse=True):
        copies = []
        for q in range(world):
            found = planner.local_copy(q, t)
            if found is None:
                break
            hdr = found[0].header()
            if hdr.rank != q or hdr.world_size != world or hdr.numel != numel:
                break
            copies.append(Snapshot(hdr, found[0].tensors(hdr)))
        if len(copies) == world and len({c.header.generation for c in copies}) == 1:
            return max(steps), (t, copies)
    return max(steps, default=-1), None

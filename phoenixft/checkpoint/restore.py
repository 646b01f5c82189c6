"""Restore planner: every member of a new generation gets its rank's committed snapshot
from the fastest copy that survived.

Run collectively by all members after the generation's group is built (so no old
snapshot thread can still write). Each member verifies (checksum included) which ranks'
snapshots of step t its node holds in shared memory: its own slot, or a replica slot it
held for a peer. The members all-gather that table and decide the same plan:

1. a copy on the member's own node (the survivor's own slot; a spare on the dead rank's
   node; a spare beside the replica holder): read from shared memory, no network;
2. otherwise the lowest rank that holds a verified copy sends it over the group;
3. no copy anywhere: `IntegrityError` naming the rank and step (never a silent load).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.slots import SlotFile, slot_path
from phoenixft.comm.collectives import Interrupt, wait_work


def local_copy(shm_dir: str | Path, rank: int, step: int,
               generation: int | None = None) -> tuple[SlotFile, str] | None:
    """A verified slot for (rank, step) in this node's shared memory, own slot first,
    with its kind: "local_snapshot" or "local_replica". With `generation`, only a slot
    written by that generation counts (after a world-size change, an abandoned snapshot
    of the same step from an older numbering may still sit in a slot)."""
    for kind, name in (("snap", "local_snapshot"), ("rep", "local_replica")):
        p = slot_path(shm_dir, kind, rank, step)
        if not p.exists():
            continue
        f = SlotFile(p)
        try:
            hdr = f.verify(step)
            if generation is not None and hdr.get("generation") != generation:
                continue
            return f, name
        except IntegrityError:
            continue
    return None


def restore_snapshot(pg: dist.ProcessGroup, *, rank: int, world_size: int, step: int,
                     shm_dir: str | Path, interrupt: Interrupt, timeout_s: float,
                     generation: int | None = None) -> tuple[SlotFile, dict, str]:
    """Collective. Returns (slot, verified header, source) for this member's rank,
    where source is "local_snapshot", "local_replica" or "peer_memory" (sent by a peer)."""
    copies, table = copy_table(pg, shm_dir, world_size, world_size, step, generation,
                                interrupt, timeout_s)
    senders: dict[int, int] = {}
    for r in range(world_size):
        if table[r][r]:
            continue
        holders = [h for h in range(world_size) if table[h][r]]
        if not holders:
            raise IntegrityError(
                f"no surviving copy of rank {r}'s snapshot for step {step}: its own node and "
                "every replica holder are gone or corrupt; restart from a persisted "
                "checkpoint or run with more replicas")
        senders[r] = holders[0]
    mine, source = copies[rank] if copies[rank] is not None else (None, "")
    for r, s in sorted(senders.items()):  # same order on every member
        if rank == s:
            slot = copies[r][0]
            n = torch.tensor([slot.used_nbytes()], dtype=torch.int64)
            wait_work(pg.send([n], r, 2), interrupt, timeout_s, "restore size send")
            wait_work(pg.send([slot.tensor[:int(n)]], r, 3), interrupt, timeout_s, "restore send")
        elif rank == r:
            n = torch.zeros(1, dtype=torch.int64)
            wait_work(pg.recv([n], s, 2), interrupt, timeout_s, "restore size recv")
            mine = SlotFile(slot_path(shm_dir, "snap", r, step))
            mine.ensure(int(n))
            mine.begin_write(step)
            wait_work(pg.recv([mine.tensor[:int(n)]], s, 3), interrupt, timeout_s, "restore recv")
            source = "peer_memory"
    if mine is None:  # unreachable: every rank had a copy or was sent one above
        raise IntegrityError(f"rank {rank}: no snapshot of step {step} after planning")
    hdr = mine.verify(step)
    if hdr.get("rank") != rank:
        raise IntegrityError(f"{mine.path}: snapshot belongs to rank {hdr.get('rank')}, "
                             f"not rank {rank}")
    return mine, hdr, source



def copy_table(pg, shm_dir, world_size: int, old_world: int, step: int, generation,
                interrupt: Interrupt, timeout_s: float):
    """Which member's node holds a verified copy of which old rank's snapshot."""
    copies = {r: local_copy(shm_dir, r, step, generation) for r in range(old_world)}
    have = torch.tensor([1 if copies[r] is not None else 0 for r in range(old_world)],
                        dtype=torch.int32)
    table = torch.zeros(world_size * old_world, dtype=torch.int32)
    wait_work(pg._allgather_base(table, have), interrupt, timeout_s, "restore planning")
    return copies, table.view(world_size, old_world)  # table[member][old rank]


def gather_resharded(pg: dist.ProcessGroup, *, rank: int, world_size: int, old_world: int,
                     step: int, generation: int, shm_dir: str | Path, interrupt: Interrupt,
                     timeout_s: float) -> tuple[dict[str, torch.Tensor], dict]:
    """Collective, for a world-size change: every member gets the whole committed state of
    step t (all `old_world` shards concatenated, per entry name) so it can cut its new
    shard. Each old shard comes from the lowest member holding a verified copy, broadcast
    to all. Returns (full tensors by entry name, header of old rank 0)."""
    copies, table = copy_table(pg, shm_dir, world_size, old_world, step, generation,
                                interrupt, timeout_s)
    parts: dict[str, list[torch.Tensor]] = {}
    header0: dict = {}
    for o in range(old_world):
        holders = [m for m in range(world_size) if table[m][o]]
        if not holders:
            raise IntegrityError(
                f"no surviving copy of old rank {o}'s snapshot for step {step} (generation "
                f"{generation}): its node and its replica holders are gone or corrupt")
        src = holders[0]
        n = torch.tensor([copies[o][0].used_nbytes() if rank == src else 0], dtype=torch.int64)
        wait_work(pg.broadcast(n, src), interrupt, timeout_s, "reshard size")
        if rank == src:
            slot = copies[o][0]
        else:
            slot = SlotFile(slot_path(shm_dir, "xfer", o, step))
            slot.ensure(int(n))
        wait_work(pg.broadcast(slot.tensor[:int(n)], src), interrupt, timeout_s, "reshard data")
        hdr = slot.verify(step)
        if hdr.get("rank") != o or hdr.get("world_size") != old_world:
            raise IntegrityError(f"{slot.path}: holds rank {hdr.get('rank')} of world "
                                 f"{hdr.get('world_size')}, wanted rank {o} of {old_world}")
        if o == 0:
            header0 = hdr
        for name, t in slot.tensors(hdr).items():
            parts.setdefault(name, []).append(t.clone())
    full = {name: (ts[0] if ts[0].dim() == 0 else torch.cat(ts)) for name, ts in parts.items()
            if name == "param_shard" or name.startswith("opt.")}
    return full, header0

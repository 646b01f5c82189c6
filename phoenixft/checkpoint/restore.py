"""Restore planner: the one place that chooses where each rank's committed snapshot comes
from when a new generation forms.

Run collectively by all members after the generation's group is built (so no old
snapshot thread can still write). Each member asks its *local sources* (tiers it reads
by itself, fastest first: today its node's shared memory, its own slot then the replica
slots it holds for peers) which ranks' snapshots of step t it can serve, verified
(checksum included). The members all-gather that table and decide the same plan:

1. a copy on the member's own node (the survivor's own slot; a spare on the dead rank's
   node; a spare beside the replica holder): read from shared memory, no network;
2. otherwise the lowest member that holds a verified copy sends it over the group
   ("peer_memory");
3. otherwise the persistent tier (`PersistentSource`: base + deltas in a directory or
   S3), which every member can read: the rank reads its own record;
4. no copy anywhere: `IntegrityError` naming the rank and step (never a silent load).

Memory tiers are `SnapshotSource`s asked for verified copies; the persistent tier only
says cheaply which records its manifests hold (`available`), and is read when chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.record import Snapshot
from phoenixft.checkpoint.slots import SlotFile, SlotKind, slot_path
from phoenixft.checkpoint.tiers import ShmTier
from phoenixft.comm.collectives import GroupOps


class SnapshotSource(Protocol):
    """A tier a member reads without a peer's help.

    `name` is what recoveries report as their source. `open` returns a verified copy
    (complete, for `step`, checksum matching, written by `generation` when one is given)
    of `rank`'s snapshot, or None when this tier has none; a missing or corrupt copy is
    never an error here (the planner falls through to the next source), and a returned
    slot is never rewritten while the planner uses it."""

    name: str

    def open(self, rank: int, step: int, generation: int | None) -> SlotFile | None: ...


class ShmSource:
    """A memory tier (`tiers.ShmTier`, the one the tiers' shared test body checks) as a
    restore source: "snap" (a rank's own snapshot) or "rep" (a replica this node holds
    for a peer)."""

    def __init__(self, shm_dir: str | Path, kind: SlotKind, name: str,
                 report: Callable[[str, str], None] | None = None) -> None:
        self.tier, self.name = ShmTier(shm_dir, kind), name
        self.report = report or (lambda tier, error: None)  # a damaged copy, named

    def open(self, rank: int, step: int, generation: int | None) -> SlotFile | None:
        try:
            f, hdr = self.tier.open(step, rank)
        except KeyError:  # not here
            return None
        except IntegrityError as exc:
            self.report(self.name, str(exc))
            return None
        # After a world-size change an abandoned snapshot of the same step from an older
        # numbering may still sit in a slot: only the generation asked for counts.
        if generation is not None and hdr.generation != generation:
            return None
        return f


class PersistentSource:
    """Records of committed steps in persistent storage (`tiers.FsspecTier`). A record is
    read (base + delta, checksums verified) into a scratch slot in shared memory once, and
    kept there for the rest of the restore."""

    name = "persistent"

    def __init__(self, tier, scratch_dir: str | Path,
                 report: Callable[[str, str], None] | None = None,
                 job_id: str | None = None) -> None:
        self.tier, self.job_id = tier, job_id
        self.report = report or (lambda tier, error: None)
        self._scratch = ShmTier(scratch_dir, SlotKind.DISK)
        self._manifests: dict[int, dict] = {}
        self._opened: dict[tuple[int, int], SlotFile] = {}
        self._named: set[int] = set()

    def steps(self) -> list[int]:
        """Committed steps to restore from, oldest first: those whose manifest reads and
        (given a job id) that this job committed. Each manifest passed over is reported
        once, naming the file and why: one unreadable newest manifest used to stop a
        resume, and another job's manifest was restored without a word."""
        from phoenixft.checkpoint.manifests import scan

        found = scan(self.tier)
        steps = []
        for s in sorted([*found.good, *found.bad]):
            m = found.good.get(s)
            why = found.bad.get(s) or (
                f"{self.tier.url}: step {s} was committed by job {m['job_id']}, not this job "
                f"({self.job_id}): not restored" if self.job_id and m["job_id"] != self.job_id
                else None)
            if why is None:
                self._manifests[s] = m
                steps.append(s)
            elif s not in self._named:
                self._named.add(s)
                self.report(self.name, why)
        return steps

    def manifest(self, step: int) -> dict:
        if step not in self._manifests:
            self._manifests[step] = self.tier.read_manifest(step)
        return self._manifests[step]

    def available(self, rank: int, step: int) -> bool:
        try:
            return any(r["rank"] == rank for r in self.manifest(step)["records"])
        except (KeyError, IntegrityError):
            return False

    def open(self, rank: int, step: int) -> SlotFile:
        """The verified snapshot of (rank, step); IntegrityError names what is damaged."""
        if (rank, step) not in self._opened:
            self._scratch.put(step, rank, self.tier.get(step, rank, self.manifest(step)))
            self._opened[rank, step] = SlotFile(slot_path(self._scratch.shm_dir, SlotKind.DISK, rank, step))
        return self._opened[rank, step]


MEMORY, PERSISTENT = 1, 2  # copy-table entries: where a member can get a snapshot from


class RestorePlanner:
    """Chooses and fetches every rank's snapshot for a new generation (see module doc).

    `scratch_dir` is where copies sent by peers are written (this node's shared memory)."""

    def __init__(self, local: list[SnapshotSource], scratch_dir: str | Path,
                 persistent: PersistentSource | None = None) -> None:
        self.local = local
        self.scratch_dir = Path(scratch_dir)
        self.persistent = persistent
        # (rank, step, generation) -> what `local_copy` found, for one recovery (`forget`)
        self._found: dict[tuple, tuple[SlotFile, str] | None] = {}

    def forget(self) -> None:
        """Start a recovery afresh. Within one, each local copy is verified once: a join
        asks for the same copies several times (the restore step's agreement, the plan,
        the load), and hashing every rank's slot again each time cost every member tens of
        milliseconds on a busy node. No snapshot thread writes during a recovery (the
        members stopped theirs before joining), so a copy verified in it stays verified."""
        self._found = {}

    @classmethod
    def for_node(cls, shm_dir: str | Path, persistent_tier=None,
                 report: Callable[[str, str], None] | None = None,
                 job_id: str | None = None) -> RestorePlanner:
        """The sources of one node; `report(tier, error)` hears of every damaged copy
        passed over (the event log names them). `job_id`: restore only manifests it
        committed."""
        persistent = (PersistentSource(persistent_tier, shm_dir, report, job_id)
                      if persistent_tier else None)
        return cls([ShmSource(shm_dir, SlotKind.SNAP, "local_snapshot", report),
                    ShmSource(shm_dir, SlotKind.REP, "local_replica", report)], shm_dir, persistent)

    def local_copy(self, rank: int, step: int,
                   generation: int | None = None) -> tuple[SlotFile, str] | None:
        """The fastest verified local copy of (rank, step), with its source name."""
        key = (rank, step, generation)
        if key not in self._found:
            self._found[key] = next(((f, src.name) for src in self.local
                                     if (f := src.open(rank, step, generation)) is not None), None)
        return self._found[key]

    def copy_table(self, ops: GroupOps, world_size: int, old_world: int, step: int,
                   generation: int | None):
        """Collective: where each member can get each old rank's snapshot from.
        Returns (this member's memory copies by old rank, table[member][old rank]) with
        entries MEMORY (a verified copy on its node), PERSISTENT (a committed record) or 0."""
        copies = {r: self.local_copy(r, step, generation) for r in range(old_world)}
        p = self.persistent
        have = torch.tensor([MEMORY if copies[r] is not None else
                             PERSISTENT if p is not None and p.available(r, step) else 0
                             for r in range(old_world)], dtype=torch.int32)
        table = torch.zeros(world_size * old_world, dtype=torch.int32)
        ops.all_gather_into(table, have, "restore planning")
        return copies, table.view(world_size, old_world)

    def restore(self, ops: GroupOps, *, rank: int, world_size: int, step: int,
                generation: int | None = None) -> tuple[SlotFile, dict, str]:
        """Collective, same world size. Returns (slot, verified header, source) for this
        member's rank: a local source's name, or "peer_memory" (sent by a peer)."""
        copies, table = self.copy_table(ops, world_size, world_size, step, generation)
        senders: dict[int, int] = {}
        for r in range(world_size):
            if table[r][r] == MEMORY:
                continue
            holders = [h for h in range(world_size) if table[h][r] == MEMORY]
            if holders:
                senders[r] = holders[0]
            elif table[r][r] != PERSISTENT:
                raise IntegrityError(
                    f"no surviving copy of rank {r}'s snapshot for step {step}: its own node "
                    "and every replica holder are gone or corrupt, and no persisted record "
                    "holds it; restart from a persisted checkpoint (--persist, --resume), or "
                    "run with --replicas 1 (a copy on another node, or on the same node "
                    "against damaged slots)")
        mine, source = copies[rank] if copies[rank] is not None else (None, "")
        if mine is None and rank not in senders:
            mine, source = self.persistent.open(rank, step), PersistentSource.name
        for r, s in sorted(senders.items()):  # same order on every member
            if rank == s:
                self._send(ops, copies[r][0], r)
            elif rank == r:
                mine, source = self._receive(ops, s, r, step), "peer_memory"
        if mine is None:  # unreachable: every rank had a copy or was sent one above
            raise IntegrityError(f"rank {rank}: no snapshot of step {step} after planning")
        # a local copy was verified when the table was made; a sent or read one is now
        hdr = mine.header() if source in (s.name for s in self.local) else mine.verify(step)
        if hdr.rank != rank:
            raise IntegrityError(f"{mine.path}: snapshot belongs to rank {hdr.rank}, "
                                 f"not rank {rank}")
        return Snapshot(hdr, mine.tensors(hdr)), source

    @staticmethod
    def _send(ops: GroupOps, slot: SlotFile, dst: int) -> None:
        n = torch.tensor([slot.used_nbytes()], dtype=torch.int64)
        ops.send(n, dst, 2, "restore size send")
        ops.send(slot.tensor[:int(n)], dst, 3, "restore send")

    def _receive(self, ops: GroupOps, src: int, rank: int, step: int) -> SlotFile:
        n = ops.recv(torch.zeros(1, dtype=torch.int64), src, 2, "restore size recv")
        slot = SlotFile(slot_path(self.scratch_dir, SlotKind.SNAP, rank, step))
        slot.ensure(int(n))
        slot.begin_write(step)
        ops.recv(slot.tensor[:int(n)], src, 3, "restore recv")
        return slot

    def gather_old_shards(self, ops: GroupOps, *, rank: int, world_size: int, old_world: int,
                          step: int, generation: int) -> list[Snapshot]:
        """Collective, for a world-size change: every member gets every old rank's verified
        snapshot of step t (copies), in old rank order, so that its layout can
        cut its new share of the state from them. Each old snapshot comes from the lowest
        member holding a verified copy, broadcast to all."""
        copies, table = self.copy_table(ops, world_size, old_world, step, generation)
        out = []
        for o in range(old_world):
            holders = [m for m in range(world_size) if table[m][o] == MEMORY]
            if holders:
                src = holders[0]
                mine = copies[o][0] if rank == src else None
            elif table[0][o] == PERSISTENT:  # member 0 reads the record and shares it
                src = 0
                mine = self.persistent.open(o, step) if rank == 0 else None
            else:
                raise IntegrityError(
                    f"no surviving copy of old rank {o}'s snapshot for step {step} (generation "
                    f"{generation}): its node and its replica holders are gone or corrupt")
            slot = self._broadcast_slot(ops, mine, src, o, step)
            hdr = slot.verify(step)
            if hdr.rank != o or hdr.world_size != old_world:
                raise IntegrityError(f"{slot.path}: holds rank {hdr.rank} of world "
                                     f"{hdr.world_size}, wanted rank {o} of {old_world}")
            out.append(Snapshot(hdr, {name: t.clone() for name, t in slot.tensors(hdr).items()}))
        return out

    def _broadcast_slot(self, ops: GroupOps, mine: SlotFile | None, src: int, old_rank: int,
                        step: int) -> SlotFile:
        n = torch.tensor([mine.used_nbytes() if mine is not None else 0], dtype=torch.int64)
        ops.broadcast(n, src, "reshard size")
        slot = mine
        if slot is None:
            slot = SlotFile(slot_path(self.scratch_dir, SlotKind.XFER, old_rank, step))
            slot.ensure(int(n))
        ops.broadcast(slot.tensor[:int(n)], src, "reshard data")
        return slot

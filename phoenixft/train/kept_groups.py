"""Which mesh groups a new generation keeps from the last one: recovery that stays local.

A generation used to build every process group anew. At scale that is the recovery's
cost (every communicator of the job rebuilt for one lost rank), and it interrupts
groups that never saw the failure. Now a mesh group (FSDP2's dp_shard, tp, a pipeline's
pp, HSDP's dp_replicate) is *kept*, the same process-group object, when the new
generation has a group of the same dimension with the same members in the same places
(matched by worker id, not by name: a replica group renumbered after another left
keeps its groups), and the group is whole: gloo and NCCL match operations by their
order on a group, so it is kept only when every member issued the same collectives,
every send met its receive, and nothing failed as it was issued (each group's `Ledger`,
counted by `GroupOps` and `SwapGroup`). A collective its waiters gave up on (a new plan
interrupted them) that every member issued still finishes: the join waits for it
(`Ledger.settle`) before using the group. Every other group is built anew.

Agreement. Each member decides alone what it could keep, but a group is kept only if
all its members keep it: at the join of generation g every member writes one vote per
mesh group of g (`Keys.keep_vote`): its ledger of the group it holds, or "build" (it
holds none, or its build already started). A member that holds a candidate waits for
every vote of that group and keeps it iff all are ledgers and they can agree
(`ledger.agreement`: a member that left before issuing the last collectives its peers
issued issues them now, `ledger.drain`, when they were all-reduces); otherwise it builds
the group late, under the generation's prefix, where the members that voted "build"
already started it. Everyone reads the same votes, so everyone decides the same.

Shrinking. Where the new group is the old one less members that left the job (no one
added, the rest in order: HSDP's cross-group groups when a replica group leaves without
a spare), a backend that shrinks a communicator in place (NCCL >= 2.27,
`ncclCommShrink`, through the backend's `shrink`) shrinks it instead of building anew,
when every member votes "shrink"; gloo cannot, and builds. The shrink aborts the
parent's operations in flight (the departed members'), so the ledgers are not asked.
This path needs NCCL: CI (gloo) never takes it, and one GPU cannot show it (NCCL refuses
two ranks of a communicator on one device): `scripts/gpu-check` reports whether the
GPU's NCCL backend supports shrinking, no more.

Parking. A worker leaving a generation (a failure, a new plan) does not destroy its mesh
groups: a group an operation failed in as it was issued is buried at once
(`GroupBuilds.bury`), the others are parked under their key until the next join decides;
what that join does not keep is buried then, and all of them when a plan leaves this
worker out. The training group ("train", the world) and the replication group span the
job, so they always contain a replaced rank: they are built anew every generation, as
before.

Which collectives a kept group's members issued is what decides, so a group without the
dead rank is rebuilt too when one of its members left without issuing a collective the
others issued and that cannot be issued again (FSDP2's own collectives inside the
user's passes: in an FSDP2 job whose ranks are one failure unit, a rank that waited on
the dead one mid-step while its row waited on it). HSDP's cross-group dp_replicate group
whose member in the dead rank's replica group never reached the step's reduction is
drained and kept. HSDP's untouched replica groups are never interrupted
(`WorkSplit.in_unit`) and always keep theirs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import torch.distributed as dist

from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan
from phoenixft.comm.collectives import GroupOps, Interrupt, call_with_deadline
from phoenixft.comm.ledger import agreement, drain

GroupKey = tuple[str, tuple[str, ...]]  # (mesh dimension, member worker ids by group rank)
BUILD = "build"
SHRINK = "shrink"  # the vote of a member that can shrink the group it holds to this one
# ncclCommShrink's flag that aborts the parent's operations in flight (the dead peer's)
SHRINK_ABORT = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)


def shrink_of(old: tuple[str, ...], new: tuple[str, ...], departed: Callable[[str], bool]
              ) -> list[int] | None:
    """The ranks of a group of members `old` to exclude so that it becomes `new` (fewer
    members, the rest in the same order, every one left out `departed` from the job), or
    None when `new` is not such a shrink of `old`."""
    if len(new) >= len(old) or [w for w in old if w in set(new)] != list(new):
        return None
    out = [i for i, w in enumerate(old) if w not in set(new)]
    return out if all(departed(old[i]) for i in out) else None


def can_shrink(pg: dist.ProcessGroup) -> bool:
    """Whether the backend shrinks a communicator in place (NCCL >= 2.27's
    ncclCommShrink; gloo says no)."""
    try:
        return bool(pg.supports_shrinking)
    except Exception:
        return False


def dimension(name: str) -> str:
    """A mesh group's dimension: "dp_shard" of "dp_shard.2.0"."""
    return name.split(".")[0]


class KeptGroups:
    """One worker's parked mesh groups and the keep/build decision at each join (see the
    module docstring). `mesh_groups(rank, world_size)` is the layout's
    (`Membership.mesh_groups`). Thread-safe: the plan watcher asks for candidates while
    the training thread parks."""

    def __init__(self, mesh_groups: Callable[[int, int], dict[str, tuple[int, int]]]) -> None:
        self.mesh_groups = mesh_groups
        self._parked: dict[GroupKey, GroupOps] = {}
        self._live: dict[GroupKey, GroupOps] = {}  # the generation joined last
        self._ranks: tuple[int, dict[str, list[int]]] | None = None  # (world size, groups)
        self._lock = threading.Lock()

    # -- keys --------------------------------------------------------------------------
    def group_ranks(self, world_size: int) -> dict[str, list[int]]:
        """Every mesh group of a world of `world_size` ranks: name -> its ranks by place."""
        if self._ranks is None or self._ranks[0] != world_size:
            out: dict[str, dict[int, int]] = {}
            for r in range(world_size):
                for name, (place, _) in self.mesh_groups(r, world_size).items():
                    out.setdefault(name, {})[place] = r
            self._ranks = (world_size, {n: [p[i] for i in sorted(p)] for n, p in out.items()})
        return self._ranks[1]

    def key(self, plan: Plan, name: str) -> GroupKey:
        ranks = self.group_ranks(plan.world_size)[name]
        return dimension(name), tuple(plan.members[r] for r in ranks)

    def candidates(self, plan: Plan, names) -> set[str]:
        """The names among `names` (plan's mesh groups of this worker) that a group this
        worker holds, live or parked, may stand for (as it is, or shrunk)."""
        with self._lock:
            held = {**self._live, **self._parked}
        return {n for n in names if self.key(plan, n) in held
                or self._shrinkable(plan, n, held) is not None}

    def _shrinkable(self, plan: Plan, name: str, held: dict[GroupKey, GroupOps]
                    ) -> tuple[GroupKey, list[int]] | None:
        """A held group that group `name` of `plan` is a shrink of, on a backend that
        shrinks: its key and the ranks to exclude."""
        dim, new = self.key(plan, name)
        for (d, old), ops in held.items():
            if d == dim and can_shrink(ops.pg):
                out = shrink_of(old, new, lambda w: plan.rank_of(w) is None)
                if out is not None:
                    return (d, old), out
        return None

    # -- leaving a generation ------------------------------------------------------------
    def park(self, mesh_ops: dict[str, GroupOps], plan: Plan | None
             ) -> tuple[list[dist.ProcessGroup], dict[str, str]]:
        """The generation `plan` is left: park its mesh groups `mesh_ops` whose ledgers are
        clean; returns those to bury now and each group's state ("clean", or why not)."""
        dead, states = [], {}
        with self._lock:
            self._live = {}
            for name, ops in mesh_ops.items():
                # (a work still open may finish: `decide` gives it a moment, then judges)
                if ops.ledger.spoiled is None and plan is not None:
                    old = self._parked.get(self.key(plan, name))
                    if old is not None and old.pg is not ops.pg:
                        dead.append(old.pg)
                    self._parked[self.key(plan, name)] = ops
                    states[name] = ops.ledger.why_not() or "clean"
                else:
                    dead.append(ops.pg)
                    states[name] = ops.ledger.why_not() or "the generation's plan is unknown"
        return dead, states

    def release(self) -> list[dist.ProcessGroup]:
        """Every parked group, to bury (this worker is in no plan now)."""
        with self._lock:
            dead, self._parked = [ops.pg for ops in self._parked.values()], {}
        return dead

    # -- joining one -------------------------------------------------------------------
    def decide(self, plan: Plan, rank: int, started: set[str], store: dist.Store,
               connect: Callable[[], dist.Store], interrupt: Interrupt, timeout_s: float
               ) -> tuple[dict[str, GroupOps], list[dist.ProcessGroup], set[str]]:
        """Plan `plan`'s join: vote for each of this rank's mesh groups, and wait for the
        votes of those it could keep (`started`: names whose build began; they are not
        kept). Returns the groups kept (name -> the parked ops, or the shrunk group's),
        the parked groups to bury (the rest), and the names of those shrunk."""
        g, mine = plan.generation, self.mesh_groups(rank, plan.world_size)
        with self._lock:
            offer = {n: self._parked.get(self.key(plan, n)) for n in mine if n not in started}
            parked = dict(self._parked)
        offer = {n: ops for n, ops in offer.items() if ops is not None}
        shrinks = {n: self._shrinkable(plan, n, parked) for n in mine
                   if n not in started and n not in offer}
        shrinks = {n: x for n, x in shrinks.items() if x is not None}
        summaries = {n: ops.ledger.summary() for n, ops in offer.items()}
        names = list(mine)
        if names:  # (a layout without mesh groups costs the store nothing here)
            store.multi_set([Keys.keep_vote(g, n, mine[n][0]) for n in names],
                            [json.dumps(summaries[n]) if n in summaries else
                             SHRINK if n in shrinks else BUILD for n in names])
        kept: dict[str, GroupOps] = {}
        shrunk: dict[str, GroupKey] = {}
        if offer or shrinks:
            keys = {n: [Keys.keep_vote(g, n, p) for p in range(mine[n][1])]
                    for n in (*offer, *shrinks)}
            flat = [k for ks in keys.values() for k in ks]
            votes = dict(zip(flat, call_with_deadline(
                lambda: _read_votes(connect, flat, timeout_s), interrupt, timeout_s,
                f"generation {g}'s votes on the groups it may keep")))
            for n, ks in keys.items():
                got = [votes[k] for k in ks]
                if n in shrinks:
                    if all(v == SHRINK for v in got):  # every member can: all shrink
                        old_key, out = shrinks[n]
                        old = parked[old_key]
                        kept[n] = GroupOps(call_with_deadline(
                            lambda old=old, out=out: old.pg.shrink(out, SHRINK_ABORT, None),
                            interrupt, timeout_s, f"generation {g} shrinking {n}"),
                            interrupt, timeout_s)
                        shrunk[n] = old_key
                    continue
                agreed = None if BUILD in got or SHRINK in got else \
                    agreement([json.loads(v) for v in got])
                if agreed is not None:
                    kept[n] = offer[n]
                    drain(offer[n].pg, offer[n].ledger, agreed.get(mine[n][0], []))
        for n, ops in kept.items():  # every member issued its open works: they finish
            if n not in shrunk:
                ops.ledger.settle(interrupt, timeout_s, f"generation {g} keeping {n}: its "
                                                        "last collectives finishing")
        with self._lock:  # (a shrunk group's parent is buried: the new one is its own)
            taken = {self.key(plan, n) for n in kept if n not in shrunk}
            dead = [ops.pg for k, ops in self._parked.items() if k not in taken]
            self._parked = {}
            self._live = {self.key(plan, n): ops for n, ops in kept.items()}
        return kept, dead, set(shrunk)

    def joined(self, plan: Plan, mesh_ops: dict[str, GroupOps]) -> None:
        """The join took `mesh_ops` (kept and built): they are the live groups."""
        with self._lock:
            self._live = {self.key(plan, n): ops for n, ops in mesh_ops.items()}


def _read_votes(connect: Callable[[], dist.Store], keys: list[str], timeout_s: float) -> list[str]:
    """(A helper thread, its own store connection: an abandoned wait keeps blocking.)"""
    store = connect()
    if not kv.wait_for(store, keys, timeout_s):
        raise TimeoutError(f"{len(keys)} votes not all written within {timeout_s:.0f}s")
    return [v.decode() for v in store.multi_get(keys)]

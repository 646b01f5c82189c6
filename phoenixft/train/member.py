"""A worker's place in the job's generations: the generation protocol, worker side.

The leader writes each generation's plan once (`gen/{g}/plan`); a `Member` waits for the
plans that include it (a warm spare waits here until activated), joins each one and
recovers into the next when a collective fails or a newer plan is announced. Joining
generation g, in named phases:

1. enter: take the plan's rank, start watching for plan g+1 (it interrupts every wait);
2. build groups: the training group and a separate replication group, each on its own
   store prefix and its own store connection, each with a deadline;
3. prepare: lay the rank's state out for the world size (`Membership.join`: with
   ZeRO-1 the flat parameters and the sharded optimizer), a fresh gradient buffer;
4. restore: agree on the restore point and restore (`recovery.py`), or, at the very
   start, take rank 0's initial parameters;
5. snapshots: a new snapshot thread for this generation's ranks and replica holders;
6. barrier, then record the recovery (rank 0) and the member's restore source.

A spare activated for a dead rank first computes ahead when it can (`_speculate`: the
dead rank's microbatches of the step in flight, from the node's snapshots) and joins
after; `recovery.restore` keeps or drops that work.

Failure rules: any failure while joining abandons that generation and waits for the next
plan; a broken group is never destroyed (see `recover`); the plan kinds "done" and
"abort" end the process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.persist import Persister
from phoenixft.checkpoint.restore import RestorePlanner
from phoenixft.checkpoint.snapshot import Snapshotter
from phoenixft.checkpoint.tiers import FsspecTier
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.membership import Plan, PlanKind, crossing_replicas
from phoenixft.cluster.node_plans import NodePlans
from phoenixft.cluster.node_tally import NodeShare
from phoenixft.cluster.protocol import file_report, joined, newest_plan, read_plan
from phoenixft.comm.collectives import (
    CommFailure,
    GenerationChanged,
    GroupOps,
    Interrupt,
    Pending,
)
from phoenixft.faults.inject import Injector, parse_env
from phoenixft.observe.events import EventLog
from phoenixft.train import protection, quota, recovery
from phoenixft.train.ahead import local_step_of_every_rank
from phoenixft.train.config import SessionConfig
from phoenixft.train.consensus import Seal
from phoenixft.train.fault_hooks import member_hooks
from phoenixft.train.fingerprints import carried_slots, sealed
from phoenixft.train.group_builds import GroupBuilds, drop
from phoenixft.train.kept_groups import KeptGroups
from phoenixft.train.lifecycle import JobAborted
from phoenixft.train.rank_state import RankState, SnapSource
from phoenixft.train.recovery import JoinContext, RestorePoint
from phoenixft.train.reduce_layout import ReduceLayout
from phoenixft.train.step import Ahead, Step

WATCH_SLICE_S = 2.0  # a plan watcher's store wait at a time


class Member:
    """The generation protocol for one worker. `rank`, `world_size`, `generation` and
    `ops` (the training group) describe the generation it is in."""

    def __init__(self, cfg: SessionConfig, *, store: dist.Store, events: EventLog,
                 make_step, led: bool = True) -> None:
        self.cfg = cfg
        # False for a standalone session: no leader can publish another generation, so no
        # thread watches for one (its timed store waits would also log a warning each)
        self.led = led
        self.wid = cfg.worker_id
        self.store = store
        self.events = events
        self.make_step = make_step  # (index, ids, m) -> Step
        self.interrupt = Interrupt()
        # interrupts the collectives inside this worker's failure unit (an HSDP replica
        # group: `WorkSplit.in_unit`) only when a new generation changes the unit
        self.unit_interrupt = Interrupt()
        self._slow = None  # an injected `slow` fault that fired on this worker (`slowdown`)
        self.wrong = False  # an injected `wrong` fault fired on this worker (recompute.py)
        self._ran_plan: Plan | None = None  # the plan of the generation joined last
        self.injector = Injector(parse_env(cfg.inject), member_hooks(
            store=store, wid=self.wid, shm_dir=cfg.shm_dir, events=events,
            agent_pid=cfg.agent_pid, before_fault=self.tell_passes,
            settle=self._previous_step_committed,
            slow=lambda spec: setattr(self, "_slow", spec),
            wrong=lambda spec: setattr(self, "wrong", True),
            where=lambda: {"rank": self.rank, "gen": self.generation,
                           "world_size": self.world_size}))
        self.tier = FsspecTier(cfg.persistence.url) if cfg.persistence.url else None
        self.planner = RestorePlanner.for_node(
            cfg.shm_dir, self.tier, report=lambda tier, error: self.events.emit(
                "restore_source_failed", tier=tier, rank=self.rank, gen=self.generation,
                error=error[:500]), job_id=self._job_id())
        self.persister: Persister | None = None
        self.plan: Plan | None = None
        self._read: Plan | None = None  # the newest plan read (`_remember`)
        # plans handed over by the node's agent (`cluster/node_plans.py`), else the store's
        self.node_plans = NodePlans(cfg.node_plans) if cfg.node_plans else None
        self.generation = -1
        self.rank = -1
        self.world_size = 0
        self.ops: GroupOps | None = None
        self.snap: Snapshotter | None = None
        self.seal = Seal()  # this rank's unique state, hashed once each snapshot is copied
        self._rep_pg = None
        self._mesh_ops: dict[str, GroupOps] = {}  # the layout's mesh groups (`mesh_groups`)
        self.kept: KeptGroups | None = None  # mesh groups kept across generations
        self._groups: dict[str, dict] = {}  # the last join's groups: size, kept, identity
        self._layout = None  # the rank's Layout, once `start` is given it
        self._stopped = False
        self._watchers: list[threading.Thread] = []
        self._device: torch.device | None = None  # where the training group lives
        self.builds = GroupBuilds(self.connect, self.interrupt, bind_host=cfg.local_addr,
                                  timeout_s=cfg.timeouts.collective_timeout_s)
        self._hooked = False  # the optimizer pre-step hook is registered with the layout
        self._rebuilt = False  # the last join built the optimizer anew (`_prepare`)
        self.passes = 0  # microbatch passes not yet added to the store's counter

    def _job_id(self) -> str | None:
        return self.store.get(Keys.JOB_ID).decode() if self.store.check([Keys.JOB_ID]) else None

    def connect(self) -> dist.Store:
        """A new store connection (one per blocking thread or group build)."""
        return kv.connect(self.cfg.store)

    # -- plans ------------------------------------------------------------------------
    def await_plan(self, g: int, timeout_s: float) -> Plan:
        """The newest plan at generation >= g, waiting up to timeout_s for the first."""
        deadline = time.monotonic() + timeout_s
        try:
            while not self._wait_plan(self.store, g, min(60.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise JobAborted(f"phoenixft: no generation {g} plan within {timeout_s:.0f}s; "
                                     "is the agent alive?")
        except kv.StoreGone as exc:
            raise JobAborted(f"phoenixft: worker {self.wid} stops: {exc}; its agent or the store's "
                             "host is gone") from None
        if self.node_plans is not None:
            try:
                return self._remember(self.node_plans.newest(g, known=self._read))
            except FileNotFoundError:  # the node's shared memory was deleted under it
                pass
        return self._remember(newest_plan(self.store, g, known=self._read))

    def _wait_plan(self, store: dist.Store, g: int, timeout_s: float,
                   stop: Callable[[], bool] | None = None) -> bool:
        """Until plan g is out (True) or `timeout_s` passed: its file on this node when
        the agent hands plans over (a watcher's wait ends at `stop()` too: the member's
        shutdown joins it at once, not a slice later), else the store key."""
        if self.node_plans is not None:
            if self.node_plans.wait(g, timeout_s, stop):
                return True
            # nothing on the node: if its shared memory was deleted, the plans with it
            return not self.node_plans.dir.exists() and kv.wait_for(store, [Keys.plan(g)], 0.001)
        return kv.wait_for(store, [Keys.plan(g)], timeout_s)

    def _read_plan(self, store: dist.Store, g: int) -> Plan:
        """Plan g, which is out (as a change to the one read last, from the store)."""
        if self.node_plans is not None:
            try:
                return self.node_plans.read(g, self._read)
            except FileNotFoundError:  # the node's shared memory was deleted under it
                return Plan.from_json(store.get(Keys.plan(g)))
        return read_plan(store, g, self._read)

    def _has_plan(self, g: int) -> bool:
        if self.node_plans is not None and self.node_plans.has(g):
            return True
        return self.store.check([Keys.plan(g)])

    def _whole_plan(self, g: int) -> Plan:
        """Plan g (it is out), whole."""
        if self.node_plans is not None:
            try:
                return self.node_plans.read(g)
            except FileNotFoundError:  # the node's shared memory was deleted under it
                pass
        return Plan.from_json(self.store.get(Keys.plan(g)))

    def _remember(self, plan: Plan) -> Plan:
        """The newest plan this worker has read (the watcher or `await_plan`): the next
        one is read as a change to it, and the same one is not read twice."""
        if self._read is None or plan.generation > self._read.generation:
            self._read = plan
        return plan

    def start(self, state: RankState) -> Step | None:
        """Wait (as a spare, for as long as it takes) for a plan that includes this
        worker, and join it. Fixes M and the starting world size from generation 0."""
        self._layout = state.layout
        self.kept = KeptGroups(state.layout.members.mesh_groups)
        plan = self.await_plan(0, self.cfg.timeouts.spare_wait_s)
        first = self._whole_plan(0)
        state.initial_world = first.world_size or 1
        state.m = state.m or state.layout.work.default_m(state.initial_world)
        return self.enter(plan, state)

    def enter(self, plan: Plan, state: RankState, in_flight: Step | None = None) -> Step | None:
        """Join the first plan, from `plan` on, that includes this worker (retrying newer
        ones when a join fails). Returns the step to resume inside, if any."""
        while True:
            if plan.kind is not PlanKind.RUN:
                self._leave(plan)
            if plan.rank_of(self.wid) is None:
                if self.kept is not None:
                    drop(self.kept.release())
                if state.joined and not state.layout.members.can_move():
                    self._leave_unit(plan)
                plan = self.await_plan(plan.generation + 1, self.cfg.timeouts.spare_wait_s)
                continue
            if in_flight is None and not state.joined:
                ahead = self._speculate(plan, state)
                if ahead is not None:
                    return ahead  # joined once its microbatches are computed (session.py)
            try:
                return self.join(plan, state, in_flight)
            except IntegrityError as exc:  # nothing left to restore from: the job cannot go on
                self.report(ReportKind.FATAL, str(exc))
                raise JobAborted(f"phoenixft: worker {self.wid} cannot recover: {exc}") from None
            except CommFailure as exc:
                self.events.emit("join_failed", gen=plan.generation, error=str(exc),
                                 groups=self._leave_groups())
                plan = self.await_plan(plan.generation + 1, self.cfg.timeouts.join_timeout_s)

    def slowdown(self, step: int) -> float:
        """How many times slower this worker computes step `step` (an injected `slow`)."""
        s = self._slow
        if s is None or step < s.step or (s.every and (step - s.step) % s.every):
            return 1.0
        return s.factor

    def _leave_unit(self, plan: Plan) -> None:
        """Generation `plan` goes on without this worker's replica group (a member of it
        died and no spare was left), and a sharded worker cannot take another place: it
        exits cleanly (the leader counts it gone, not failed; `--respawn` replaces it)."""
        self.events.emit("left_with_group", gen=plan.generation, rank=self.rank,
                         reason=plan.reason[:300])
        self.store.set(Keys.left(self.wid), str(plan.generation))
        self.shutdown()
        raise SystemExit(0)

    def _leave(self, plan: Plan) -> None:
        self.shutdown()
        if plan.kind is PlanKind.ABORT:
            raise JobAborted(f"phoenixft: job stopped by the leader: {plan.reason}")
        raise SystemExit(0)

    def _watch(self, g_next: int) -> None:
        """Announce plan g_next to every waiter of this process as soon as it appears.
        Waits in slices of WATCH_SLICE_S (a store request and its cancellation each: at
        4,096 members every 0.25 s was 33k requests a second on the store), so the thread
        ends with its generation or the process; a plan ends the wait at once."""
        try:
            store = self.connect()
            g = g_next
            while self.generation < g_next and not self._stopped:
                if self._wait_plan(store, g, WATCH_SLICE_S, lambda: self._stopped):
                    plan = self._remember(self._read_plan(store, g))
                    self.interrupt.announce(g)
                    unit_kept = self._unit_same(self.plan, plan)
                    if not unit_kept:
                        self.unit_interrupt.announce(g)
                    if (g == g_next and plan.kind is PlanKind.RUN
                            and plan.rank_of(self.wid) is not None
                            and self._device is not None and not self._stopped):
                        self._start_builds(plan)  # while the training thread computes
                    if not unit_kept:
                        return
                    # this worker's unit goes on as it was, inside a collective maybe:
                    # a later plan (one of its members died meanwhile) must still reach it
                    g += 1
        except (kv.StoreGone, RuntimeError):
            return  # the store is gone: the training thread finds out on its next wait

    def _unit_same(self, old: Plan | None, new: Plan) -> bool:
        """Whether this worker's failure unit has the same members, in the same places,
        in plan `new` as in `old` (its rank and the unit's number may differ)."""
        if old is None or self._layout is None or new.kind is not PlanKind.RUN:
            return False
        r, r2 = old.rank_of(self.wid), new.rank_of(self.wid)
        if r is None or r2 is None:
            return False
        unit = self._layout.work.unit_ranks
        return ([old.members[x] for x in unit(r, old.world_size)]
                == [new.members.get(x) for x in unit(r2, new.world_size)])

    # -- joining a generation ----------------------------------------------------------
    def join(self, plan: Plan, state: RankState, in_flight: Step | None = None) -> Step | None:
        t0 = time.time()
        self.planner.forget()  # copies are verified afresh for each join, once
        first = not state.joined
        ahead = in_flight is not None and in_flight.speculative is not None
        if self.plan is not plan:  # (a spare that computed ahead entered it already)
            self._enter_generation(plan)
        self._device = state.layout.math.device
        early = self.builds.started(plan.generation)  # its groups were started before the join
        phases = self._build_groups(plan, t0)
        if self.generation > 0:  # every member is inside this join now (the group formed)
            self.injector.at_recovery(self.rank, self.generation)
        self._prepare(state, first)
        state.layout.members.bind(self.ops, self.generation, state.m_for(self.world_size),
                          self._mesh_ops)
        phases["rep_group"] = time.time() - t0
        ctx = JoinContext(generation=self.generation, rank=self.rank,
                          world_size=self.world_size, ops=self.ops, store=self.store,
                          planner=self.planner, events=self.events, make_step=self.make_step,
                          resume=self.cfg.persistence.resume,
                          # a worker's first generation (a spare that computed ahead
                          # included): no earlier unit to compare, its own work decides
                          unit_intact=(self._ran_plan is None
                                       or self._unit_same(self._ran_plan, plan)))
        point = recovery.restore_point(ctx, state, new_member=first or ahead, ahead=ahead)
        source, pending = self._restore(ctx, state, point, in_flight, first)
        self.planner.forget()
        phases["restore"] = time.time() - t0
        self._start_snapshots(plan, state, fresh=point.step < 0)
        if self.generation > 0:  # before the barrier: rank 0's record, which the console
            # tells with the replaced rank's source, is written after it
            joined(self.store, plan, self.rank, source,
                   NodeShare.of(self.cfg.shm_dir, plan.nodes, self.rank))
        self.ops.barrier("generation barrier")
        self._ran_plan = plan
        self._record(plan, state, point, source, pending, t0)
        phases["barrier"] = time.time() - t0
        self.events.emit("joined", gen=self.generation, rank=self.rank,
                         world_size=self.world_size, step=state.step, source=source,
                         pid=os.getpid(), backend=self.ops.pg.name(), groups_early=early,
                         rebuilt=self._rebuilt, groups=self._groups,
                         phases={k: round(v, 4) for k, v in phases.items()})
        return pending

    def _speculate(self, plan: Plan, state: RankState) -> Step | None:
        """A spare replacing a dead rank, before it joins: if this node holds verified
        snapshots of one step t of every rank (one node, or replicas here), load rank r's
        state at t from them and return step t+1 with rank r's microbatches, so the spare
        computes them while the survivors are still finishing theirs (they only see the
        failure at the step's all-reduce) and the group is built after, not before, the
        work. `join` then keeps them if the members agree on restoring t and on in-step
        recovery; otherwise they are dropped and recomputed as usual (`recovery.restore`).
        Returns None when there is nothing to compute ahead from."""
        g, r = plan.generation, plan.rank_of(self.wid)
        if (not self.cfg.snapshots.enabled or not state.layout.math.local_gradients
                or g == 0 or plan.kind is not PlanKind.RUN
                or r not in plan.replaced
                or not self._has_plan(g - 1)):
            return None
        if self._whole_plan(g - 1).world_size != plan.world_size:
            return None
        world = plan.world_size
        got = local_step_of_every_rank(self.planner, self.cfg.shm_dir, r, world,
                                       state.layout.state.numel)
        if got is None:
            return None
        t, copies = got
        self._enter_generation(plan)
        self._device = state.layout.math.device
        try:
            self._start_builds(plan)  # the group forms while this spare computes
        except GenerationChanged:
            pass  # a newer plan is out: the join finds that out
        self._prepare(state, first=True)
        state.zero_grad()
        state.layout.state.load_params([c.tensors for c in copies])
        mine = copies[r]
        state.layout.state.load_unique(mine.tensors, mine.header.opt)
        state.load_rank_local(mine)
        state.step, state.snap_from = t, SnapSource(mine.header.generation, world)
        m = state.m_for(world)
        st = self.make_step(t + 1, quota.plan(m, world)[r], m)
        st.speculative = Ahead(t, mine.header.generation)
        self.events.emit("computing_ahead", gen=g, rank=r, step=t + 1, restore_step=t,
                         ids=st.ids)
        return st

    def _enter_generation(self, plan: Plan) -> None:
        g = plan.generation
        self.plan, self.generation = plan, g
        self.interrupt.enter(g)
        self.unit_interrupt.enter(g)
        if self.led:
            watcher = threading.Thread(target=self._watch, args=(g + 1,), daemon=True,
                                       name=f"phoenixft-watch-{g + 1}")
            watcher.start()
            self._watchers = [w for w in self._watchers if w.is_alive()] + [watcher]
        self.rank, self.world_size = plan.rank_of(self.wid), plan.world_size
        # torchrun's names, for code that reads them; they change with the generation
        local = sum(1 for n in plan.nodes.values() if n == self.cfg.node)
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size),
                          ROLE_RANK=str(self.rank), ROLE_WORLD_SIZE=str(self.world_size),
                          LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(self.cfg.node),
                          NODE_RANK=str(self.cfg.node), TORCHELASTIC_RESTART_COUNT=str(g))

    def _build_groups(self, plan: Plan, t0: float) -> dict[str, float]:
        """This generation's groups: the mesh groups the members agree to keep
        (`kept_groups.py`), the others from the builds `_start_builds` began (early, or
        now, or late: a group the members did not keep)."""
        self._start_builds(plan)
        g, wait_s = plan.generation, self.cfg.timeouts.join_timeout_s
        timeout_s = self.cfg.timeouts.collective_timeout_s
        mesh = self._layout.members.mesh_groups(self.rank, self.world_size)
        kept, dead, shrunk = ({}, [], set()) if not self.cfg.groups.keep else self.kept.decide(
            plan, self.rank, self.builds.names(g), self.store, self.connect, self.interrupt,
            wait_s)
        drop(dead)

        def interrupt_of(name: str) -> Interrupt:
            return self.unit_interrupt if self._layout.work.in_unit(name) else self.interrupt
        # the kept ones are this generation's from here on: a failure before the join
        # ends parks them again (`_leave_groups`), as it does the ones built below
        self._mesh_ops = {name: GroupOps(old.pg, interrupt_of(name), timeout_s, ledger=old.ledger)
                          for name, old in kept.items()}
        for name, (place, n) in mesh.items():
            if name not in kept:
                self.builds.late(g, name, place, n, self._device)
        self.ops = GroupOps(self.builds.take(g, "train", wait_s), self.interrupt, timeout_s)
        phases = {"group": time.time() - t0}
        self._rep_pg = (self.builds.take(g, "replicate", wait_s)
                        if "replicate" in self.builds.names(g) else None)
        for name in mesh:
            if name not in kept:
                self._mesh_ops[name] = GroupOps(self.builds.take(g, name, wait_s),
                                                interrupt_of(name), timeout_s)
        self._mesh_ops = {name: self._mesh_ops[name] for name in mesh}  # (in mesh order)
        self.kept.joined(plan, self._mesh_ops)
        took = self.builds.took_s
        self._groups = {"train": {"size": self.world_size, "kept": False,
                                  "build_s": round(took["train"], 4)}}
        for name, (_, n) in mesh.items():
            self._groups[name] = {"size": n, "kept": name in kept and name not in shrunk,
                                  "pg": f"{id(self._mesh_ops[name].pg):x}",
                                  **({"shrunk": True} if name in shrunk else {}),
                                  **({} if name in kept else {"build_s": round(took[name], 4)})}
        return phases

    def _start_builds(self, plan: Plan) -> dict[str, Pending]:
        """Start building `plan`'s groups in the background, once (`group_builds.py`),
        except the mesh groups this worker may keep (`kept_groups.py`)."""
        rank = plan.rank_of(self.wid)
        mesh = self._layout.members.mesh_groups(rank, plan.world_size) if self._layout else {}
        if mesh and self.cfg.groups.keep:
            maybe = self.kept.candidates(plan, mesh)
            mesh = {n: v for n, v in mesh.items() if n not in maybe}
        return self.builds.start(
            plan, rank, self._device, current=self.generation,
            replicate=bool(crossing_replicas(plan.nodes, self._replica_holders(plan))),
            mesh=mesh)

    def _prepare(self, state: RankState, first: bool) -> None:
        lay = state.layout
        if first and not self._hooked:  # the snapshot's copy before every optimizer step
            lay.math.on_optimizer_step(lambda: self.snap.wait_copied(committed=True))
            self._hooked = True
        # whether the optimizer (and, for a sharded model, its sharding) was built anew:
        # a survivor of a same-size generation keeps its objects
        self._rebuilt = lay.members.join(self.rank, self.world_size)
        # A fresh gradient buffer per generation: an abandoned all-reduce of the old
        # generation may still complete into the old one.
        max_m = max(state.m, state.m_for(self.world_size))
        state.grad = torch.zeros(ReduceLayout.capacity(lay.math.grad_numel(), max_m, self.world_size,
                                                       carried_slots(self.cfg.fingerprints, lay)),
                                 dtype=lay.math.master_dtype, device=lay.math.device)

    def _restore(self, ctx: JoinContext, state: RankState, point: RestorePoint,
                 in_flight: Step | None, first: bool) -> tuple[str, Step | None]:
        if point.step >= 0:
            return recovery.restore(ctx, state, point, in_flight, new_member=first)
        state.zero_grad()
        url = self.cfg.persistence.init_from
        if url:  # a new job started from a DCP checkpoint: every rank reads its own shards
            state.step = state.layout.state.load_dcp(url)
            if self.rank == 0:  # (the summary's losses start after it, as a resumed job's)
                self.store.set(Keys.RESUMED_FROM, str(state.step))
                self.events.emit("initialized_from", url=url, step=state.step)
            return "init_from", None
        # fresh start: everyone takes rank 0's initial parameters
        state.layout.state.start_from_rank0(self.ops)
        state.step = 0
        return "init", None

    def flush_persisted(self, step: int, timeout_s: float = 30.0) -> None:
        """Training ended: wait (bounded) until its last step is durable, and say so if
        storage could not keep up."""
        if self.persister is not None and not self.persister.flush(step, timeout_s):
            self.events.emit("persist_incomplete", rank=self.rank, step=step,
                             durable=self.persister.stats.last_step,
                             errors=self.persister.stats.errors)

    def _start_snapshots(self, plan: Plan, state: RankState, fresh: bool) -> None:
        """This generation's protection (`protection.py`): persister, snapshot thread."""
        self.persister = protection.start_persister(
            self.tier, self.cfg, state, plan=plan, rank=self.rank,
            job_id=self._job_id() or "standalone", connect=self.connect, events=self.events)
        self.snap = protection.start_snapshotter(
            self.cfg, plan=plan, rank=self.rank, rep_pg=self._rep_pg, connect=self.connect,
            interrupt=self.interrupt, injector=self.injector, events=self.events,
            on_damaged_source=lambda src, detail: self._report_damaged(plan, src, detail),
            persister=self.persister, on_copied=self.seal.record)
        self.seal.reset()  # (a restore may have replaced the state the last seal hashed)
        if fresh:  # (at step 0, or at an --init-from checkpoint's step)
            self.snap.origin = state.step
            self.snapshot(state)

    def _record(self, plan: Plan, state: RankState, point: RestorePoint, source: str,
                pending: Step | None, t0: float) -> None:
        g = self.generation
        if g == 0:
            if point.step >= 0 and self.rank == 0:  # a resumed job
                self.store.set(Keys.RESUMED_FROM, str(point.step))
                self.events.emit("resumed", step=point.step, source=source,
                                 world_size=self.world_size, from_world_size=point.world_size)
            return
        now = time.time()
        if self.rank != 0:
            return
        rec = dict(gen=g, step=state.step, restore_step=point.step, replaced=plan.replaced,
                   join_s=round(now - t0, 4),
                   lost_steps=max(0, plan.progress - max(point.step, 0)),
                   in_step=pending is not None, world_size=self.world_size,
                   detect_s=_delta(plan.t_fail, plan.t_detect), recover_s=_delta(plan.t_detect, now))
        kv.set_json(self.store, Keys.recovered(g), rec)
        self.events.emit("recovered", **rec)

    # -- leaving a generation ----------------------------------------------------------
    def recover(self, exc: CommFailure, state: RankState, in_flight: Step | None) -> Step | None:
        """The generation failed (or the leader moved on): drop it and join the next."""
        self.tell_passes()
        if not isinstance(exc, GenerationChanged):
            self.report(ReportKind.COLLECTIVE, str(exc))
        if self.snap is not None:
            self.snap.stop()
        if self.persister is not None:
            self.persister.stop()
        groups = self._leave_groups()
        self.events.emit("failure_seen", gen=self.generation, rank=self.rank, step=state.step,
                         error=str(exc)[:300], groups=groups)
        # ...and never let the old groups' late-finishing ops write into live buffers.
        state.layout.members.relocate()
        return self.enter(self.await_plan(self.generation + 1, self.cfg.timeouts.join_timeout_s),
                          state, in_flight)

    def _leave_groups(self) -> dict[str, str]:
        """Leave the generation's groups: the mesh groups are parked for the next join
        to keep if it can (`kept_groups.py`), unless an operation failed in one as it was
        issued; the rest are aborted, then dropped (`GroupBuilds.bury`). Returns each
        mesh group's state ("clean", or what it left unfinished)."""
        dead = [pg for pg in (self.ops.pg if self.ops is not None else None, self._rep_pg)
                if pg is not None]
        if self._mesh_ops and self.cfg.groups.keep:
            spoiled, states = self.kept.park(self._mesh_ops, self.plan)
            dead += spoiled
        else:
            states = {n: ops.ledger.why_not() or "clean" for n, ops in self._mesh_ops.items()}
            dead += [ops.pg for ops in self._mesh_ops.values()]
        self.ops = self._rep_pg = None
        self._mesh_ops = {}
        self.builds.bury(self.generation, dead)
        return states

    def hand_over_for_growth(self, state: RankState) -> Step | None:
        """The leader asked to admit new members: finish here, at a committed step
        boundary, and join the grown generation (nothing is recomputed)."""
        if self.cfg.snapshots.enabled:
            self.snap.wait_committed(state.step, self.store)
        if self.rank == 0:
            self.store.set(Keys.grow_ready(self.generation), str(state.step))
        return self.recover(GenerationChanged("admitting new members"), state, None)

    # -- per step ----------------------------------------------------------------------
    def snapshot(self, state: RankState) -> None:
        """Start snapshot `state.step` in the background (returns at once)."""
        if not self.cfg.snapshots.enabled:
            return
        k = self.cfg.snapshots.blocks
        if k and (state.step // k) % 2 == 1:  # the overhead benchmark's off blocks
            return
        snap = state.snapshot(rank=self.rank, world_size=self.world_size)
        if state.step == 1 and self.rank == 0:
            nbytes = sum(t.numel() * t.element_size() for t in snap.tensors.values())
            copies = 1 + len(self._replica_holders(self.plan)[self.rank])
            self.events.emit("snapshot_size", bytes_per_slot=nbytes, slots=2, copies=copies,
                             host_bytes_per_rank=2 * copies * nbytes)
        state.snap_from = SnapSource(self.generation, self.world_size)  # who wrote it
        self.seal.arm(state.layout.state.unique_tensors()
                      if sealed(self.cfg.fingerprints, state.step) else ())
        self.snap.begin(state.step, snap)

    # -- plumbing ----------------------------------------------------------------------
    def replica_receivers(self) -> set[int]:
        """The ranks of this generation that hold a replica (from another node, or a
        same-node peer's with `--replicas 1`)."""
        if not self.cfg.snapshots.enabled:
            return set()
        return {h for hs in self._replica_holders(self.plan).values() for h in hs}

    def _replica_holders(self, plan: Plan) -> dict[int, list[int]]:
        return protection.holders(plan, self.cfg.snapshots.replicas)

    def report(self, kind: ReportKind, detail: str, wid: str | None = None) -> None:
        """A failure report for the leader about this worker, or about `wid` (best effort:
        the store may be gone)."""
        try:
            file_report(self.store, {"kind": kind, "wid": wid or self.wid,
                                     "gen": self.generation, "detail": detail[:500]})
        except Exception:
            pass

    def _report_damaged(self, plan: Plan, src: int, detail: str) -> None:
        """(Snapshot thread) a same-node peer's own snapshot is damaged in shared memory:
        the leader replaces that worker like a dead one (it fences it), so the job restores
        the newest committed step instead of waiting out the commit's deadline."""
        self.report(ReportKind.DAMAGED, f"rank {self.rank} found {detail}", wid=plan.members[src])

    def _previous_step_committed(self) -> None:
        """Before a microbatch fault of step T: snapshot T-1 committed, so every rank has
        finished step T-1 (a kill while a survivor was still inside T-1's all-gather made
        that survivor redo the whole step: 8 microbatch passes more than the test counted)."""
        if self.snap is not None:
            self.snap.wait_copied(committed=True)

    def count_pass(self) -> None:
        """One microbatch pass done (added to the store by `tell_passes`)."""
        self.passes += 1

    def tell_passes(self) -> None:
        """Add this worker's microbatch passes since the last call to the job's counter
        (`Keys.MB_COUNT`): once per step, at its all-reduce, not once per microbatch (a
        store round trip each); also when a generation is left and before an injected
        fault lands. A worker that dies otherwise takes its passes of that step along."""
        if self.passes:
            n, self.passes = self.passes, 0
            try:
                self.store.add(Keys.MB_COUNT, n)
            except Exception:  # the store is gone: the count is lost, training is not
                pass

    def shutdown(self, join_timeout_s: float = 2.0) -> None:
        """Stop this member's threads (waiting for the plan watchers `join_timeout_s` in all)."""
        self._stopped = True
        if self.persister is not None:
            self.persister.stop(join_timeout_s=join_timeout_s)
        if self.snap is not None:
            self.snap.stop(join_timeout_s=join_timeout_s)
        deadline = time.monotonic() + join_timeout_s  # (all of them together)
        for w in self._watchers:
            w.join(max(0.0, deadline - time.monotonic()))


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 4)

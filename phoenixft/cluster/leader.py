"""The leader: decides generations. It runs in an agent (node 0's unless another agent took
the lead, see `lease.py`), so it outlives any worker, rank 0 included.

Failure policy (readable here; the decisions themselves are pure functions in
`policy.py`, unit-tested from tables):
- a worker that exits before it finished training (any exit code, 0 included: a rank
  that leaves early is a failure of *that* rank), or whose heartbeat has been silent for
  `heartbeat_timeout_s` (a hang: its agent reports it; every live worker of a node whose
  agent's own beat went silent, its host lost, counts as hung too), is dead; so is one
  whose own snapshot a same-node replica holder found damaged in shared memory (its step
  can never commit); a hung or
  damaged one is fenced (its agent SIGKILLs it) before anyone relies on its absence;
- a dead member's rank goes to a live spare, preferring one on the dead rank's node (it
  maps the dead rank's snapshot from shared memory), else any node (the replica holder
  sends it); the next generation's plan is written and the survivors carry on;
- a failure while a generation is forming simply produces the next generation;
- no spare left: with `min_world` (`--min-nproc`) the survivors go on without the dead
  ranks, renumbered, keeping every step's microbatches (ReCoVer); below it, or without
  it, the job is stopped with a clear reason;
- a respawned worker (a spare registered while the job runs below its starting size) is
  admitted at the next committed step boundary (grow);
- a Python exception in the user's script is not a machine failure: the job stops and the
  traceback is shown, since a spare would only raise it again;
- a worker that exits before the job starts (it never created a Session, or crashed on
  import) stops the job at once, naming it;
- after training finished, a non-zero exit or a fault injection that never fired makes
  the job's exit status non-zero (`problems` in summary.json): nothing silent.

The leader's own state is saved in the store after every change (`Keys.LEADER_STATE`),
so another agent can take over the lead from where it stood.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from phoenixft.cluster import policy, report
from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import HeartbeatMonitor, node_counters
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.membership import Plan, PlanKind
from phoenixft.config import Timeouts
from phoenixft.observe.events import EventLog, write_json_atomic


class WorkerState(str, enum.Enum):
    """A worker as the leader sees it."""

    STARTING = "starting"  # started, not registered yet
    WAITING = "waiting"  # a registered spare
    RUNNING = "running"  # a member of the current generation
    DEAD = "dead"  # exited before training finished
    FENCED = "fenced"  # hung or damaged: its agent SIGKILLs it
    EXITED = "exited"  # finished training and left
    LEAVING = "leaving"  # its replica group left the job: it exits on its own (no spare)
    STOPPED = "stopped"  # still alive when the job ended: its agent stopped it

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


ALIVE = (WorkerState.WAITING, WorkerState.RUNNING)
GONE = (WorkerState.DEAD, WorkerState.EXITED, WorkerState.FENCED)
# a node with this many quarantined workers is quarantined whole (`Leader._quarantine`)
QUARANTINE_NODE_AFTER = 2
QUARANTINED_NODE = "quarantined_node"  # the failure kind of its members, fenced with it


@dataclass
class WorkerInfo:
    wid: str
    node: int
    pid: int = 0
    state: WorkerState = WorkerState.STARTING
    exit_detail: str = ""


@dataclass(kw_only=True)
class LeaderConfig:
    nnodes: int = 1
    timeouts: Timeouts = field(default_factory=Timeouts)  # heartbeat and start-up deadlines
    min_world: int | None = None  # shrink down to this many ranks when no spare is left
    injects: list[str] = field(default_factory=list)  # fault specs that must fire
    swap_stragglers: bool = False  # --straggler swap: rank 0 may ask for a straggler's swap

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")


@dataclass
class Failure:
    wid: str
    rank: int | None
    kind: str  # a ReportKind's value, or "hang"
    detail: str
    t_fail: float
    t_detect: float

    @property
    def detect_s(self) -> float:
        """t_detect - t_fail, never below 0: the two are read from different processes'
        wall clocks (an exit seen within a millisecond printed "detected in -0 ms")."""
        return round(max(0.0, self.t_detect - self.t_fail), 4)


def _what_to_change(rep: dict) -> str | None:
    """A worker's error that is the user's to change (a flag, a setup argument: the
    worker says it in one line, `launch/worker.py`), as the job's one line; None for a
    script's own error, which keeps its traceback."""
    detail = str(rep.get("detail", "")).strip()
    if rep.get("kind") == ReportKind.ERROR and detail.startswith("phoenixft: ") \
            and "\n" not in detail:
        return detail.removeprefix("phoenixft: ")
    return None


class Leader:
    """The job's decider, run by the agent that holds the lead: reads failure reports and
    heartbeats, decides each next generation (`policy.py`) and publishes its plan, writes
    status.json and, at the end, summary.json. Its state is saved in the store after
    every change, so another agent can take the lead over (`resume`). The failure policy
    is in the module docstring."""

    def __init__(self, store: dist.Store, events: EventLog, run_dir: Path,
                 cfg: LeaderConfig) -> None:
        self.store = store
        self.events = events
        self.run_dir = run_dir
        self.cfg = cfg
        self.workers: dict[str, WorkerInfo] = {}
        self.plan: Plan | None = None
        # the agents' node beats (a worker's hang is its agent's report)
        self.monitor = HeartbeatMonitor(node_counters(store),
                                        every_s=cfg.timeouts.heartbeat_interval_s)
        self.failures: list[Failure] = []
        # workers swapped out as stragglers or for silent data corruption: never back
        self.quarantined: list[str] = []
        # nodes QUARANTINE_NODE_AFTER of whose workers were quarantined: their workers
        # fenced and replaced, their spares never used (`_quarantine`)
        self.quarantined_nodes: list[int] = []
        self.rollbacks: list[dict] = []  # generations that rolled back (`_roll_back`)
        self._pending: list[Failure] = []  # a quarantined node's members, fenced by a swap
        self._swaps_done: set[int] = set()  # generations whose straggler was decided
        self._held_gens: set[int] = set()  # generations asked to stop at a committed step
        self.problems: list[str] = []
        self.fatal: str | None = None
        self.target_world = 0
        self._nodes: list[dict] = []  # the agents that joined, in node order (start-up)
        self._reports_seen = 0
        # a worker finished training since the last look: whether all have is asked only
        # then (a scan of every member, each 20 ms tick, was the leader's largest steady
        # cost at 16,384 members)
        self._exited_seen = True
        self._started = time.monotonic()
        self._status_t = 0.0
        self.status_failing: OSError | None = None  # why status.json could not be written

    @property
    def plan_kind(self) -> str:
        return self.plan.kind if self.plan is not None else WorkerState.STARTING.value

    # -- start ----------------------------------------------------------------------
    def try_start(self) -> bool:
        """Gen 0 once every node's agent and every worker registered. False = not yet."""
        for rep in self._new_reports():  # nobody may leave (or hang) before the job starts
            if rep["kind"] == ReportKind.HANG:
                self._abort(f"worker {rep['wid']} hung during start-up: its heartbeat stood "
                            f"still for {self.cfg.timeouts.heartbeat_timeout_s:g} s; see "
                            f"{self.run_dir / 'logs' / (rep['wid'] + '.log')}")
                return False
            change = _what_to_change(rep)
            why = rep["detail"] if rep["kind"] == ReportKind.ERROR else (
                f"{rep['detail']} before it created phoenixft.Session() and joined the job; "
                f"see {self.run_dir / 'logs' / (rep['wid'] + '.log')}")
            self._abort(change or f"worker {rep['wid']} exited during start-up: {why}",
                        error=rep["kind"] == ReportKind.ERROR)
            return False
        # a few requests a tick however many nodes and workers there are: the nodes that
        # joined are remembered, and the workers are counted before any is looked up
        while len(self._nodes) < self.cfg.nnodes:
            k = len(self._nodes)
            if not self.store.check([Keys.node(k)]):
                self._startup_deadline(f"agent of node {k} has not joined")
                return False
            self._nodes.append(kv.get_json(self.store, Keys.node(k)))
        nodes = self._nodes
        wids = [(k, f"n{k}w{i}") for k, n in enumerate(nodes) for i in range(n["nproc"] + n["spares"])]
        if kv.get_int(self.store, Keys.REGISTERED, 0) < len(wids):
            if self._startup_overdue():  # (only then the workers missing are named)
                missing = [w for _, w in wids if not self.store.check([Keys.worker(w)])]
                self._startup_deadline(f"workers {', '.join(missing)} have not registered "
                                       "(slow imports, or the script fails before "
                                       "phoenixft.Session())")
            return False
        ranks: dict[int, str] = {}
        for k, n in enumerate(nodes):
            for i in range(n["nproc"]):
                ranks[len(ranks)] = f"n{k}w{i}"
        infos = self.store.multi_get([Keys.worker(w) for _, w in wids])
        for (k, w), info in zip(wids, infos):
            self.workers[w] = WorkerInfo(w, k, json.loads(info)["pid"], WorkerState.WAITING)
        for k in range(self.cfg.nnodes):
            self.monitor.watch(str(k))
        self.target_world = len(ranks)
        self._publish(Plan(generation=0, members=ranks,
                           nodes={r: self.workers[w].node for r, w in ranks.items()}))
        return True

    def _startup_overdue(self) -> bool:
        return time.monotonic() - self._started > self.cfg.timeouts.startup_timeout_s

    def _startup_deadline(self, why: str) -> None:
        if self._startup_overdue():
            self._abort(f"start-up did not complete within {self.cfg.timeouts.startup_timeout_s:.0f}s: {why}")

    # -- every tick -----------------------------------------------------------------
    def tick(self) -> None:
        if self.plan_kind != "run":
            return
        new, self._pending = self._pending + self._read_exits(), []
        if self.plan_kind != "run":  # a script error stopped the job
            return
        new += self._read_hangs()
        if self._exited_seen and self._all_members_finished():
            self._finish()
            return
        for f in new:
            self.failures.append(f)
            self.events.emit("failure", wid=f.wid, rank=f.rank, kind=f.kind, detail=f.detail,
                             gen=self.plan.generation, detect_s=f.detect_s,
                             role="active" if f.rank is not None else "spare")
        member_failures = [f for f in new if f.rank is not None]
        if member_failures:
            self._replace(member_failures)
        elif not self._swap_straggler():
            self._grow()
        if new:
            self.save_state()
        self._write_status()

    def _read_exits(self) -> list[Failure]:
        now, new = time.time(), []
        for rep in self._new_reports():
            w = self.workers.get(rep["wid"])
            if w is None or w.state in GONE:
                continue
            if self.store.check([Keys.finished(w.wid)]):  # it completed training
                w.state = WorkerState.EXITED
                self._exited_seen = True
                if rep.get("rc", 0) != 0:
                    self.problems.append(f"worker {w.wid} exited after training with "
                                         f"{rep['detail'].splitlines()[-1]}")
                continue
            if rep["kind"] == ReportKind.ROLLBACK:
                self._roll_back(rep)
                continue
            if self.store.check([Keys.left(w.wid)]) and rep.get("rc") == 0:
                w.state = WorkerState.EXITED  # its replica group left (`Member._leave_unit`)
                self._exited_seen = True
                self.events.emit("worker_left", wid=w.wid, note="its replica group left the job")
                continue
            if rep["kind"] == ReportKind.ERROR:
                self._abort(_what_to_change(rep) or f"the training script raised on worker "
                            f"{rep['wid']}:\n{rep['detail']}", error=True)
                return []
            if rep["kind"] == ReportKind.FATAL:
                self._abort(f"recovery is impossible: {rep['detail']}")
                return []
            if rep["kind"] == ReportKind.HANG:  # its agent saw its heartbeat stand still
                new.append(self._fence(w, "hang", rep["detail"],
                                       self._fail_time(w.wid, rep["t"]), now))
                continue
            if rep["kind"] == ReportKind.DAMAGED:  # its snapshot in shm: replaced, fenced
                new.append(self._fence(w, ReportKind.DAMAGED.value, rep["detail"], rep["t"], now))
                continue
            if rep["kind"] == ReportKind.CORRUPT:  # outvoted: replaced, fenced, never back
                new.append(self._fence(w, ReportKind.CORRUPT.value, rep["detail"], rep["t"], now))
                new += self._quarantine(w)
                continue
            detail = rep["detail"] + (" before training finished" if rep.get("rc") == 0 else "")
            w.state, w.exit_detail = WorkerState.DEAD, detail
            new.append(Failure(w.wid, self.plan.rank_of(w.wid), ReportKind.EXIT.value, detail,
                               self._fail_time(w.wid, rep["t"]), now))
        return new

    def _read_hangs(self) -> list[Failure]:
        """A node whose agent went silent (its host died or its agent hung): each of its
        live workers counts as hung and is fenced. (A hung worker on a live node is its
        agent's report, `ReportKind.HANG`.)"""
        now, new = time.time(), []
        self.monitor.poll()
        for k in self.monitor.stale(self.cfg.timeouts.heartbeat_timeout_s):
            t_fail = self.monitor.last_beat_wall(k)
            self.monitor.forget(k)  # (watched again if it sends a worker back: `adopt`)
            lost = [w for w in self.workers.values()
                    if w.node == int(k) and w.state in (*ALIVE, WorkerState.STARTING)]
            if lost:  # (an agent whose workers all left stops beating when it leaves)
                self.events.emit("node_silent", node=int(k), silent_s=round(now - t_fail, 3))
            for w in lost:
                if self.store.check([Keys.finished(w.wid)]):
                    # it completed training; its agent went silent before reporting the
                    # exit. Fenced (in case it lingers), but no failure: a new generation
                    # after the last step waited for a rank that had left, and the job
                    # never ended
                    self._stop_worker(w, "finished training; its node's agent went silent")
                    w.state = WorkerState.EXITED
                    self._exited_seen = True
                    continue
                new.append(self._fence(w, "hang", f"heartbeat silent: node {k}'s agent is "
                                       "silent (its host lost, or the agent hung)",
                                       self._fail_time(w.wid, t_fail), now))
        return new

    def _fence(self, w: WorkerInfo, kind: str, detail: str, t_fail: float, now: float
               ) -> Failure:
        """A worker that may still run but must not (hung, or its snapshot damaged): its
        agent SIGKILLs it before anyone relies on its absence."""
        self._stop_worker(w, detail)
        return Failure(w.wid, self.plan.rank_of(w.wid), kind, detail, t_fail, now)

    def _stop_worker(self, w: WorkerInfo, detail: str) -> None:
        """Fence `w`: its agent SIGKILLs it; the leader stops watching it."""
        w.state, w.exit_detail = WorkerState.FENCED, detail
        self.store.set(Keys.fence(w.wid), "1")
        self.store.add(Keys.fences(w.node), 1)  # (what the node's agent watches)

    def _held(self, g: int) -> bool:
        """Ask the members of generation g to stop at their next committed step (the
        step's all-reduce carries the request); True once they have."""
        self._held_gens.add(g)
        if not self.store.check([Keys.grow(g)]):
            self.store.set(Keys.grow(g), "1")
            return False
        return self.store.check([Keys.grow_ready(g)])

    def _fail_time(self, wid: str, fallback: float) -> float:
        key = Keys.failing(wid)
        return float(self.store.get(key).decode()) if self.store.check([key]) else fallback

    def _new_reports(self) -> list[dict]:
        """Exit reports in order. A report's number is taken (add) before its body is
        written: stop at the first body not written yet and read it next tick."""
        n = self.store.add(Keys.REPORTS, 0)  # (one request a tick)
        out = []
        while self._reports_seen < n:
            key = Keys.report(self._reports_seen + 1)
            if not self.store.check([key]):
                break
            self._reports_seen += 1
            rep = kv.get_json(self.store, key)
            if rep.get("kind") in (ReportKind.EXIT, ReportKind.ERROR, ReportKind.FATAL,
                                   ReportKind.DAMAGED, ReportKind.CORRUPT, ReportKind.HANG,
                                   ReportKind.ROLLBACK):
                out.append(rep)
        return out

    def _all_members_finished(self) -> bool:
        self._exited_seen = False  # (asked again once another worker has finished)
        return all(self.workers[w].state is WorkerState.EXITED for w in self.plan.members.values())

    def _finish(self) -> None:
        if not self.store.check([Keys.result("digest")]):
            self._abort("every rank exited before training finished; see the worker logs "
                        f"in {self.run_dir / 'logs'}")
            return
        for spec in self.cfg.injects:
            if not self.store.check([Keys.inject(spec)]):
                self.problems.append(
                    f"--inject {spec} never fired (the run ended at step "
                    f"{kv.get_int(self.store, Keys.PROGRESS, 0)}): fix the step, rank, "
                    "generation or microbatch")
        for p in self.problems:
            self.events.emit("problem", detail=p)
        self._publish(Plan(generation=self.plan.generation + 1, kind=PlanKind.DONE,
                           reason="all ranks finished"))

    # -- decisions ------------------------------------------------------------------
    def _spares(self) -> list[WorkerInfo]:
        members = set(self.plan.members.values())
        return [w for w in self.workers.values()
                if w.wid not in members and w.state in ALIVE
                and w.node not in self.quarantined_nodes]

    def _would_quarantine_node(self, w: WorkerInfo) -> bool:
        """Whether naming `w` too quarantines its node (`_quarantine`)."""
        named = sum(1 for x in self.quarantined if self.workers[x].node == w.node)
        return named + 1 >= QUARANTINE_NODE_AFTER and w.node not in self.quarantined_nodes

    def _quarantine(self, w: WorkerInfo) -> list[Failure]:
        """`w` was named (silent data corruption, or a straggler swapped out): it is never
        re-admitted. Once QUARANTINE_NODE_AFTER workers of its node were, the node is
        suspect (its memory, its GPUs' host, its power): every other live worker of it is
        fenced, its members returned as failures to be replaced like dead ones, and its
        spares are never used again."""
        self.quarantined.append(w.wid)
        named = [x for x in self.quarantined if self.workers[x].node == w.node]
        if len(named) < QUARANTINE_NODE_AFTER or w.node in self.quarantined_nodes:
            return []
        self.quarantined_nodes.append(w.node)
        members = set(self.plan.members.values())
        now, out, fenced = time.time(), [], []
        why = (f"node {w.node} quarantined: {len(named)} of its workers were named "
               f"({', '.join(named)})")
        for x in self.workers.values():
            if x.node != w.node or x.state not in ALIVE:
                continue
            fenced.append(x.wid)
            if x.wid in members:
                out.append(self._fence(x, QUARANTINED_NODE, why, now, now))
            else:
                self._stop_worker(x, why)  # a spare there: never used
        self.events.emit("node_quarantined", node=w.node, named=named, fenced=fenced,
                         gen=self.plan.generation)
        return out

    def _replace(self, failures: list[Failure]) -> None:
        """Decide the next generation after member failures (`policy.after_failures`) and
        publish it, or stop."""
        plan = self.plan
        nxt = policy.after_failures(
            plan, [policy.Failed(f.wid, f.rank, f.detail, f.t_fail, f.t_detect) for f in failures],
            [policy.Spare(w.wid, w.node) for w in self._spares()],
            min_world=self.cfg.min_world, progress=kv.get_int(self.store, Keys.PROGRESS, 0),
            previous_recovered=plan.generation == 0 or
            self.store.check([Keys.recovered(plan.generation)]),
            unit=kv.get_int(self.store, Keys.UNIT, 1))
        if nxt.decision is policy.Decision.STOP:
            self._abort(nxt.reason)
            return
        for wid in nxt.taken:
            self.workers[wid].state = WorkerState.RUNNING
        for wid in set(plan.members.values()) - set(nxt.plan.members.values()):
            if self.workers[wid].state is WorkerState.RUNNING:  # its replica group left
                self.workers[wid].state = WorkerState.LEAVING  # (never offered as a spare)
        self._publish(nxt.plan)

    def _roll_back(self, rep: dict) -> None:
        """The fingerprint vote found copies that differ with nobody to name (two ranks, a
        tp pair), and a member took back the last commit (`fingerprints.py`): the next
        generation has the same members, who restore the step before it. Once a
        generation (a report of an older one is stale)."""
        plan = self.plan
        if rep.get("gen") != plan.generation:
            return
        self.rollbacks.append({"gen": plan.generation + 1, "detail": rep["detail"]})
        self.events.emit("rollback", gen=plan.generation + 1, wid=rep["wid"],
                         detail=rep["detail"])
        self._publish(Plan(generation=plan.generation + 1, members=dict(plan.members),
                           nodes=dict(plan.nodes),
                           progress=kv.get_int(self.store, Keys.PROGRESS, 0),
                           reason=f"rollback: {rep['detail']}"))

    def _swap_straggler(self) -> bool:
        """Rank 0 named a straggler (`--straggler swap`): hold the members at the next
        committed step, as for a grow, then give its rank to a spare (one on its node
        first) and fence it; nothing is rolled back. True while a swap is under way."""
        plan = self.plan
        g, key = plan.generation, Keys.straggler(plan.generation)
        if not self.cfg.swap_stragglers or g in self._swaps_done or not self.store.check([key]):
            return False
        try:
            said = policy.StragglerReport.from_dict(kv.get_json(self.store, key))
        except ValueError as exc:
            self._swaps_done.add(g)
            self.events.emit("straggler_kept", gen=g, reason=f"unreadable report ({exc})")
            return False
        wid, r = said.wid, said.rank
        worker = self.workers.get(wid)
        spares = self._spares()
        if worker is not None and self._would_quarantine_node(worker):
            spares = [x for x in spares if x.node != worker.node]  # (about to be fenced)
        nxt = policy.swap_straggler(plan, said, spares,
                                    progress=kv.get_int(self.store, Keys.PROGRESS, 0))
        if nxt is None or worker is None or worker.state is not WorkerState.RUNNING:
            self._swaps_done.add(g)
            return False
        if nxt.decision is policy.Decision.KEEP:
            self._swaps_done.add(g)
            self.events.emit("straggler_kept", wid=wid, rank=r, gen=g, reason=nxt.reason)
            return False
        if not self._held(g):
            return True
        self._swaps_done.add(g)
        [spare] = nxt.taken
        self.workers[spare].state = WorkerState.RUNNING
        self._stop_worker(worker, f"straggler ({said.ratio}x)")
        self.events.emit("straggler_swapped", wid=wid, rank=r, gen=g, spare=spare,
                         ratio=said.ratio, step=said.step)
        self._publish(nxt.plan)
        # never re-admitted; if its node is quarantined now, the node's members of the plan
        # just published (its spare came from another node) are replaced at the next tick
        self._pending += self._quarantine(worker)
        self.save_state()
        return True

    def _grow(self) -> None:
        """A spare is waiting while the job runs below its starting size: ask the members
        to stop at the next committed step, then admit the spare (`policy.grow`)."""
        plan = self.plan
        held = plan.generation in self._held_gens  # (a swap may have held them too)
        if not held and plan.world_size >= self.target_world:
            return  # nothing to admit, nobody held: no store round trip per tick
        unit = kv.get_int(self.store, Keys.UNIT, 1)
        if not held and (plan.world_size + unit > self.target_world
                         or len(self._spares()) < unit):
            return  # (a replica group comes back whole)
        if not self._held(plan.generation):
            return
        # the members stopped at a committed step for this: a plan must follow, even if
        # the spares went away meanwhile (then the same members go on)
        progress = kv.get_int(self.store, Keys.PROGRESS, 0)
        nxt = policy.grow(plan, [policy.Spare(w.wid, w.node) for w in self._spares()],
                          target_world=self.target_world, progress=progress, unit=unit)
        if nxt is None:
            self._publish(Plan(generation=plan.generation + 1, members=dict(plan.members),
                               nodes=dict(plan.nodes), progress=progress,
                               reason="grow: the spares left before they were admitted"))
            return
        for wid in nxt.taken:
            self.workers[wid].state = WorkerState.RUNNING
        self._publish(nxt.plan)

    def adopt(self, wid: str, node: int) -> bool:
        """A worker started after the job began (a respawned replacement): a spare once it
        has registered."""
        if wid in self.workers or not self.store.check([Keys.worker(wid)]):
            return wid in self.workers
        info = kv.get_json(self.store, Keys.worker(wid))
        self.workers[wid] = WorkerInfo(wid, node, info["pid"], WorkerState.WAITING)
        self.monitor.watch(str(node))  # (again, if the node had gone silent before)
        self.events.emit("spare_added", wid=wid, node=node, pid=info["pid"])
        self.save_state()
        return True

    def stop(self, reason: str) -> None:
        """Stop the job now (an operator's signal): every worker reads the abort plan."""
        self._abort(reason)

    def _abort(self, reason: str, error: bool = False) -> None:
        self.fatal = reason
        g = self.plan.generation + 1 if self.plan else 0
        self.events.emit("abort", reason=reason, error=error)
        self._publish(Plan(generation=g, kind=PlanKind.ABORT, reason=reason))

    def _publish(self, plan: Plan) -> None:
        keys, values = [Keys.plan(plan.generation)], [plan.to_json()]
        if self.plan is not None and plan.generation == self.plan.generation + 1:
            # one request: a reader that sees the plan finds its change (`protocol.read_plan`)
            keys.insert(0, Keys.plan_change(plan.generation))
            values.insert(0, plan.change_from(self.plan))
        self.store.multi_set(keys, values)
        if plan.kind is PlanKind.RUN:
            for w in plan.members.values():
                if self.workers[w].state not in GONE:  # (fenced meanwhile: stays so)
                    self.workers[w].state = WorkerState.RUNNING
        if plan.kind is not PlanKind.RUN and self.plan is not None:  # keep the last membership
            plan.members, plan.nodes = self.plan.members, self.plan.nodes
        self.plan = plan
        self.events.emit("generation", gen=plan.generation, kind=plan.kind,
                         members=dict(plan.members), replaced=plan.replaced,
                         world_size=plan.world_size)
        self.save_state()
        self._write_status(force=True)

    # -- state for a successor ------------------------------------------------------
    def save_state(self) -> None:
        kv.set_json(self.store, Keys.LEADER_STATE, {
            # (vars, not asdict: asdict deep-copies each of 16k workers, each change)
            "workers": [vars(w) for w in self.workers.values()],
            "failures": [asdict(f) for f in self.failures], "problems": self.problems,
            "reports_seen": self._reports_seen, "target_world": self.target_world,
            "fatal": self.fatal, "quarantined": self.quarantined,
            "quarantined_nodes": self.quarantined_nodes, "rollbacks": self.rollbacks,
            "pending": [asdict(f) for f in self._pending]})

    def resume(self) -> bool:
        """Take over from a previous leader's saved state (False: there is none, the job
        has not started yet)."""
        if not self.store.check([Keys.LEADER_STATE]):
            return False
        st = kv.get_json(self.store, Keys.LEADER_STATE)
        self.workers = {w["wid"]: WorkerInfo(**{**w, "state": WorkerState(w["state"])})
                        for w in st["workers"]}
        self.failures = [Failure(**f) for f in st["failures"]]
        self.problems, self.fatal = st["problems"], st["fatal"]
        self._reports_seen, self.target_world = st["reports_seen"], st["target_world"]
        self.quarantined = st.get("quarantined", [])
        self.quarantined_nodes = st.get("quarantined_nodes", [])
        self.rollbacks = st.get("rollbacks", [])
        self._pending = [Failure(**f) for f in st.get("pending", [])]
        g = 0
        while self.store.check([Keys.plan(g + 1)]):
            g += 1
        self.plan = Plan.from_json(self.store.get(Keys.plan(g))) if self.store.check(
            [Keys.plan(g)]) else None
        if self.store.check([Keys.grow(g)]):  # the last leader held the members: a plan follows
            self._held_gens.add(g)
        for k in {w.node for w in self.workers.values() if w.state in (*ALIVE, WorkerState.LEAVING)}:
            self.monitor.watch(str(k))
        return self.plan is not None

    # -- reporting ------------------------------------------------------------------
    def status(self) -> dict:
        return {**report.status(self.store, self.plan, self.workers, len(self.failures),
                                self.quarantined), "quarantined_nodes": self.quarantined_nodes}

    def final_status(self) -> dict:
        """status.json once the job has ended: every agent stops its workers at the end,
        so a worker still shown waiting or running (an unused spare, a member whose exit
        was not read before the end) is shown `stopped`, not alive with a PID now gone."""
        for w in self.workers.values():
            if w.state in (*ALIVE, WorkerState.STARTING, WorkerState.LEAVING):
                w.state = WorkerState.STOPPED
        return {**self.status(), "ended": True}

    def _write_status(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._status_t < 0.5:
            return
        self._status_t = time.monotonic()
        try:
            write_json_atomic(self.run_dir / "status.json", self.status())
            self.status_failing = None
        except OSError as exc:  # a full run-dir disk: the agent says so, training goes on
            self.status_failing = exc

    def summary(self, wall_s: float) -> dict:
        return {**report.summary(self.store, self.run_dir,
                                 self.plan.generation if self.plan else 0, self.failures,
                                 wall_s, self.fatal, self.problems),
                "quarantined": self.quarantined, "quarantined_nodes": self.quarantined_nodes,
                "rollbacks": self.rollbacks}

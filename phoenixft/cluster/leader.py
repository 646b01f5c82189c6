"""The leader: decides generations. It runs in the agent that hosts the store (node 0),
so it outlives any worker, rank 0 included.

Failure policy (readable here, in one place):
- a worker whose process exited without a clean-exit mark, or whose heartbeat has been
  silent for `heartbeat_timeout_s` (a hang), is dead; a hung one is fenced (its agent
  SIGKILLs it) before anyone relies on its absence;
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
  traceback is shown, since a spare would only raise it again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import HeartbeatMonitor
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan
from phoenixft.observe.events import EventLog, write_json_atomic


@dataclass
class WorkerInfo:
    wid: str
    node: int
    pid: int = 0
    state: str = "starting"  # starting | running | waiting | dead | exited | fenced
    exit_detail: str = ""


@dataclass(kw_only=True)
class LeaderConfig:
    nnodes: int = 1
    heartbeat_timeout_s: float = 3.0
    startup_timeout_s: float = 120.0
    min_world: int | None = None  # shrink down to this many ranks when no spare is left

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")


@dataclass
class Failure:
    wid: str
    rank: int | None
    kind: str  # "exit" | "hang" | "error"
    detail: str
    t_fail: float
    t_detect: float


class Leader:
    def __init__(self, store: dist.Store, events: EventLog, run_dir: Path,
                 cfg: LeaderConfig) -> None:
        self.store = store
        self.events = events
        self.run_dir = run_dir
        self.cfg = cfg
        self.workers: dict[str, WorkerInfo] = {}
        self.plan: Plan | None = None
        self.monitor = HeartbeatMonitor(store)
        self.failures: list[Failure] = []
        self.fatal: str | None = None
        self._reports_seen = 0
        self._started = time.monotonic()
        self._status_t = 0.0
        self.target_world = 0

    # -- start ----------------------------------------------------------------------
    def try_start(self) -> bool:
        """Gen 0 once every node's agent and every worker registered. False = not yet."""
        nodes = []
        for k in range(self.cfg.nnodes):
            if not self.store.check([Keys.node(k)]):
                self._startup_deadline(f"agent of node {k} has not joined")
                return False
            nodes.append(kv.get_json(self.store, Keys.node(k)))
        wids = [(k, f"n{k}w{i}") for k, n in enumerate(nodes) for i in range(n["nproc"] + n["spares"])]
        missing = [w for _, w in wids if not self.store.check([Keys.worker(w)])]
        if missing:
            self._startup_deadline(f"workers {', '.join(missing)} have not registered "
                                   "(slow imports, or the script fails before phoenixft.Session())")
            return False
        ranks: dict[int, str] = {}
        for k, n in enumerate(nodes):
            for i in range(n["nproc"]):
                ranks[len(ranks)] = f"n{k}w{i}"
        for k, w in wids:
            info = kv.get_json(self.store, Keys.worker(w))
            self.workers[w] = WorkerInfo(w, k, info["pid"], "waiting")
            self.monitor.watch(w)
        plan = Plan(generation=0, members=ranks,
                    nodes={r: self.workers[w].node for r, w in ranks.items()})
        self.target_world = len(ranks)
        self._publish(plan)
        return True

    def _startup_deadline(self, why: str) -> None:
        if time.monotonic() - self._started > self.cfg.startup_timeout_s:
            self._abort(f"start-up did not complete within {self.cfg.startup_timeout_s:.0f}s: {why}")

    # -- every tick -----------------------------------------------------------------
    def tick(self) -> None:
        if self.plan is None or self.plan.kind != "run":
            return
        now = time.time()
        new: list[Failure] = []
        for rep in self._new_reports():
            w = self.workers.get(rep["wid"])
            if w is None or w.state in ("dead", "exited", "fenced"):
                continue
            if rep["kind"] == "error":
                self._abort(f"the training script raised on worker {rep['wid']}:\n{rep['detail']}",
                            error=True)
                return
            if rep["kind"] == "exit":
                if rep.get("clean"):
                    w.state = "exited"
                    self.monitor.forget(w.wid)
                    continue
                w.state, w.exit_detail = "dead", rep["detail"]
                self.monitor.forget(w.wid)
                if self.store.check([Keys.result("digest")]):
                    w.state = "exited"  # training had finished; nothing to recover
                    self.events.emit("exit_after_finish", wid=w.wid, detail=rep["detail"])
                    continue
                t_fail = self._fail_time(w.wid, rep["t"])
                new.append(Failure(w.wid, self.plan.rank_of(w.wid), "exit", rep["detail"],
                                   t_fail, now))
        self.monitor.poll()
        for wid in self.monitor.stale(self.cfg.heartbeat_timeout_s):
            w = self.workers[wid]
            t_fail = self._fail_time(wid, self.monitor.last_beat_wall(wid))
            w.state, w.exit_detail = "fenced", "heartbeat silent (hung or lost)"
            self.monitor.forget(wid)
            self.store.set(Keys.fence(wid), "1")
            new.append(Failure(wid, self.plan.rank_of(wid), "hang", w.exit_detail, t_fail, now))
        if self._all_members_exited():
            if not self.store.check([Keys.result("digest")]):
                self._abort("every rank exited before training finished; see the worker logs "
                            f"in {self.run_dir / 'logs'}")
                return
            self._publish(Plan(generation=self.plan.generation + 1, kind="done",
                               reason="all ranks finished"))
            return
        member_failures = [f for f in new if f.rank is not None]
        for f in new:
            self.failures.append(f)
            self.events.emit("failure", wid=f.wid, rank=f.rank, kind=f.kind, detail=f.detail,
                             gen=self.plan.generation, detect_s=round(f.t_detect - f.t_fail, 4),
                             role="active" if f.rank is not None else "spare")
        if member_failures:
            self._replace(member_failures)
        elif self.plan.kind == "run":
            self._grow()
        self._write_status()

    def _fail_time(self, wid: str, fallback: float) -> float:
        key = Keys.failing(wid)
        return float(self.store.get(key).decode()) if self.store.check([key]) else fallback

    def _new_reports(self) -> list[dict]:
        n = kv.get_int(self.store, Keys.REPORTS, 0)
        out = []
        while self._reports_seen < n:
            self._reports_seen += 1
            key = Keys.report(self._reports_seen)
            if self.store.check([key]):
                out.append(kv.get_json(self.store, key))
        return [r for r in out if r.get("kind") in ("exit", "error")]

    def _all_members_exited(self) -> bool:
        return all(self.workers[w].state == "exited" for w in self.plan.members.values())

    def _spares(self) -> list[WorkerInfo]:
        members = set(self.plan.members.values())
        return [w for w in self.workers.values()
                if w.wid not in members and w.state in ("waiting", "running")]

    def _replace(self, failures: list[Failure]) -> None:
        plan = self.plan
        members = dict(plan.members)
        nodes = dict(plan.nodes)
        replaced: dict[int, str] = {}
        spares = self._spares()
        for f in failures:
            if f.rank is None:
                continue
            if not spares:
                self._shrink(failures)
                return
            node = plan.nodes[f.rank]
            spares.sort(key=lambda s: (s.node != node, s.wid))
            spare = spares.pop(0)
            members[f.rank] = spare.wid
            nodes[f.rank] = spare.node
            replaced[f.rank] = f.wid
            spare.state = "running"
        t_fail = min(f.t_fail for f in failures)
        t_detect = min(f.t_detect for f in failures)
        if plan.generation > 0 and not self.store.check([Keys.recovered(plan.generation)]):
            # the previous recovery never completed: this generation finishes it too
            replaced = {**plan.replaced, **replaced}
            t_fail = min(t_fail, plan.t_fail or t_fail)
            t_detect = min(t_detect, plan.t_detect or t_detect)
        new = Plan(generation=plan.generation + 1, members=members, nodes=nodes,
                   replaced=replaced, reason="; ".join(f"{f.wid}: {f.detail}" for f in failures),
                   t_fail=t_fail, t_detect=t_detect,
                   progress=kv.get_int(self.store, Keys.PROGRESS, 0))
        self._publish(new)

    def _shrink(self, failures: list[Failure]) -> None:
        """No spare left: go on with the survivors (ReCoVer) if allowed, else stop."""
        plan = self.plan
        dead = {f.wid for f in failures}
        alive = [(r, w) for r, w in sorted(plan.members.items()) if w not in dead]
        f = failures[0]
        if self.cfg.min_world is None or len(alive) < self.cfg.min_world:
            why = ("rerun with more --spares, or let the job shrink with --min-nproc"
                   if self.cfg.min_world is None else
                   f"only {len(alive)} ranks would be left, below --min-nproc {self.cfg.min_world}")
            self._abort(f"worker {f.wid} (rank {f.rank}) failed ({f.detail}) and no spare is "
                        f"left; {why}")
            return
        members = {i: w for i, (_, w) in enumerate(alive)}
        nodes = {i: plan.nodes[r] for i, (r, _) in enumerate(alive)}
        replaced = {f.rank: f.wid for f in failures if f.rank is not None}
        self._publish(Plan(generation=plan.generation + 1, members=members, nodes=nodes,
                           replaced=replaced, reason="shrink: " + "; ".join(
                               f"{x.wid}: {x.detail}" for x in failures),
                           t_fail=min(x.t_fail for x in failures),
                           t_detect=min(x.t_detect for x in failures),
                           progress=kv.get_int(self.store, Keys.PROGRESS, 0)))

    def _grow(self) -> None:
        """A spare is waiting while the job runs below its starting size: ask the members
        to stop at the next committed step, then admit the spare."""
        plan = self.plan
        if plan.world_size >= self.target_world or not self._spares():
            return
        if not self.store.check([Keys.grow(plan.generation)]):
            self.store.set(Keys.grow(plan.generation), "1")
            return
        if not self.store.check([Keys.grow_ready(plan.generation)]):
            return
        members, nodes = dict(plan.members), dict(plan.nodes)
        for s in sorted(self._spares(), key=lambda w: w.wid):
            if len(members) >= self.target_world:
                break
            members[len(members)] = s.wid
            nodes[len(nodes)] = s.node
            s.state = "running"
        self._publish(Plan(generation=plan.generation + 1, members=members, nodes=nodes,
                           reason="grow", progress=kv.get_int(self.store, Keys.PROGRESS, 0)))

    def adopt(self, wid: str, node: int) -> bool:
        """A worker started after the job began (a respawned replacement): a spare once it
        has registered."""
        if wid in self.workers or not self.store.check([Keys.worker(wid)]):
            return wid in self.workers
        info = kv.get_json(self.store, Keys.worker(wid))
        self.workers[wid] = WorkerInfo(wid, node, info["pid"], "waiting")
        self.monitor.watch(wid)
        self.events.emit("spare_added", wid=wid, node=node, pid=info["pid"])
        return True

    def _abort(self, reason: str, error: bool = False) -> None:
        self.fatal = reason
        g = self.plan.generation + 1 if self.plan else 0
        self.events.emit("abort", reason=reason, error=error)
        self._publish(Plan(generation=g, kind="abort", reason=reason))

    def _publish(self, plan: Plan) -> None:
        self.store.set(Keys.plan(plan.generation), plan.to_json())
        if plan.kind == "run":
            for w in plan.members.values():
                self.workers[w].state = "running"
        self.plan = plan if plan.kind == "run" or self.plan is None else self._final(plan)
        self.events.emit("generation", gen=plan.generation, kind=plan.kind,
                         members={r: w for r, w in plan.members.items()},
                         replaced=plan.replaced, world_size=plan.world_size)
        self._write_status(force=True)

    def _final(self, plan: Plan) -> Plan:
        plan.members, plan.nodes = self.plan.members, self.plan.nodes
        return plan

    # -- reporting ------------------------------------------------------------------
    def status(self) -> dict:
        plan = self.plan
        members = []
        rank_of = {w: r for r, w in plan.members.items()} if plan else {}
        for w in sorted(self.workers.values(), key=lambda w: (rank_of.get(w.wid, 1 << 30), w.wid)):
            role = ("active" if w.wid in rank_of else
                    "failed" if w.state in ("dead", "fenced") else "spare")
            members.append({"rank": rank_of.get(w.wid), "role": role,
                            "pid": w.pid, "state": w.state, "wid": w.wid, "node": w.node})
        return {"generation": plan.generation if plan else -1,
                "kind": plan.kind if plan else "starting",
                "world_size": plan.world_size if plan else 0,
                "step": kv.get_int(self.store, Keys.PROGRESS, 0),
                "committed_step": kv.get_int(self.store, Keys.COMMITTED, -1),
                "members": members, "failures": len(self.failures), "updated": time.time()}

    def recoveries(self) -> list[dict]:
        """One entry per replaced rank of every generation that finished recovering."""
        out = []
        kinds = {f.wid: f for f in self.failures}
        for gen in range(1, (self.plan.generation if self.plan else 0) + 1):
            key = Keys.recovered(gen)
            if not self.store.check([key]):
                continue
            rec = json.loads(self.store.get(key))
            plan = Plan.from_json(self.store.get(Keys.plan(gen)))
            for rank, dead in sorted(plan.replaced.items()):
                f = kinds.get(dead)
                src_key = Keys.source(gen, rank if rank < plan.world_size else 0)
                out.append({"gen": gen, "rank": rank, "failed_worker": dead,
                            "replacement": plan.members.get(rank),
                            "kind": f.kind if f else "unknown",
                            "detect_s": round(f.t_detect - f.t_fail, 4) if f else None,
                            "recover_s": rec["recover_s"], "lost_steps": rec["lost_steps"],
                            "restore_step": rec["restore_step"],
                            "source": (self.store.get(src_key).decode()
                                       if self.store.check([src_key]) else None)})
        return out

    def _write_status(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._status_t < 0.5:
            return
        self._status_t = time.monotonic()
        write_json_atomic(self.run_dir / "status.json", self.status())

    def summary(self, wall_s: float) -> dict:
        final_step = kv.get_int(self.store, Keys.result("final_step"), -1)
        digest = (self.store.get(Keys.result("digest")).decode()
                  if self.store.check([Keys.result("digest")]) else None)
        losses = []
        if final_step > 0:
            losses = [float(v) for v in self.store.multi_get(
                [Keys.loss(s) for s in range(1, final_step + 1)])]
        recoveries = self.recoveries()
        if final_step > 0:
            audit = self.store.multi_get([Keys.audit(s) for s in range(1, final_step + 1)])
            with (self.run_dir / "audit.jsonl").open("w") as f:
                for s, ids in enumerate(audit, start=1):
                    f.write(json.dumps({"step": s, "microbatches": json.loads(ids)}) + "\n")
        g = self.plan.generation if self.plan else 0
        return {"final_step": final_step, "final_state_digest": digest, "losses": losses,
                "final_loss": losses[-1] if losses else None,
                "failures": [f.__dict__ for f in self.failures], "recoveries": recoveries,
                "generations": g, "wall_s": round(wall_s, 3), "aborted": self.fatal,
                "microbatch_passes": kv.get_int(self.store, Keys.MB_COUNT, 0),
                "world_sizes": self._world_sizes()}

    def _world_sizes(self) -> list[int]:
        out = []
        for gen in range((self.plan.generation if self.plan else -1) + 1):
            p = Plan.from_json(self.store.get(Keys.plan(gen)))
            if p.kind == "run":
                out.append(p.world_size)
        return out


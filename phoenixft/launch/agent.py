"""The per-node agent: starts active workers and warm spares, watches their PIDs, reports
their exits, carries out fences, owns the node's snapshot shared memory, and (on node 0)
hosts the store and runs the leader.

Process exits are seen through pidfds (no polling of PIDs): the agent wakes the moment a
worker exits and reports it in the store, where the leader picks it up on its next tick
(every `tick_s`).

Lifecycle guarantees:
- workers die with their agent (the worker runner sets a parent-death signal), and run in
  their own session, so a terminal's Ctrl-C reaches only the agent;
- SIGINT or SIGTERM to the agent stops the job within a few seconds: the leader publishes
  an abort plan with the reason, workers get the grace period to leave, then SIGKILL;
  `summary.json` says why; the node's shared memory is removed; the exit status is
  128 + the signal;
- a lost job store (its host died) stops this node's workers with a message naming it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import NodeLiveness
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.leader import Leader, LeaderConfig
from phoenixft.cluster.lease import LeaderLease
from phoenixft.cluster.membership import Plan, PlanKind
from phoenixft.cluster.node_plans import RELAY_SLICE_S, NodePlans, PlanRelay
from phoenixft.cluster.protocol import fenced, file_report, latest_plan, register_node
from phoenixft.config import StragglerAction
from phoenixft.faults.inject import format_env
from phoenixft.launch.agent_console import AgentConsole
from phoenixft.launch.config import AgentConfig, LaunchError
from phoenixft.launch.forkserver import Forked, ForkServer, worker_env_defaults
from phoenixft.launch.janitor import remove_node_shm
from phoenixft.launch.resume import check_init_from, newest_persisted, persisted_job
from phoenixft.launch.rundir import RunDirLock, set_aside_previous_run
from phoenixft.launch.store_access import StoreAccess
from phoenixft.observe.events import EventLog, write_json_atomic
from phoenixft.observe.story import done_line, plural

__all__ = ["Agent", "AgentConfig", "LaunchError"]


@dataclass
class _Proc:
    wid: str
    popen: subprocess.Popen | Forked
    pidfd: int
    log: Path
    done: bool = False


class Agent:
    """`phoenixft run` on one node: starts the node's workers and warm spares, watches
    their exits through pidfds and reports them, carries out fences, owns the node's
    snapshot shared memory, hosts the store on node 0 (or joins one), runs the leader
    when it holds the lead, and tells the console what happens (`observe/story.py`).
    `run()` returns the job's exit status; the lifecycle guarantees are in the module
    docstring."""

    def __init__(self, cfg: AgentConfig, forks: ForkServer | None = None,
                 lock: RunDirLock | None = None) -> None:
        """`forks`: a fork server started early (`phoenixft run` starts it before this
        module's imports, so both import torch at once); one is started when needed.
        `lock`: the run directory's lock, if the caller took it already (before its
        imports, so a second job on the directory is refused at once)."""
        self.cfg = cfg
        self._lock = lock
        self.run_dir = Path(cfg.run_dir)
        self.events = EventLog(None)
        self.procs: dict[str, _Proc] = {}
        self.leader: Leader | None = None
        self.access: StoreAccess | None = None
        self.shm_dir: Path | None = None
        self._respawns_left = cfg.respawn
        self._spawns_seen = 0
        self._final: Plan | None = None
        self._signal: int | None = None
        self._lost_store: str | None = None
        self.console = AgentConsole(cfg, self.run_dir)  # what people see, and its watchers
        self._metrics = None  # the Prometheus exporter's server (--metrics-port)
        self.lease: LeaderLease | None = None
        self._started = False  # the leader published generation 0
        self.forks = forks  # --start-method forkserver
        self._helpers: set[int] = {forks.pid} if forks is not None else set()
        self._fences_seen = 0  # the node's fence count last read (`protocol.fenced`)
        self.hearts: NodeLiveness | None = None  # its workers' heartbeats (`_liveness`)
        self._plan_seen: Plan | None = None  # the newest plan read (`protocol.latest_plan`)
        self.relay: PlanRelay | None = None  # hands each plan to this node's workers
        self._stalled_s = 0.0  # the longest this agent stood still (SIGSTOP, a frozen host)
        self._tick_t: float | None = None  # when its loop last ticked
        self._fenced = 0  # its workers the leader fenced

    # -- set-up ---------------------------------------------------------------------
    def _open_store(self):
        self.access = StoreAccess.open(self.cfg)
        store = self.access.connect()
        if self.cfg.node_rank == 0:  # node 0 names the job (after setting the last run aside)
            check_init_from(self.cfg)
            job = persisted_job(self.cfg) or uuid.uuid4().hex[:12]
            if store.compare_set(Keys.JOB_ID, "", job).decode() != job:
                raise LaunchError(f"the store at {self.access.public} already holds job "
                                  f"{store.get(Keys.JOB_ID).decode()}: start a fresh "
                                  "`phoenixft store` for each job")
            if self.cfg.min_nproc is not None:  # (setup checks the layout can shrink so)
                store.set(Keys.MIN_WORLD, str(self.cfg.min_nproc))
        return store

    def _new_leader(self, store) -> Leader:
        cfg = self.cfg
        return Leader(store, self.events, self.run_dir,
                      LeaderConfig(nnodes=cfg.nnodes, timeouts=cfg.timeouts,
                                   min_world=cfg.min_nproc, injects=[str(s) for s in cfg.inject],
                                   swap_stragglers=cfg.stragglers.action is StragglerAction.SWAP))

    def _lead_or_follow(self, store) -> None:
        """Every tick with an external store: renew our lease, or take the lead over from
        a leader whose node died (it resumes from the state the last leader saved)."""
        if self.lease is None:
            return
        if self.leader is not None:
            if not self.lease.beat():
                self.events.emit("lead_lost", node=self.cfg.node_rank)
                self.console.say("phoenixft: another agent took over the lead", err=True)
                self.leader = None
            return
        if self.lease.watch():
            self.leader = self._new_leader(store)
            self._started = self.leader.resume()
            self.events.emit("lead_taken", node=self.cfg.node_rank, term=self.lease.term,
                             resumed=self._started)
            self.console.say(f"phoenixft: node {self.cfg.node_rank} leads the job now (term "
                      f"{self.lease.term})", err=True)

    def _env(self, wid: str, local: int) -> dict[str, str]:
        cfg = self.cfg
        env = dict(os.environ)
        env.update(
            PHOENIXFT_STORE=self.access.worker_addr, PHOENIXFT_WORKER_ID=wid,
            PHOENIXFT_NODE=str(cfg.node_rank), PHOENIXFT_RUN_DIR=str(self.run_dir.resolve()),
            PHOENIXFT_SHM_DIR=str(self.shm_dir), PHOENIXFT_INJECT=format_env(cfg.inject),
            PHOENIXFT_AGENT_PID=str(os.getpid()), PHOENIXFT_NODE_PLANS=str(self.relay.plans.dir),
            PHOENIXFT_CONFIG=json.dumps({"local_addr": self.access.local_addr,
                                         **cfg.worker_settings()}),
            # torchrun's names; RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ... are set (again)
            # each time the worker joins a generation
            LOCAL_RANK=str(local), MASTER_ADDR=self.access.public.host,
            MASTER_PORT=str(self.access.public.port), GROUP_RANK=str(cfg.node_rank),
            NODE_RANK=str(cfg.node_rank), GROUP_WORLD_SIZE=str(cfg.nnodes),
            LOCAL_WORLD_SIZE=str(cfg.nproc), TORCHELASTIC_RUN_ID=self.job_id,
            PHOENIXFT_MODULE="1" if cfg.module else "0",
        )
        env.pop("PHOENIXFT_AUTH_TOKEN", None)  # workers reach the store through the agent
        return worker_env_defaults(env)

    def _start_janitor(self) -> None:
        """Removes the node's shared memory even if this agent is SIGKILLed (janitor.py)."""
        p = subprocess.Popen([self.cfg.python, "-m", "phoenixft.launch.janitor", str(os.getpid()),
                              str(self.shm_dir)], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        self._helpers.add(p.pid)

    def _start_worker(self, i: int) -> _Proc:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        wid = f"n{self.cfg.node_rank}w{i}"
        log = logs / f"{wid}.log"
        args = [self.cfg.script, *self.cfg.script_args]
        with log.open("wb") as out:
            if self.cfg.start_method == "forkserver":
                if self.forks is None:
                    self.forks = ForkServer(self.cfg.python, self.cfg.timeouts.startup_timeout_s)
                    self._helpers.add(self.forks.pid)
                p = self.forks.spawn(args, self._env(wid, i), os.getcwd(), out.fileno())
            else:
                p = subprocess.Popen([self.cfg.python, "-m", "phoenixft.launch.worker", *args],
                                     env=self._env(wid, i), stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        proc = self.procs[wid] = _Proc(wid, p, os.pidfd_open(p.pid), log)
        return proc

    def _reap_orphans(self) -> None:
        """As a subreaper the agent adopts orphaned descendants (a dead worker's own
        children); reap those that have exited, leaving workers to `_reap`."""
        known = self._helpers | {p.popen.pid for p in self.procs.values()}
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in known:
                return
            os.waitpid(info.si_pid, 0)

    def _respawn(self, store, sel) -> None:
        """Start a replacement for a dead worker; it registers as a spare and the leader
        admits it at the next step boundary (the job grows back)."""
        if self._respawns_left <= 0 or self._final is not None or self._signal is not None:
            return
        self._respawns_left -= 1
        p = self._start_worker(len(self.procs))
        sel.register(p.pidfd, selectors.EVENT_READ, p)
        i = store.add(Keys.SPAWNS, 1)
        kv.set_json(store, Keys.spawn(i), {"wid": p.wid, "node": self.cfg.node_rank})
        self.events.emit("respawn", wid=p.wid, pid=p.popen.pid)

    def _on_signal(self, signum, _frame) -> None:
        if self._signal is None:
            self._signal = signum
            self.console.say(f"phoenixft: {signal.Signals(signum).name} received: stopping the job", err=True)

    # -- main loop ------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        t_start = time.time()
        lock = self._lock or RunDirLock(self.run_dir, cfg.node_rank)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        store, final = None, None
        try:
            if cfg.node_rank == 0:
                set_aside_previous_run(self.run_dir)
                self.events = EventLog(self.run_dir / "events.jsonl", node=0)
            self._start_metrics()
            store = self._open_store()
            self._join_job(store)
            final = self._loop(store)
        except kv.STORE_LOST as exc:
            self._lost_store = str(exc).splitlines()[0]
        finally:
            self._stop_workers()
            for s, h in previous.items():
                signal.signal(s, h)
            if self._metrics is not None:
                self._metrics.shutdown()
        if self.relay is not None:
            # (its thread may be inside a store wait: exiting under it aborts the process
            # with "terminate called without an active exception")
            self.relay.stop(timeout_s=RELAY_SLICE_S + 1)
        rc = self._finish(store, final, time.time() - t_start)
        if self.access is not None:
            self.access.close()
        lock.release()
        return rc

    def _start_metrics(self) -> None:
        cfg = self.cfg
        if cfg.metrics_port is None:
            return
        from phoenixft.observe.train_metrics import serve_metrics
        try:
            self._metrics, _ = serve_metrics(self.run_dir, cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            raise LaunchError(f"--metrics-port {cfg.metrics_port}: cannot listen on "
                              f"{cfg.metrics_host}:{cfg.metrics_port} ({exc.strerror})") from None
        self.console.say(f"phoenixft: metrics on http://{cfg.metrics_host}:{cfg.metrics_port}/metrics")

    def _join_job(self, store) -> None:
        cfg = self.cfg
        if not kv.wait_for(store, [Keys.JOB_ID], cfg.timeouts.startup_timeout_s):
            raise LaunchError(f"no job id in the store at {cfg.store} within "
                              f"{cfg.timeouts.startup_timeout_s:.0f}s: is node 0's agent running?")
        if cfg.node_rank != 0:  # only once node 0 has set the last run aside
            self.events = EventLog(self.run_dir / "events.jsonl", node=cfg.node_rank)
        job = self.job_id = store.get(Keys.JOB_ID).decode()
        self.shm_dir = Path("/dev/shm") / f"phoenixft-{job}" / f"n{cfg.node_rank}"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.hearts = NodeLiveness(cfg.node_rank, self.shm_dir, cfg.timeouts)
        self._start_janitor()
        # the node's workers read each plan here, not from the store (one read a node)
        self.relay = PlanRelay(self.access.connect, NodePlans(self.shm_dir / "plans")).start()
        self.events.emit("agent_start", job=job, shm_dir=str(self.shm_dir), pid=os.getpid(),
                         store=str(self.access.public), local_addr=self.access.local_addr)
        register_node(store, cfg.node_rank, cfg.nproc, cfg.spares, os.getpid())
        if cfg.external_store:
            self.lease = LeaderLease(store, cfg.node_rank, cfg.timeouts.heartbeat_timeout_s)
        if cfg.hosts_store or (self.lease is not None and cfg.node_rank == 0
                               and self.lease.claim_first()):
            self.leader = self._new_leader(store)
            self.events.emit("start", store=str(self.access.public), nnodes=cfg.nnodes,
                             nproc=cfg.nproc, spares=cfg.spares, script=cfg.script,
                             args=cfg.script_args, inject=[str(s) for s in cfg.inject])
            self.console.say(f"phoenixft: store {self.access.public}, {plural(cfg.nproc, 'worker')} + "
                      f"{plural(cfg.spares, 'spare')}, run dir {self.run_dir}")
        for i in range(cfg.nproc + cfg.spares):
            if self._signal is not None:  # SIGINT/SIGTERM while starting: start no more
                break
            self._start_worker(i)

    def _loop(self, store) -> Plan | None:
        sel = selectors.DefaultSelector()
        for p in self.procs.values():
            sel.register(p.pidfd, selectors.EVENT_READ, p)
        try:
            while True:
                ready = sel.select(timeout=self.cfg.tick_s)
                self._note_stall()  # (before the store is touched: it may be gone since)
                for key, _ in ready:
                    sel.unregister(key.fileobj)
                    self._reap(store, key.data)
                    self._respawn(store, sel)
                self._liveness(store)
                if self.hearts.due:  # the store's part, once a heartbeat period
                    self._fences(store)
                if self.forks is not None:
                    self._reap_orphans()
                self._lead_or_follow(store)
                if self.leader is not None:
                    if self._signal is not None and self.leader.plan_kind in ("starting",
                                                                              PlanKind.RUN):
                        self.leader.stop(f"interrupted by {signal.Signals(self._signal).name}")
                    elif not self._started:
                        self._started = self.leader.try_start()
                    else:
                        self._adopt_spawns(store)
                        self.leader.tick()
                    self.console.echo_progress(store, self.leader)  # (before the account:
                    self.console.tell(store, self.events, self.leader)  # a step's line
                    # comes before the failure that followed it)
                self.console.watch_persistence(store, self.leader)
                self.console.watch_run_dir(self.events, self.leader)
                final = self._final = self._final or self._final_plan(store, self.hearts.due)
                if final is not None:  # done (every member has exited) or abort: what
                    return final       # is left, a hung spare too, gets the grace period
                                       # to leave, then SIGKILL (_stop_workers)
                if final is None and self.leader is None and (
                        self._signal is not None or all(p.done for p in self.procs.values())):
                    return self._await_final(store)
        finally:
            sel.close()

    def _note_stall(self) -> None:
        """Once a tick: a gap between ticks of half the heartbeat deadline or more means
        this agent stood still (stopped, or its host froze), long enough for the leader to
        count its workers as hung (its last beat may have come most of a beat interval
        before it stopped); its last words say so (`_finish`)."""
        now = time.monotonic()
        gap = 0.0 if self._tick_t is None else now - self._tick_t
        self._tick_t = now
        if gap >= self.cfg.timeouts.heartbeat_timeout_s / 2 and gap > self._stalled_s:
            self._stalled_s = gap
            self.events.emit("agent_stalled", node=self.cfg.node_rank, stalled_s=round(gap, 3))

    def _adopt_spawns(self, store) -> None:
        n = kv.get_int(store, Keys.SPAWNS, 0)
        while self._spawns_seen < n:
            info = kv.get_json(store, Keys.spawn(self._spawns_seen + 1))
            if not self.leader.adopt(info["wid"], info["node"]):
                return  # not registered yet; try again next tick
            self._spawns_seen += 1

    def _reap(self, store, p: _Proc) -> None:
        """Report a worker's exit, with its exit status and whether it raised."""
        rc = p.popen.wait()
        os.close(p.pidfd)
        p.done = True
        self.hearts.forget(p.wid)
        detail = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        kind = ReportKind.EXIT
        if rc != 0 and store.check([Keys.error(p.wid)]):
            kind, detail = ReportKind.ERROR, store.get(Keys.error(p.wid)).decode()
        file_report(store, {"kind": kind, "wid": p.wid, "detail": detail, "rc": rc})

    def _liveness(self, store) -> None:
        """Every tick: this node's beat, its workers' hangs reported (`NodeLiveness`). The
        agent ticks every 20 ms for its own workers (pidfds, shared memory), but reads the
        store (fences, the job's end) once a heartbeat period, with its beat: at 20 ms,
        512 agents sent the store 51k requests a second doing nothing."""
        self.hearts.tick(store, [p.wid for p in self.procs.values() if not p.done])

    def _fences(self, store) -> None:
        live = {p.wid: p for p in self.procs.values() if not p.done}
        found, self._fences_seen = fenced(store, self.cfg.node_rank, list(live),
                                          self._fences_seen)
        self._fenced += len(found)
        for wid in found:
            try:
                os.kill(live[wid].popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _final_plan(self, store, read: bool = True) -> Plan | None:
        """The job's last plan once it ended, else None; `read`: whether a follower reads
        the store for it now (its loop does once a heartbeat period)."""
        if self.leader is not None:
            plan = self.leader.plan
            return plan if plan is not None and plan.kind is not PlanKind.RUN else None
        if self.relay is not None and self.relay.error is None:
            self._plan_seen = self.relay.latest  # (the relay reads every plan anyway)
        elif read or self._plan_seen is None:
            self._plan_seen = latest_plan(store, self._plan_seen)
        plan = self._plan_seen
        return plan if plan is not None and plan.kind is not PlanKind.RUN else None

    def _await_final(self, store) -> Plan | None:
        deadline = time.monotonic() + self.cfg.shutdown_grace_s
        while time.monotonic() < deadline:
            plan = self._final_plan(store)
            if plan is not None:
                return plan
            time.sleep(self.cfg.tick_s)  # our workers are gone; wait for the leader's verdict
        return None

    def _stop_workers(self) -> None:
        """Give workers the grace period to leave on their own (they read the final plan),
        then SIGKILL what is left. Never returns with a worker alive."""
        deadline = time.monotonic() + self.cfg.shutdown_grace_s
        for p in self.procs.values():
            if p.done:
                continue
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            p.done = True
        if self.forks is not None:
            self.forks.close()

    # -- the end ----------------------------------------------------------------------
    def _finish(self, store, final: Plan | None, wall_s: float) -> int:
        rc = 0 if final is not None and final.kind is PlanKind.DONE else 1
        if self._lost_store is not None:
            who = ("the standalone store" if self.cfg.external_store else
                   "node 0's agent hosted it: without a standalone store (`phoenixft store`), "
                   "losing node 0 ends the job")
            newest = newest_persisted(self.cfg.persistence.url, self.console.persisted_step)
            resume = (f"; the newest persisted step is {newest} in {self.cfg.persistence.url}: "
                      "rerun the job with --resume to continue from it" if newest >= 0 else "")
            if self._stalled_s:  # (what node 0 was doing meanwhile is not ours to say)
                who = (f"{self._stood_still()}; the store went away meanwhile: the job ended, or node "
                       "0 was lost; node 0's console and run dir tell the job's outcome")
            self.console.say(f"phoenixft: node {self.cfg.node_rank} stops: {self._lost_store} at "
                      f"{self.cfg.store} ({who}); its workers were stopped{resume}", err=True)
        elif self.leader is None and final is None and self._signal is None:
            why = (f"{self._stood_still()}, so the leader counted its workers as hung"
                   if self._stalled_s else "the leader found its workers hung"
                   if self._fenced else "its workers are gone")
            self.console.say(f"phoenixft: node {self.cfg.node_rank} leaves the job: {why}; "
                      + ("they were fenced and the job goes on without this node"
                         if self._stalled_s or self._fenced else
                         f"no verdict from the leader within {self.cfg.shutdown_grace_s:g}s")
                      , err=True)
            self._leave(store)
        elif self.leader is not None:
            try:
                self.console.watch_persistence(store, self.leader, final=True)
            except Exception:  # noqa: BLE001 - a console line must not cost the summary
                pass
            summary = self._write_summary(wall_s)
            if self.leader.problems or summary is None:
                rc = 1
            summary = summary or {}
            self.events.emit("finished", ok=rc == 0, final_step=summary.get("final_step"),
                             digest=summary.get("final_state_digest"),
                             aborted=summary.get("aborted"))
            self.console.tell(store, self.events, self.leader)
            if final is not None and final.kind is PlanKind.ABORT:
                self.console.say(f"phoenixft: job stopped: {final.reason}", err=True)
            elif rc != 0 and self.leader.problems:
                self.console.say(f"phoenixft: training finished, but {'; '.join(self.leader.problems)}",
                          err=True)
            elif rc == 0:
                self.console.say(done_line(summary, str(self.run_dir)), err=False, always=True)
            self._wait_agents_gone(store)  # let the others read the verdict first
        else:
            self._leave(store)
        if self.shm_dir is not None:
            remove_node_shm(str(self.shm_dir))
        return 128 + self._signal if self._signal is not None else rc

    def _stood_still(self) -> str:
        return (f"this agent stood still for {self._stalled_s:.1f}s (stopped, or its host "
                f"froze; the heartbeat deadline is {self.cfg.timeouts.heartbeat_timeout_s:g}s)")

    def _leave(self, store) -> None:
        """A follower's goodbye, which node 0's agent waits for (`_wait_agents_gone`)."""
        if store is None:
            return
        try:
            store.add(Keys.AGENTS_DONE, 1)
        except Exception:  # noqa: BLE001 - the store is gone: nobody waits any more
            pass

    def _write_summary(self, wall_s: float) -> dict | None:
        """summary.json, audit.jsonl and the final status.json; None (said on the console)
        when the run directory has no room for them."""
        try:
            summary = self.leader.summary(wall_s)  # (writes audit.jsonl)
            write_json_atomic(self.run_dir / "summary.json", summary)
            write_json_atomic(self.run_dir / "status.json", self.leader.final_status())
            return summary
        except OSError as exc:
            self.console.say(f"phoenixft: the job ended, but its summary cannot be written to "
                      f"{self.run_dir} ({exc.strerror or exc}): make room there", err=True)
            return None

    def _wait_agents_gone(self, store) -> None:
        if self.cfg.nnodes == 1:
            return
        deadline = time.monotonic() + 5.0
        try:
            while store.add(Keys.AGENTS_DONE, 0) < self.cfg.nnodes - 1:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)  # bounded wait for the other agents' goodbye
        except kv.STORE_LOST:
            return

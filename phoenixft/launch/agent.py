"""The per-node agent: starts active workers and warm spares, watches their PIDs, reports
deaths, carries out fences, owns the node's snapshot shared memory, and (on node 0)
hosts the store and runs the leader.

Process deaths are seen through pidfds (no polling of PIDs): the agent wakes the moment
a worker exits and reports it in the store, where the leader picks it up on its next
tick (every `tick_s`).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.leader import Leader, LeaderConfig
from phoenixft.cluster.membership import Plan
from phoenixft.faults.inject import InjectSpec, format_env
from phoenixft.observe.events import EventLog, write_json_atomic


class LaunchError(ValueError):
    """Bad launcher input; the message says what to change."""


@dataclass(kw_only=True)
class AgentConfig:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc: int = 1
    spares: int = 0
    nnodes: int = 1
    node_rank: int = 0
    store: str | None = None  # HOST:PORT; node 0 hosts it (port 0 or None: pick a free one)
    run_dir: str = "runs/latest"
    inject: list[InjectSpec] = field(default_factory=list)
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 3.0
    collective_timeout_s: float = 60.0
    join_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    replicas: int = 1
    snapshots: bool = True  # False only for the overhead benchmark's baseline
    min_nproc: int | None = None  # ReCoVer: shrink down to this many ranks without spares
    policy: str = "constant"  # microbatches per step after a shrink: constant | shrink-batch
    respawn: int = 0  # replacement workers this agent may start for dead ones (they grow
                      # the job back at a step boundary)
    tick_s: float = 0.02
    shutdown_grace_s: float = 20.0
    python: str = sys.executable
    echo: bool = True  # print progress lines to stdout

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise LaunchError(f"--nproc must be >= 1, got {self.nproc}")
        if self.spares < 0:
            raise LaunchError(f"--spares must be >= 0, got {self.spares}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.store:
            raise LaunchError("--nnodes > 1 needs --store HOST:PORT (the node-0 agent's address)")
        if not Path(self.script).is_file():
            raise LaunchError(f"script {self.script!r} does not exist")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise LaunchError("--heartbeat-timeout must exceed twice the heartbeat interval")
        if self.store:
            kv.parse_addr(self.store)
        if self.min_nproc is not None and not 1 <= self.min_nproc <= self.nproc * self.nnodes:
            raise LaunchError(f"--min-nproc must be in [1, {self.nproc * self.nnodes}], "
                              f"got {self.min_nproc}")
        if self.policy not in ("constant", "shrink-batch"):
            raise LaunchError(f"--policy must be 'constant' or 'shrink-batch', got {self.policy!r}")
        if self.respawn < 0:
            raise LaunchError(f"--respawn must be >= 0, got {self.respawn}")


@dataclass
class _Proc:
    wid: str
    popen: subprocess.Popen
    pidfd: int
    log: Path
    done: bool = False


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / "events.jsonl" if cfg.node_rank == 0 else None,
                               node=cfg.node_rank)
        self.procs: dict[str, _Proc] = {}
        self.leader: Leader | None = None
        self._server = None
        self.shm_dir: Path | None = None
        self._respawns_left = cfg.respawn
        self._spawns_seen = 0
        self._final: Plan | None = None

    # -- set-up ---------------------------------------------------------------------
    def _open_store(self):
        cfg = self.cfg
        if cfg.node_rank == 0:
            host, port = kv.parse_addr(cfg.store) if cfg.store else ("127.0.0.1", 0)
            port = port or kv.free_port(host)
            self._server = kv.host_store(host, port)
            self.store_addr = f"{host}:{port}"
            self._server.set(Keys.JOB_ID, uuid.uuid4().hex[:12])
            return self._server
        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            try:
                s = kv.connect(cfg.store, timeout_s=10)
                self.store_addr = cfg.store
                return s
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise LaunchError(f"cannot reach the store at {cfg.store}: {exc}") from None
                time.sleep(0.5)  # retry back-off while node 0 comes up

    def _env(self, wid: str, local: int) -> dict[str, str]:
        cfg = self.cfg
        host, port = kv.parse_addr(self.store_addr)
        env = dict(os.environ)
        env.update(
            PHOENIXFT_STORE=self.store_addr, PHOENIXFT_WORKER_ID=wid,
            PHOENIXFT_NODE=str(cfg.node_rank), PHOENIXFT_RUN_DIR=str(self.run_dir.resolve()),
            PHOENIXFT_SHM_DIR=str(self.shm_dir), PHOENIXFT_INJECT=format_env(cfg.inject),
            PHOENIXFT_CONFIG=json.dumps({
                "heartbeat_interval_s": cfg.heartbeat_interval_s,
                "collective_timeout_s": cfg.collective_timeout_s,
                "join_timeout_s": cfg.join_timeout_s, "replicas": cfg.replicas,
                "snapshots": cfg.snapshots, "policy": cfg.policy}),
            # torchrun-compatible names; RANK/WORLD_SIZE are set when a generation is joined
            LOCAL_RANK=str(local), MASTER_ADDR=host, MASTER_PORT=str(port),
            GROUP_RANK=str(cfg.node_rank), PYTHONUNBUFFERED="1",
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store-wait timeouts are expected
        return env

    def _spawn(self) -> None:
        for i in range(self.cfg.nproc + self.cfg.spares):
            self._start_worker(i)

    def _start_worker(self, i: int) -> _Proc:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        wid = f"n{self.cfg.node_rank}w{i}"
        log = logs / f"{wid}.log"
        with log.open("wb") as out:
            p = subprocess.Popen([self.cfg.python, self.cfg.script, *self.cfg.script_args],
                                 env=self._env(wid, i), stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        proc = self.procs[wid] = _Proc(wid, p, os.pidfd_open(p.pid), log)
        return proc

    def _respawn(self, store, sel) -> None:
        """Start a replacement for a dead worker; it registers as a spare and the leader
        admits it at the next step boundary (the job grows back)."""
        if self._respawns_left <= 0 or self._final is not None:
            return
        self._respawns_left -= 1
        p = self._start_worker(len(self.procs))
        sel.register(p.pidfd, selectors.EVENT_READ, p)
        i = store.add(Keys.SPAWNS, 1)
        kv.set_json(store, Keys.spawn(i), {"wid": p.wid, "node": self.cfg.node_rank})
        self.events.emit("respawn", wid=p.wid, pid=p.popen.pid)

    # -- main loop ------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        t_start = time.time()
        if cfg.node_rank == 0:
            self._set_aside_previous_run()
        store = self._open_store()
        if cfg.node_rank != 0:  # only once node 0 has set the last run aside
            self.events = EventLog(self.run_dir / "events.jsonl", node=cfg.node_rank)
        job = store.get(Keys.JOB_ID).decode()
        self.shm_dir = Path("/dev/shm") / f"phoenixft-{job}" / f"n{cfg.node_rank}"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.events.emit("agent_start", job=job, shm_dir=str(self.shm_dir), pid=os.getpid())
        kv.set_json(store, Keys.node(cfg.node_rank),
                    {"nproc": cfg.nproc, "spares": cfg.spares, "pid": os.getpid()})
        if cfg.node_rank == 0:
            self.leader = Leader(store, self.events, self.run_dir,
                                 LeaderConfig(nnodes=cfg.nnodes,
                                              heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                              startup_timeout_s=cfg.startup_timeout_s,
                                              min_world=cfg.min_nproc))
            self.events.emit("start", store=self.store_addr, nnodes=cfg.nnodes,
                             nproc=cfg.nproc, spares=cfg.spares, script=cfg.script,
                             args=cfg.script_args, inject=[str(s) for s in cfg.inject])
            self._say(f"phoenixft: store {self.store_addr}, {cfg.nproc} workers + "
                      f"{cfg.spares} spares, run dir {self.run_dir}")
        self._spawn()
        sel = selectors.DefaultSelector()
        for p in self.procs.values():
            sel.register(p.pidfd, selectors.EVENT_READ, p)
        started = False
        final: Plan | None = None
        last_progress = 0
        try:
            while True:
                for key, _ in sel.select(timeout=cfg.tick_s):
                    sel.unregister(key.fileobj)
                    if not self._reap(store, key.data):
                        self._respawn(store, sel)
                self._fences(store)
                if self.leader is not None:
                    if not started:
                        started = self.leader.try_start()
                    else:
                        self._adopt_spawns(store)
                        self.leader.tick()
                    last_progress = self._echo_progress(store, last_progress)
                final = self._final = final or self._final_plan(store)
                if final is not None and (final.kind == "abort" or
                                          all(p.done for p in self.procs.values())):
                    break
                if final is None and self.leader is None and all(p.done for p in self.procs.values()):
                    final = self._await_final(store)
                    break
        finally:
            self._stop_workers()
            sel.close()
        return self._finish(store, final, time.time() - t_start)

    def _set_aside_previous_run(self) -> None:
        """A reused run dir: move the last run's files into previous/ rather than mixing
        two runs in one events.jsonl (nothing is deleted)."""
        old = [self.run_dir / n for n in ("events.jsonl", "status.json", "summary.json", "model")]
        if not any(p.exists() and (p.is_dir() or p.stat().st_size) for p in old):
            return
        dest = self.run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
        dest.mkdir(parents=True, exist_ok=True)
        for p in old:
            if p.exists():
                p.rename(dest / p.name)
        self.events = EventLog(self.run_dir / "events.jsonl", node=self.cfg.node_rank)

    def _adopt_spawns(self, store) -> None:
        n = kv.get_int(store, Keys.SPAWNS, 0)
        while self._spawns_seen < n:
            info = kv.get_json(store, Keys.spawn(self._spawns_seen + 1))
            if not self.leader.adopt(info["wid"], info["node"]):
                return  # not registered yet; try again next tick
            self._spawns_seen += 1

    def _reap(self, store, p: _Proc) -> bool:
        """Report a worker's exit; returns True when it was a clean one."""
        rc = p.popen.wait()
        os.close(p.pidfd)
        p.done = True
        clean = rc == 0 and store.check([Keys.exit(p.wid)])
        if rc < 0:
            detail = f"killed by {signal.Signals(-rc).name}"
        else:
            detail = f"exit code {rc}"
        kind = "exit"
        if rc != 0 and store.check([Keys.error(p.wid)]):
            kind, detail = "error", store.get(Keys.error(p.wid)).decode()
        i = store.add(Keys.REPORTS, 1)
        kv.set_json(store, Keys.report(i), {"kind": kind, "wid": p.wid, "t": time.time(),
                                           "detail": detail, "clean": clean, "rc": rc})
        return clean or kind == "error"

    def _fences(self, store) -> None:
        for p in self.procs.values():
            if not p.done and store.check([Keys.fence(p.wid)]):
                try:
                    os.kill(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _final_plan(self, store) -> Plan | None:
        if self.leader is not None:
            plan = self.leader.plan
            return plan if plan is not None and plan.kind != "run" else None
        g = 0
        while store.check([Keys.plan(g + 1)]):
            g += 1
        if not store.check([Keys.plan(g)]):
            return None
        plan = Plan.from_json(store.get(Keys.plan(g)))
        return plan if plan.kind != "run" else None

    def _await_final(self, store) -> Plan | None:
        deadline = time.monotonic() + self.cfg.shutdown_grace_s
        while time.monotonic() < deadline:
            plan = self._final_plan(store)
            if plan is not None:
                return plan
            time.sleep(self.cfg.tick_s)  # our workers are gone; wait for the leader's verdict
        return None

    def _stop_workers(self) -> None:
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

    def _finish(self, store, final: Plan | None, wall_s: float) -> int:
        rc = 0 if final is not None and final.kind == "done" else 1
        if self.leader is not None:
            summary = self.leader.summary(wall_s)
            write_json_atomic(self.run_dir / "summary.json", summary)
            write_json_atomic(self.run_dir / "status.json", self.leader.status())
            self.events.emit("finished", ok=rc == 0, final_step=summary["final_step"],
                             digest=summary["final_state_digest"])
            if final is not None and final.kind == "abort":
                self._say(f"phoenixft: job stopped: {final.reason}", err=True)
            else:
                self._say(f"phoenixft: done: {summary['final_step']} steps, "
                          f"{len(summary['failures'])} failures, final loss "
                          f"{summary['final_loss']}, digest {summary['final_state_digest']}")
            # let the other agents read the verdict before the store goes away
            self._wait_agents_gone(store)
        else:
            try:
                store.add(Keys.AGENTS_DONE, 1)
            except Exception:
                pass
        if self.shm_dir is not None:
            shutil.rmtree(self.shm_dir.parent if self.cfg.node_rank == 0 else self.shm_dir,
                          ignore_errors=True)
        return rc

    def _wait_agents_gone(self, store) -> None:
        if self.cfg.nnodes == 1:
            return
        deadline = time.monotonic() + 5.0
        n = store.add(Keys.AGENTS_DONE, 0)
        while n < self.cfg.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for the other agents' goodbye
            n = store.add(Keys.AGENTS_DONE, 0)

    def _echo_progress(self, store, last: int) -> int:
        step = kv.get_int(store, Keys.PROGRESS, 0)
        if step != last and step % 10 == 0 and store.check([Keys.loss(step)]):
            self._say(f"step {step:5d}  loss {float(store.get(Keys.loss(step))):.4f}  "
                      f"gen {self.leader.plan.generation if self.leader.plan else 0}")
        return step

    def _say(self, msg: str, err: bool = False) -> None:
        if self.cfg.echo:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)

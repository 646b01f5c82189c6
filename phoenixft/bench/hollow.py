"""The processes of `phoenixft bench control-plane`: the job store, the leader, and hollow
members (many to a process) that run the control plane's code without any training.

A hollow member does, through the same functions, what a training member does with the
store: it registers (`protocol.register_worker`), beats (`HeartbeatSender`, in its node's
shared memory), finds each plan in its node's shared memory, records where it restored
from in its node's tally (`protocol.joined`: the node's last member writes the node's
record; rank 0 also its recovery record and progress) and acknowledges its first
snapshot through the node's tally (`snapshot.acknowledge`: the node's last member adds
the node's count, the last of those commits). A hollow agent per simulated node relays
each plan into its node's shared memory (`node_plans.relay_one`: the plan's change, one
get), does its agent's per-tick work (`NodeLiveness`: its node's beat in the store, its
members' hangs reported; `protocol.fenced`) and files exit reports
(`protocol.file_report`).

What a hollow member skips: process groups and their rendezvous, tensors (restore,
snapshot copies, replicas), the generation barrier, the training thread's waits on
commits, and parsing the plan's file itself (a node's members share one parse here; a
worker parses its node's file once a generation). One store wait per process stands for
every node relay's: a relay waits on the store in `RELAY_SLICE_S` slices, a request and
its cancellation each, which the figures leave out (one a node per generation and 0.5
a second a node at 2 s slices). A process's nodes share `node_threads` connections (4),
so theirs run 4 at a time, where a job's agents send them all at once; and every node's
agent and every member's heartbeat run on the same 2 cores, where a job's run on their
own nodes.

Every process counts its store requests and payload bytes (`CountingStore`) and its CPU
time, and answers the benchmark's questions over a pipe (JSON).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from phoenixft.checkpoint.snapshot import acknowledge
from phoenixft.cluster import protocol
from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import HeartbeatSender, NodeLiveness, beats_dir
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.leader import Leader, LeaderConfig
from phoenixft.cluster.membership import PlanKind
from phoenixft.cluster.node_plans import RELAY_SLICE_S, NodePlans, relay_one
from phoenixft.cluster.node_tally import NodeShare, NodeTally
from phoenixft.config import Timeouts
from phoenixft.observe.events import EventLog

_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where the members beat
STEPS_PER_GENERATION = 10  # the step a generation's first snapshot is numbered from


def _size(x) -> int:
    if isinstance(x, (bytes, bytearray)):
        return len(x)
    if isinstance(x, str):
        return len(x.encode())
    if isinstance(x, (list, tuple)):
        return sum(_size(v) for v in x)
    return 8


class CountingStore:
    """A store client that counts its requests (by kind) and payload bytes (keys and
    values, both ways; the wire's framing is not counted). One per thread, like the
    connections it wraps."""

    def __init__(self, inner) -> None:
        self._s = inner
        self.ops: Counter = Counter()
        self.bytes = 0

    def _count(self, op: str, *payload) -> None:
        self.ops[op] += 1
        self.bytes += sum(_size(p) for p in payload)

    def add(self, key, n):
        self._count("add", key)
        return self._s.add(key, n)

    def set(self, key, value):
        self._count("set", key, value)
        return self._s.set(key, value)

    def get(self, key):
        v = self._s.get(key)
        self._count("get", key, v)
        return v

    def check(self, keys):
        self._count("check", keys)
        return self._s.check(keys)

    def multi_get(self, keys):
        vs = self._s.multi_get(keys)
        self._count("multi_get", keys, vs)
        return vs

    def multi_set(self, keys, values):
        self._count("multi_set", keys, values)
        return self._s.multi_set(keys, values)

    def compare_set(self, key, expected, desired):
        v = self._s.compare_set(key, expected, desired)
        self._count("compare_set", key, expected, desired, v)
        return v

    def wait(self, keys, *timeout):
        self._count("wait", keys)
        return self._s.wait(keys, *timeout)


def total(stores: list[CountingStore]) -> dict:
    ops: Counter = Counter()
    for s in stores:
        ops.update(s.ops)
    return {"ops": dict(ops), "requests": sum(ops.values()),
            "bytes": sum(s.bytes for s in stores)}


@dataclass(frozen=True)
class HollowSpec:
    """One hollow process: simulated nodes `first_node` .. `first_node + nodes - 1`, each
    with `per_node` members, and `spares` spares on its first nodes (one a node)."""

    addr: str
    first_node: int
    nodes: int
    per_node: int
    spares: int
    tick_s: float
    heartbeat_s: float
    heartbeat_timeout_s: float
    watch_slice_s: float = RELAY_SLICE_S  # what a node's plan relay waits at a time
    node_threads: int = 4  # threads (a store connection each) running the nodes' relays


def _answer(conn, handle) -> None:
    """Serve the benchmark's JSON requests until it says stop."""
    while True:
        msg = json.loads(conn.recv())
        reply = handle(msg)
        conn.send(json.dumps(reply))
        if msg["cmd"] == "stop":
            return


def store_main(conn) -> None:
    server, port = kv.host_store("127.0.0.1", 0, timeout_s=300)
    conn.send(json.dumps({"port": port}))
    _answer(conn, lambda msg: {"cpu_s": time.process_time()})
    del server


def leader_main(conn, addr: str, run_dir: str, nnodes: int, tick_s: float,
                timeouts: dict) -> None:
    store = CountingStore(kv.connect(addr, timeout_s=300))
    leader = Leader(store, EventLog(Path(run_dir) / "events.jsonl"), Path(run_dir),
                    LeaderConfig(nnodes=nnodes, timeouts=Timeouts(**timeouts)))
    ticks: list[float] = []
    cpu = [0.0]
    stop = threading.Event()

    def loop() -> None:
        started = False
        while not stop.is_set():
            c0, t0 = time.thread_time(), time.perf_counter()
            if not started:
                started = leader.try_start()
            else:
                kv.get_int(store, Keys.SPAWNS, 0)  # the leading agent's own read a tick
                leader.tick()
            ticks.append(time.perf_counter() - t0)
            cpu[0] += time.thread_time() - c0
            if leader.plan is not None and leader.plan.kind is not PlanKind.RUN:
                return
            stop.wait(tick_s)  # (the agent's select() timeout)

    th = threading.Thread(target=loop, daemon=True)
    th.start()

    def handle(msg: dict) -> dict:
        if msg["cmd"] == "stop":
            stop.set()
            th.join(10)
        out = {**total([store]), "cpu_s": time.process_time(), "leader_cpu_s": cpu[0],
               "ticks": list(ticks), "fatal": leader.fatal}
        ticks.clear()
        return out
    _answer(conn, handle)


class HollowProcess:
    """The members and agents of a range of simulated nodes, in one process."""

    def __init__(self, spec: HollowSpec) -> None:
        self.spec = spec
        nodes = range(spec.first_node, spec.first_node + spec.nodes)
        self.node_wids = {k: [f"n{k}w{i}" for i in range(spec.per_node + (1 if j < spec.spares else 0))]
                          for j, k in enumerate(nodes)}
        self.wids = [w for ws in self.node_wids.values() for w in ws]
        self.dead: set[str] = set()  # killed: exited or hung
        self.exited: set[str] = set()
        self.shm = Path(tempfile.mkdtemp(prefix="phoenixft-hollow-", dir=_SHM))
        self.stores: list[CountingStore] = []
        self.stop = threading.Event()
        self.agent_ticks = 0
        self.known = None  # the plan the nodes here relayed last (each read its change)
        self.memo: dict = {}  # plans built from changes, shared by the nodes here
        self.joined_generations = 0

    def _shm(self, k: int) -> Path:
        return self.shm / f"n{k}"

    def connect(self) -> CountingStore:
        s = CountingStore(kv.connect(self.spec.addr, timeout_s=300))
        self.stores.append(s)
        return s

    def start(self) -> None:
        store = self.connect()
        self.main = store
        for k, ws in self.node_wids.items():
            n_spares = len(ws) - self.spec.per_node
            protocol.register_node(store, k, self.spec.per_node, n_spares, os.getpid())
        self.hb = {k: HeartbeatSender(beats_dir(self._shm(k)), ws, self.spec.heartbeat_s)
                   for k, ws in self.node_wids.items()}
        for k, ws in self.node_wids.items():
            for w in ws:
                protocol.register_worker(store, w, k, os.getpid())
        self.watcher = self.connect()  # the plan relays' (one wait for them all)
        self.node_stores = [self.connect() for _ in range(self.spec.node_threads)]
        self.plans = {k: NodePlans(self._shm(k) / "plans") for k in self.node_wids}
        self.tallies = {k: NodeTally(self._shm(k) / "tally") for k in self.node_wids}
        # one thread beats for every node here (a thread a node: 1,024 threads a process
        # at 16,384 members, switching more than they beat)
        self.threads = [threading.Thread(target=t, daemon=True)
                        for t in (self._beat, self._watch, self._agents)]
        for t in self.threads:
            t.start()

    def _beat(self) -> None:
        while not self.stop.is_set():
            if not all([hb.beat_once() for hb in self.hb.values()]):
                return
            self.stop.wait(self.spec.heartbeat_s)

    def _watch(self) -> None:
        """Every node's plan relay, then its members' joins: on each plan, each node's
        agent reads it (its change) into the node's shared memory, and each member of the
        plan there finds it and joins (`_node`). The nodes are spread over
        `node_threads` threads, a store connection each, so their requests overlap as a
        job's nodes' do."""
        store = self.watcher
        pool = ThreadPoolExecutor(self.spec.node_threads)
        chunks = [list(self.node_wids)[i::self.spec.node_threads]
                  for i in range(self.spec.node_threads)]
        g = 0
        while not self.stop.is_set():
            try:
                if not kv.wait_for(store, [Keys.plan(g)], self.spec.watch_slice_s):
                    continue
            except kv.StoreGone:
                return
            n = len(chunks)
            plans = list(pool.map(self._nodes, range(n), chunks, [g] * n, [self.known] * n))
            plan = next(p for p in plans if p is not None)
            self.known = plan
            if plan.kind is not PlanKind.RUN:
                return
            self.joined_generations += 1
            g += 1

    def _nodes(self, i: int, nodes: list[int], g: int, known):
        """Thread i: its nodes' relays and joins for plan g. Returns the plan."""
        store = self.node_stores[i]
        plan = None
        for k in nodes:  # the node's relay reads the plan (its change)
            plan = relay_one(store, self.plans[k], g, known, self.memo)
            if plan.kind is not PlanKind.RUN:
                continue
            on_node = sum(1 for r in self._ranks_on(plan, k))
            for w in self.node_wids[k]:
                r = plan.rank_of(w)
                if w not in self.dead and r is not None and self.plans[k].has(g):
                    share = NodeShare(self.tallies[k], k, on_node)
                    self._join(store, plan, r, share)
                    share.close()
        return plan

    def _ranks_on(self, plan, k: int) -> list[int]:
        """The ranks of `plan` on node k (the plan's index, built once a plan)."""
        idx = self.memo.get(("nodes", plan.generation))
        if idx is None:
            idx = {}
            for r, n in plan.nodes.items():
                idx.setdefault(n, []).append(r)
            self.memo[("nodes", plan.generation)] = idx
        return idx.get(k, [])

    def _join(self, store, plan, rank: int, node: NodeShare) -> None:
        g = plan.generation
        step = STEPS_PER_GENERATION * (g + 1)
        if g > 0:
            protocol.joined(store, plan, rank, "peer" if rank in plan.replaced else "local",
                            node)
            if rank == 0:
                kv.set_json(store, Keys.recovered(g), {"gen": g, "recover_s": 0.0,
                                                       "lost_steps": 0, "restore_step": step})
        if rank == 0:
            store.set(Keys.PROGRESS, str(step))
        # its first snapshot: its own copy and one replica, acknowledged with its node's
        acknowledge(store, g, step, 2, 2 * plan.world_size, plan.world_size, node)

    def _agents(self) -> None:
        """Each simulated node's agent, every tick: its liveness and, once a heartbeat
        period, its fence checks (the job's last plan is its relay's)."""
        store = self.connect()
        timeouts = Timeouts(heartbeat_interval_s=self.spec.heartbeat_s,
                            heartbeat_timeout_s=self.spec.heartbeat_timeout_s)
        hearts = {k: NodeLiveness(k, self._shm(k), timeouts) for k in self.node_wids}
        seen = dict.fromkeys(self.node_wids, 0)
        while not self.stop.is_set():
            for k, ws in self.node_wids.items():
                hearts[k].tick(store, [w for w in ws if w not in self.exited])
                if hearts[k].due:  # (as `Agent._liveness`)
                    _, seen[k] = protocol.fenced(store, k, [w for w in ws if w not in self.dead],
                                                 seen[k])
            self.agent_ticks += 1
            self.stop.wait(self.spec.tick_s)

    def kill(self, wid: str, how: str) -> None:
        """`exit`: the process died, its agent reports it; `hang`: it stops beating."""
        self.dead.add(wid)
        for hb in self.hb.values():
            hb.silence(wid)
        if how == "exit":
            self.exited.add(wid)
            protocol.file_report(self.main, {"kind": ReportKind.EXIT, "wid": wid,
                                             "detail": "killed by SIGKILL", "rc": -9})

    def handle(self, msg: dict) -> dict:
        if msg["cmd"] == "kill":
            self.kill(msg["wid"], msg["how"])
        if msg["cmd"] == "stop":
            self.stop.set()
            for t in self.threads:  # (exiting under a thread inside a store wait aborts)
                t.join(self.spec.watch_slice_s + 1)
            for hb in self.hb.values():
                hb.stop()
            shutil.rmtree(self.shm, ignore_errors=True)
        protocol_stores = [self.main, self.watcher, *self.node_stores]
        return {**total(self.stores), "protocol": total(protocol_stores),
                "member_ops": total([self.main, *self.node_stores])["ops"],
                "generation": self.known.generation if self.known is not None else -1,
                "cpu_s": time.process_time(), "beats": sum(hb.beats for hb in self.hb.values()),
                "agent_ticks": self.agent_ticks, "members": len(self.wids)}


def hollow_main(conn, spec: dict) -> None:
    proc = HollowProcess(HollowSpec(**spec))
    proc.start()
    conn.send(json.dumps({"ready": True}))
    _answer(conn, proc.handle)

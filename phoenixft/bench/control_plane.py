"""`phoenixft bench control-plane`: the job store, the leader and the member protocol with
thousands of members, on one machine.

For each N in --members: one process hosts the store (a c10d TCPStore, as node 0's agent
does), one runs the leader (`cluster/leader.py`, ticking like its agent), and --procs
processes run N hollow members (`bench/hollow.py`: the same store protocol, no tensors,
no process groups) on N / --per-node simulated nodes, each with its hollow agent, plus
one spare a node on as many nodes as there are failures. Then:

- steady state, --steady seconds with nobody failing: store requests per second by
  kind (heartbeats, the leader's polls, the agents' ticks), payload bytes per second,
  the leader's CPU (its thread and its process), the store server's CPU, the leader's
  tick time;
- --failures member deaths, one at a time (its agent reports the exit), and one hang (a
  member stops beating; the leader fences it after the heartbeat timeout): per failure
  the time from the death to the leader seeing it (detect), to the next generation's
  plan (plan), to every member of it having read it (from its node's relay), joined and
  acknowledged its first snapshot through its node, the last node's acknowledgement
  committing it (acked); the store requests and bytes and the leader's CPU it cost.

Figures are fitted against N (log-log least squares): the exponent says how each cost
grows. Processes: 1 store + 1 leader + --procs hollow (each with a heartbeat thread, a
plan watcher and an agents' thread), no torch compute.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan
from phoenixft.config import Timeouts
from phoenixft.observe.goals import Goal, as_dicts, print_goals

GOAL_PER_FAILURE_S = 1.0
GOAL_MEMBERS = 16384
GOAL_START_EXPONENT = 1.1  # start-up bytes grow as N^1 (fitted; 2.0 while every member
# read the whole first plan)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("control-plane", help="the store, leader and member protocol with "
                                             "thousands of hollow members: time, store "
                                             "requests and CPU per failure against N",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, nargs="+", default=[64, 256, 1024, 4096],
                   help="N: active members of each run")
    p.add_argument("--per-node", type=int, default=8, help="members a simulated node")
    p.add_argument("--procs", type=int, default=2, help="hollow member processes")
    p.add_argument("--failures", type=int, default=3, help="member deaths a run (then a hang)")
    p.add_argument("--no-hang", action="store_true", help="skip the hang")
    p.add_argument("--steady", type=float, default=4.0, help="seconds of steady state")
    p.add_argument("--tick", type=float, default=0.02, help="the agents' tick (s)")
    p.add_argument("--heartbeat", type=float, default=Timeouts().heartbeat_interval_s,
                   help="heartbeat interval (s)")
    p.add_argument("--deadline", type=float, default=120.0,
                   help="seconds a failure may take before the run is called stuck")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/control-plane.json")
    p.set_defaults(func=command(measure, show))


class Cluster:
    """The processes of one run, and the questions the benchmark asks them."""

    def __init__(self, n: int, args: argparse.Namespace, run_dir: Path) -> None:
        # (the store's modules import torch: here, not when `phoenixft`'s command line is
        # built, so its help and a refused `phoenixft run` answer at once)
        from phoenixft.bench.hollow import hollow_main, leader_main, store_main
        from phoenixft.cluster import store as kv

        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: dict[str, object] = {}
        self.nodes = math.ceil(n / args.per_node)
        if n % args.per_node:
            raise SystemExit(f"phoenixft bench control-plane: {n} members is not a multiple of "
                             f"--per-node {args.per_node}")
        spares = args.failures + (0 if args.no_hang else 1)
        if spares > self.nodes:
            raise SystemExit("phoenixft bench control-plane: more failures than nodes")
        port = json.loads(self._spawn("store", store_main).recv())["port"]
        self.addr = f"127.0.0.1:{port}"
        timeouts = {"heartbeat_interval_s": args.heartbeat,
                    "heartbeat_timeout_s": Timeouts().heartbeat_timeout_s,
                    "startup_timeout_s": 600.0}
        run_dir.mkdir(parents=True, exist_ok=True)
        self._spawn("leader", leader_main, self.addr, str(run_dir), self.nodes, args.tick, timeouts)
        per = math.ceil(self.nodes / args.procs)
        self.owner: dict[str, str] = {}
        for i in range(args.procs):
            first, count = i * per, min(per, self.nodes - i * per)
            if count <= 0:
                break
            name = f"hollow{i}"
            spec = dict(addr=self.addr, first_node=first, nodes=count, per_node=args.per_node,
                        spares=max(0, min(count, spares - first)), tick_s=args.tick,
                        heartbeat_s=args.heartbeat,
                        heartbeat_timeout_s=timeouts["heartbeat_timeout_s"])
            self._spawn(name, hollow_main, spec)
            for k in range(first, first + count):
                for j in range(args.per_node + 1):
                    self.owner[f"n{k}w{j}"] = name
        for name in self.conns:
            if name.startswith("hollow"):
                json.loads(self.conns[name].recv())  # ready: its members are registered
        self.store = kv.connect(self.addr, timeout_s=600)  # the benchmark's own (uncounted)

    def _spawn(self, name: str, target, *args):
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=target, args=(theirs, *args), daemon=True, name=name)
        p.start()
        self.procs.append(p)
        self.conns[name] = mine
        return mine

    def ask(self, name: str, **msg) -> dict:
        self.conns[name].send(json.dumps(msg))
        return json.loads(self.conns[name].recv())

    def counts(self) -> dict:
        """Every process's counters now, summed where they add up."""
        each = {name: self.ask(name, cmd="counts") for name in self.conns}
        hollow = [v for k, v in each.items() if k.startswith("hollow")]
        return {"t": time.monotonic(),
                "requests": sum(v.get("requests", 0) for v in each.values()),
                "bytes": sum(v.get("bytes", 0) for v in each.values()),
                "by_role": {"leader": each["leader"].get("ops", {}),
                            "members": _sum_ops(v["ops"] for v in hollow)},
                "beats": sum(v["beats"] for v in hollow),
                "protocol_requests": sum(v["protocol"]["requests"] for v in hollow),
                "member_ops": _sum_ops(v["member_ops"] for v in hollow),
                "protocol_bytes": sum(v["protocol"]["bytes"] for v in hollow),
                "agent_ticks": statistics.fmean(v["agent_ticks"] for v in hollow),
                "leader_cpu_s": each["leader"]["leader_cpu_s"],
                "leader_proc_cpu_s": each["leader"]["cpu_s"],
                "store_cpu_s": each["store"]["cpu_s"],
                "members_cpu_s": sum(v["cpu_s"] for v in hollow),
                "ticks": each["leader"]["ticks"], "fatal": each["leader"]["fatal"]}

    def settled(self, g: int, deadline_s: float) -> dict:
        """The counters once every hollow process has handled generation g (its spares
        read the plan after the members it holds may have committed)."""
        deadline = time.monotonic() + deadline_s
        while True:
            gens = [self.ask(n, cmd="counts")["generation"] for n in self.conns
                    if n.startswith("hollow")]
            if min(gens) >= g:
                return self.counts()
            if time.monotonic() > deadline:
                raise TimeoutError(f"hollow processes at generations {gens}, not {g}")
            time.sleep(0.01)  # a state (each process's generation), polled

    def wait(self, keys: list[str], deadline_s: float) -> float:
        """Wall time once every key is set (the benchmark's own connection)."""
        from phoenixft.cluster import store as kv

        if not kv.wait_for(self.store, keys, deadline_s):
            raise TimeoutError(f"{len(keys)} keys (first {keys[0]}) not set in {deadline_s:.0f}s")
        return time.time()

    def close(self) -> None:
        for name in reversed(list(self.conns)):  # the store last
            try:
                self.ask(name, cmd="stop")
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _sum_ops(ops_list) -> dict:
    out: dict = {}
    for ops in ops_list:
        for k, v in ops.items():
            out[k] = out.get(k, 0) + v
    return out


def _delta(a: dict, b: dict) -> dict:
    return {"wall_s": b["t"] - a["t"], "requests": b["requests"] - a["requests"],
            "bytes": b["bytes"] - a["bytes"],
            "leader_requests": sum(b["by_role"]["leader"].values())
            - sum(a["by_role"]["leader"].values()),
            "member_requests": sum(b["by_role"]["members"].values())
            - sum(a["by_role"]["members"].values()),
            "protocol_requests": b["protocol_requests"] - a["protocol_requests"],
            "member_ops": {k: v - a["member_ops"].get(k, 0) for k, v in b["member_ops"].items()
                           if v != a["member_ops"].get(k, 0)},
            "protocol_bytes": b["protocol_bytes"] - a["protocol_bytes"],
            "beats": b["beats"] - a["beats"], "agent_ticks": b["agent_ticks"] - a["agent_ticks"],
            "leader_cpu_s": b["leader_cpu_s"] - a["leader_cpu_s"],
            "leader_proc_cpu_s": b["leader_proc_cpu_s"] - a["leader_proc_cpu_s"],
            "store_cpu_s": b["store_cpu_s"] - a["store_cpu_s"],
            "members_cpu_s": b["members_cpu_s"] - a["members_cpu_s"]}


def _plan(store, g: int) -> Plan:
    return Plan.from_json(store.get(Keys.plan(g)))


def _fail(c: Cluster, g: int, wid: str, how: str, deadline_s: float) -> dict:
    """Kill `wid` (generation g running) and time the recovery into g + 1."""
    from phoenixft.bench.hollow import STEPS_PER_GENERATION
    from phoenixft.cluster import protocol

    before = c.counts()
    c.ask(c.owner[wid], cmd="kill", wid=wid, how=how)
    c.wait([Keys.plan(g + 1)], deadline_s)
    plan = _plan(c.store, g + 1)
    if plan.kind.value != "run":
        raise RuntimeError(f"generation {g + 1} is {plan.kind}: {plan.reason}")
    # the nodes whose restore sources are read (the replaced rank's, rank 0's) recorded
    # them, and every node acknowledged its members' first snapshot: the last of those
    # acknowledgements committed it
    recorded = [k for k in sorted(set(plan.nodes.values())) if protocol.sources_read(plan, k)]
    c.wait([Keys.sources(g + 1, k) for k in recorded], deadline_s)
    step = STEPS_PER_GENERATION * (g + 2)
    c.wait([Keys.commit(step)], deadline_s)
    t_commit = json.loads(c.store.get(Keys.commit(step)))["t"]
    after = c.settled(g + 1, deadline_s)
    t_plan = _published(c, g + 1)
    d = _delta(before, after)
    return {"how": how, "wid": wid, "world_size": plan.world_size,
            # (t_fail is the hollow agent's clock, t_detect the leader's: two processes,
            # whose readings came out 54 us the wrong way round once in CI)
            "detect_s": max(0.0, plan.t_detect - plan.t_fail), "plan_s": t_plan - plan.t_detect,
            "acked_s": t_commit - t_plan, "source_nodes": len(recorded),
            "control_s": t_commit - plan.t_detect, "total_s": t_commit - plan.t_fail,
            "requests": d["requests"], "bytes": d["bytes"],
            "leader_requests": d["leader_requests"], "member_requests": d["member_requests"],
            "protocol_requests": d["protocol_requests"], "protocol_bytes": d["protocol_bytes"],
            "member_ops": d["member_ops"],
            "leader_cpu_s": d["leader_cpu_s"], "store_cpu_s": d["store_cpu_s"],
            "members_cpu_s": d["members_cpu_s"],
            "plan_bytes": len(c.store.get(Keys.plan(g + 1)))}


def _published(c: Cluster, g: int) -> float:
    """When the leader published generation g (its `generation` event)."""
    for line in (c.run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "generation" and e["gen"] == g:
            return e["t"]
    raise RuntimeError(f"the leader logged no generation {g}")


def run_one(n: int, args: argparse.Namespace, root: Path) -> dict:
    from phoenixft.bench.hollow import STEPS_PER_GENERATION

    rng = random.Random(args.seed + n)
    t0 = time.time()
    shutil.rmtree(root / f"n{n}", ignore_errors=True)  # (its events.jsonl is read back)
    c = Cluster(n, args, root / f"n{n}")
    c.run_dir = root / f"n{n}"
    try:
        c.wait([Keys.plan(0)], args.deadline)
        start_s = time.time() - t0
        c.wait([Keys.commit(STEPS_PER_GENERATION)], args.deadline)
        a = c.counts()  # (from each process's start: registration, plan 0 read, first commit)
        start = {"start_s": round(time.time() - t0, 3), "start_requests": a["requests"],
                 "start_bytes": a["bytes"]}
        time.sleep(args.steady)  # steady state: nothing to wait for, by design
        b = c.counts()
        d = _delta(a, b)
        w = d["wall_s"]
        ticks = b["ticks"]
        steady = {"requests_s": d["requests"] / w, "bytes_s": d["bytes"] / w,
                  "leader_requests_s": d["leader_requests"] / w,
                  "member_requests_s": d["member_requests"] / w,
                  "heartbeats_s": d["beats"] / w,
                  "heartbeats_due_s": n / args.heartbeat,
                  "agent_ticks_s": d["agent_ticks"] / w, "agent_ticks_due_s": 1 / args.tick,
                  "leader_cpu": d["leader_cpu_s"] / w, "leader_proc_cpu": d["leader_proc_cpu_s"] / w,
                  "store_cpu": d["store_cpu_s"] / w, "members_cpu": d["members_cpu_s"] / w,
                  "tick_ms_p50": statistics.median(ticks) * 1e3 if ticks else None,
                  "tick_ms_p99": _p(ticks, 0.99) * 1e3 if ticks else None}
        failures = []
        g = 0
        hows = ["exit"] * args.failures + ([] if args.no_hang else ["hang"])
        for how in hows:
            plan = _plan(c.store, g)
            r = rng.randrange(plan.world_size)
            print(f"[control-plane] N={n}: {how} of rank {r} ({plan.members[r]}), gen {g}",
                  flush=True)
            failures.append(_fail(c, g, plan.members[r], how, args.deadline))
            g += 1
        return {"members": n, "nodes": c.nodes, "plan0_s": round(start_s, 3), **start,
                "steady": steady, "failures": failures, "wall_s": round(time.time() - t0, 1)}
    finally:
        c.close()


def _p(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def fit(ns: list[int], ys: list[float]) -> float | None:
    """The exponent b of y = a N^b, least squares on logs (None: too few positive points)."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if y and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _mean(rows: list[dict], key: str) -> float | None:
    return statistics.fmean(r[key] for r in rows) if rows else None


def summarize(runs: list[dict]) -> dict:
    rows = []
    for r in runs:
        exits = [f for f in r["failures"] if f["how"] == "exit"]
        hang = next((f for f in r["failures"] if f["how"] == "hang"), None)
        rows.append({"members": r["members"], "nodes": r["nodes"], "start_s": r["start_s"],
                     "start_requests": r["start_requests"], "start_bytes": r["start_bytes"],
                     **{k: _mean(exits, k) for k in ("detect_s", "plan_s", "acked_s",
                                             "control_s", "total_s", "requests", "bytes",
                                             "leader_requests", "member_requests",
                                             "leader_cpu_s", "store_cpu_s", "plan_bytes",
                                             "protocol_requests", "protocol_bytes")},
                     "hang_detect_s": hang["detect_s"] if hang else None,
                     "hang_total_s": hang["total_s"] if hang else None,
                     **{f"steady_{k}": v for k, v in r["steady"].items()}})
    ns = [r["members"] for r in rows]
    keys = ("start_s", "start_bytes", "control_s", "total_s", "requests", "bytes",
            "protocol_requests",
            "protocol_bytes", "leader_cpu_s", "store_cpu_s",
            "steady_requests_s", "steady_bytes_s", "steady_leader_cpu", "steady_store_cpu")
    exponents = {k: fit(ns, [r[k] for r in rows]) for k in keys}
    return {"rows": rows, "exponents": exponents, "runs": runs}


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    if not all(n > 0 for n in args.members) or args.procs < 1 or args.failures < 0:
        raise SystemExit("phoenixft bench control-plane: --members > 0, --procs >= 1, "
                         "--failures >= 0")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store waits time out by design
    root, t0 = opts.runs_dir("control-plane"), time.time()
    runs, stuck = [], []
    for n in args.members:
        print(f"[control-plane] N={n}", flush=True)
        try:
            runs.append(run_one(n, args, root))
        except (TimeoutError, RuntimeError) as exc:  # reported, and the larger N skipped
            print(f"[control-plane] N={n} stopped: {exc}", flush=True)
            stuck.append({"members": n, "error": str(exc)})
            break
    if not runs:
        raise SystemExit(f"phoenixft bench control-plane: no run completed: {stuck}")
    summary = summarize(runs)
    return {**summary, "stuck": stuck, "per_node": args.per_node, "procs": args.procs,
            "heartbeat_s": args.heartbeat, "tick_s": args.tick,
            "wall_s": round(time.time() - t0, 1), "goals": as_dicts(goals_of(summary["rows"]))}


def goals_of(rows: list[dict]) -> list[Goal]:
    big = [r for r in rows if r["members"] >= GOAL_MEMBERS]
    if not big:
        return []
    r = big[0]
    e = fit([x["members"] for x in rows], [x["start_bytes"] for x in rows])
    return [Goal(f"control plane per failure (plan, every member acked, commit) at "
                 f"{r['members']} members", f"<= {GOAL_PER_FAILURE_S:g} s",
                 f"{r['control_s']:.3f} s", r["control_s"] <= GOAL_PER_FAILURE_S),
            Goal("start-up bytes against N (fitted exponent)", f"<= {GOAL_START_EXPONENT:g}",
                 _e(e), e is not None and e <= GOAL_START_EXPONENT)]


def goals(result: dict) -> list[Goal]:
    return goals_of(result["rows"])


def headline(result: dict) -> str:
    rows = result["rows"]
    r = next((x for x in rows if x["members"] == GOAL_MEMBERS), rows[-1])
    big = rows[-1]
    e = result["exponents"]
    more = (f"; {big['members']} members: {big['control_s']:.2f} s" if big is not r else "")
    return (f"{r['members']} members: {r['control_s']:.3f} s a failure from detection to "
            f"commit, {r['protocol_requests']:.0f} member requests, "
            f"{r['protocol_bytes'] / 1e6:.1f} MB{more}; control time grows as "
            f"N^{_e(e['control_s'])}, member bytes as N^{_e(e['protocol_bytes'])}")


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    cols = ["members", "start s", "start MB", "detect s", "plan s", "acked s", "control s",
            "member requests", "member MB", "all requests", "leader CPU s", "store CPU s", "hang detect s",
            "steady req/s", "steady leader CPU", "steady store CPU", "tick ms p50/p99"]
    rows = []
    for r in result["rows"]:
        rows.append([str(r["members"]), f"{r['start_s']:.1f}",
                     f"{r['start_bytes'] / 1e6:.1f}", f"{r['detect_s']:.3f}", f"{r['plan_s']:.3f}",
                     f"{r['acked_s']:.3f}", f"{r['control_s']:.3f}",
                     f"{r['protocol_requests']:.0f}", f"{r['protocol_bytes'] / 1e6:.2f}",
                     f"{r['requests']:.0f}",
                     f"{r['leader_cpu_s']:.3f}", f"{r['store_cpu_s']:.3f}",
                     "-" if r["hang_detect_s"] is None else f"{r['hang_detect_s']:.2f}",
                     f"{r['steady_requests_s']:.0f}", f"{r['steady_leader_cpu']:.1%}",
                     f"{r['steady_store_cpu']:.1%}",
                     f"{r['steady_tick_ms_p50']:.1f}/{r['steady_tick_ms_p99']:.1f}"])
    e = result["exponents"]
    rows.append(["exponent", _e(e["start_s"]), _e(e["start_bytes"]), "", "", "",
                 _e(e["control_s"]), _e(e["protocol_requests"]),
                 _e(e["protocol_bytes"]), _e(e["requests"]), _e(e["leader_cpu_s"]), _e(e["store_cpu_s"]), "",
                 _e(e["steady_requests_s"]), _e(e["steady_leader_cpu"]),
                 _e(e["steady_store_cpu"]), ""])
    return cols, rows


def show(result: dict, opts: BenchOptions) -> None:
    cols, rows = _table_rows(result)
    table = Table(title=f"control plane: 1 store + 1 leader + {result['procs']} hollow-member "
                        f"processes, {result['per_node']} members a node, heartbeat "
                        f"{result['heartbeat_s']} s, tick {result['tick_s']} s; per failure "
                        "(mean of the exits)")
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*r)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for s in result.get("stuck", []):
        console.print(f"N={s['members']} did not complete: {s['error']}")
    print_goals(console, goals(result))


def markdown(result: dict) -> list[str]:
    cols, rows = _table_rows(result)
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(r) + " |" for r in rows]
            + [f"\nN={s['members']} did not complete: {s['error']}"
               for s in result.get("stuck", [])])

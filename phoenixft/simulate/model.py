"""`phoenixft simulate`: what failures cost a job of N GPUs, for four strategies.

A discrete-event model. Failures arrive as a Poisson process at the job's rate (per-GPU
rate x N, from published data, see RATES), each one of a kind (GPU, host, network) drawn
from the given mix; each takes one node out of the job until it is repaired. Whole-job
outages (power, storage, the scheduler) arrive on their own, at `outage_per_day`
whatever the job's size. Strategies:

- restart:  checkpoint-and-restart. A checkpoint every tau seconds (Young/Daly optimum
            tau = sqrt(2 x checkpoint cost x MTBF)), each stalling training for the
            checkpoint cost; a failure loses the work since the last checkpoint plus the
            restart cost.
- spares:   phoenixft. A failure costs detect + recover + lost steps (measured); a failed
            node is replaced by a warm spare node while the pool lasts (pool refilled as
            nodes come back from repair); with no spare left the job shrinks (ReCoVer: same
            microbatches, throughput x survivors / N) until a repaired node rejoins.
            Snapshots cost their measured overhead on every step. A whole-job outage
            restarts from scratch (no persistent tier).
- recover:  ReCoVer alone (no spares): every failed node shrinks the job until repaired.
- tiers:    phoenixft + persistent tiers: as spares, but a whole-job outage resumes from
            the newest persisted step (lost: about half the persist interval).

Effective throughput = useful GPU-seconds / (wall time x GPUs provisioned); spares count
as provisioned. Inputs for phoenixft are the measured figures (from `bench recovery` and
`bench overhead` JSON when given); everything else is a parameter.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from phoenixft.observe.steps import StepEvent, step_pairs

HOUR = 3600.0
# per-GPU failure rates (failures per GPU-hour), from published data
RATES = {
    # Llama 3 pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s
    "llama3": 419 / (54 * 24 * 16384),
    # Meta's research clusters: ~6.5 failures per 1,000 node-days (8 GPUs per node)
    "rsc": 6.5 / (1000 * 24 * 8),
    # the projection the issue cites: MTTF 7.9 h at 1,024 GPUs (-> ~14 min at 131k)
    "projected": 1 / (7.9 * 1024),
}
# Llama 3's mix: 58.7% GPU related; the rest host (memory, host, software) and network
MIX = {"gpu": 0.587, "host": 0.373, "network": 0.04}


@dataclass(frozen=True)
class Costs:
    step_s: float = 10.0  # one optimizer step of the job
    detect_s: float = 0.1  # phoenixft: failure -> noticed
    recover_s: float = 0.5  # phoenixft: new membership, state moved, groups built
    lost_steps: float = 1.0  # phoenixft: steps redone per failure (at most one)
    snapshot_overhead: float = 0.01  # phoenixft: share of every step
    restart_s: float = 600.0  # checkpoint-and-restart: relaunch, load, rendezvous
    ckpt_s: float = 60.0  # checkpoint-and-restart: training stall per checkpoint
    persist_every_s: float = 600.0  # tiers: a persisted base/delta this often
    repair_h: float = 4.0  # a failed node comes back (or is replaced) after this
    gpus_per_node: int = 8
    spare_frac: float = 0.005  # warm spare nodes as a share of the job's nodes (>= 1)
    outage_per_day: float = 1 / 14  # whole-job outages, whatever the size


@dataclass
class Outcome:
    strategy: str
    gpus: int
    mtbf_min: float
    effective: float  # useful work / (wall x provisioned), failure-free = 1.0
    failures: int


def _events(rate_per_s: float, outage_per_s: float, horizon_s: float,
            rng: random.Random) -> list[tuple[float, str]]:
    out, t = [], 0.0
    kinds, weights = list(MIX), list(MIX.values())
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= horizon_s:
            break
        out.append((t, rng.choices(kinds, weights)[0]))
    t = 0.0
    while outage_per_s > 0:
        t += rng.expovariate(outage_per_s)
        if t >= horizon_s:
            break
        out.append((t, "outage"))
    return sorted(out)


def young_daly(ckpt_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * ckpt_s * mtbf_s)


def simulate(strategy: str, gpus: int, per_gpu_hour: float, costs: Costs, *,
             horizon_h: float = 72.0, seed: int = 0) -> Outcome:
    """One run of `horizon_h` hours of wall time; returns effective throughput."""
    rng = random.Random(seed)
    rate = per_gpu_hour * gpus / HOUR
    events = _events(rate, costs.outage_per_day / (24 * HOUR), horizon_h * HOUR, rng)
    horizon = horizon_h * HOUR
    c = costs
    if strategy == "restart":
        tau = young_daly(c.ckpt_s, 1 / rate)
        cycle = tau + c.ckpt_s  # work, then the checkpoint's stall
        work, t = 0.0, 0.0
        for tf, kind in events + [(horizon, "end")]:
            span = max(0.0, tf - t)
            full = math.floor(span / cycle)
            if kind == "end":
                work += full * tau + min(tau, span - full * cycle)
                break
            work += full * tau  # what was not checkpointed is lost
            t = max(t, tf) + c.restart_s
        return Outcome(strategy, gpus, 1 / rate / 60, work / horizon, len(events))
    nodes = gpus // c.gpus_per_node
    spares = max(1, math.ceil(c.spare_frac * nodes)) if strategy in ("spares", "tiers") else 0
    provisioned = gpus + spares * c.gpus_per_node
    per_fail = c.detect_s + c.recover_s + c.lost_steps * c.step_s
    speed = 1.0 - (c.snapshot_overhead if strategy != "recover" else 0.0)
    repairs: list[float] = []  # times a failed node comes back
    pool, down = spares, 0  # spare nodes ready, nodes missing from the job
    work, t = 0.0, 0.0
    for (tf, kind) in events + [(horizon, "end")]:
        # advance to tf, handling repairs in between
        for r in sorted(x for x in repairs if x <= tf):
            work += (r - t) * speed * (nodes - down) / nodes
            t = r
            repairs.remove(r)
            if down:
                down -= 1  # the repaired node rejoins the job (grow back)
            else:
                pool += 1
        work += (tf - t) * speed * (nodes - down) / nodes
        t = tf
        if kind == "end":
            break
        if kind == "outage":  # a whole-job outage
            if strategy == "tiers":
                work -= min(work, c.persist_every_s / 2)
                t += c.restart_s
            else:
                work = 0.0  # no persistent state: start over
                t += c.restart_s
            continue
        work -= per_fail * (nodes - down) / nodes  # the stall and the step redone
        repairs.append(tf + c.repair_h * HOUR)
        if pool:
            pool -= 1
        else:
            down = min(nodes - 1, down + 1)
    work = max(0.0, work)
    return Outcome(strategy, gpus, 1 / rate / 60, work * gpus / (horizon * provisioned),
                   len(events))


def mean_effective(strategy: str, gpus: int, rate: float, costs: Costs, runs: int,
                   horizon_h: float) -> Outcome:
    outs = [simulate(strategy, gpus, rate, costs, horizon_h=horizon_h, seed=s)
            for s in range(runs)]
    o = outs[0]
    return Outcome(strategy, gpus, o.mtbf_min, sum(x.effective for x in outs) / runs,
                   round(sum(x.failures for x in outs) / runs))


def measured_costs(recovery_json: str | None, overhead_json: str | None, base: Costs) -> Costs:
    """Our measured recovery figures and snapshot overhead, where given."""
    c = base
    if recovery_json and Path(recovery_json).is_file():
        rows = [r for r in json.loads(Path(recovery_json).read_text())["rows"]
                if r["fault"].startswith("kill")]
        if rows:
            c = replace(c, detect_s=max(r["detect_s"] for r in rows),
                        recover_s=max(r["recover_s"] for r in rows),
                        lost_steps=max(r["lost_steps"] for r in rows))
    if overhead_json and Path(overhead_json).is_file():
        ov = json.loads(Path(overhead_json).read_text())
        # step time with snapshots over without: the on/off blocks inside one run (same
        # processes, same load) when measured; across separate runs the noise is larger
        # than the effect (0.97-1.04 here), and a ratio below 1 would count as free
        ratio = (ov.get("in_run") or {}).get("ratio", ov.get("ratio"))
        if ratio is not None:
            c = replace(c, snapshot_overhead=max(0.0, ratio - 1.0))
    return c


STRATEGIES = ("restart", "spares", "recover", "tiers")


def _replay(kills_s: list[float], steps: int, step_s: float, cost, slow) -> float:
    """Wall time of `steps` steps at `step_s` each, with a fault at each time in `kills_s`
    (seconds after the first step) costing `cost(steps_done)` seconds, after which steps
    take `slow(faults so far)` x longer."""
    t = done = 0.0
    for k, tk in enumerate(sorted(kills_s)):
        if tk <= t:
            tk = t
        done += (tk - t) / (step_s * slow(k))
        if done >= steps:
            break
        t = tk + cost(done)
    return t + max(0.0, steps - done) * step_s * slow(len(kills_s))


def _step_gaps(row: dict, before: float = float("inf")) -> dict[int, list[float]]:
    """The run's gaps between consecutive steps of one epoch and world size, by world
    size, for steps ending before `before` (seconds after launch)."""
    gaps: dict[int, list[float]] = {}
    steps = [StepEvent(t, step, epoch, world) for t, step, world, epoch in row.get("progress", [])]
    for a, b in step_pairs(steps, before=before):
        gaps.setdefault(b.world_size, []).append(b.t - a.t)
    return gaps


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _base_step_s(row: dict) -> float:
    """The run's own failure-free step time: the median gap between consecutive steps
    before its first fault (the machine's speed during that run, an input)."""
    first_kill = min((k["t_rel"] for k in row.get("kills", [])), default=float("inf"))
    gaps = [g for gs in _step_gaps(row, first_kill).values() for g in gs]
    if not gaps:
        return row.get("median_step_s") or 1 / row["eff_steps_s"]
    return _median(gaps)


def _slowdown(mode: str, row: dict, n: int, cores: int,
              step_s: float) -> Callable[[int], float]:
    """How much longer than `step_s` a step takes after k faults. Only a shrink changes
    it: at the speed the run measured at each world size (on a machine with fewer cores
    than workers a shrunk job's steps are not slower in proportion to its survivors:
    4 workers on 2 cores ran as fast after losing two), or, where fewer than 3 steps ran
    at a size, throughput following min(workers, cores)."""
    if mode != "shrink":
        return lambda k: 1.0
    by_world = {w: _median(g) for w, g in _step_gaps(row).items() if len(g) >= 3}
    return lambda k: (by_world[n - k] / step_s if n - k in by_world
                      else min(n, cores) / max(1, min(n - k, cores)))


def _fault_cost(mode: str, goodput: dict, row: dict, rec: list[dict], step_s: float):
    """Seconds one fault costs, as a function of the steps done (for lost work)."""
    if mode in ("spares", "shrink"):
        per = sum(r["detect_s"] + r["recover_s"] for r in rec) / len(rec)
        lost = 0.0 if mode == "shrink" else sum(r["lost_steps"] for r in rec) / len(rec)
        return lambda done: per + lost * step_s
    restarts = [x - step_s for x in row.get("kill_to_next_step_s", [])]
    restart_s = sum(restarts) / len(restarts) if restarts else 0.0
    every = goodput.get("ckpt_every") or 1
    return lambda done: restart_s + (done % every) * step_s


def validate(goodput: dict, recovery: dict | None) -> list[dict]:
    """Predict each faulted mode's goodput ratio (its effective steps/s over the
    failure-free run's) from: the run's own step time before its first fault, the fault
    schedule, phoenixft's per-fault cost from `bench recovery` (detect + recover + lost
    steps: a separate run), torchrun's restart time (the run's kill-to-next-step less a
    step: no other benchmark measures it) and work lost since its last checkpoint, and the
    machine's speed after a shrink (`_slowdown`)."""
    modes, n = goodput["modes"], goodput["nproc"]
    clean_eff = modes["clean"]["eff_steps_s"]
    cores = goodput.get("cpu_count") or 1
    rec = [r for r in (recovery or {}).get("rows", []) if r["fault"].startswith("kill")]
    rec = [r for r in rec if r["nproc"] == n] or rec
    out = []
    for mode in ("spares", "shrink", "restart"):
        row = modes.get(mode)
        if not row or not row.get("completed") or not row.get("kills"):
            continue
        if mode != "restart" and not rec:
            continue
        step_s = _base_step_s(row)
        first = row["first_step_after_launch_s"]
        kills = [k["t_rel"] - first for k in row["kills"]]
        steps = row["final_step"] - 1
        cost = _fault_cost(mode, goodput, row, rec, step_s)
        wall = _replay(kills, steps, step_s, cost, _slowdown(mode, row, n, cores, step_s))
        predicted = (steps / wall) / clean_eff
        measured = row["eff_steps_s"] / clean_eff
        out.append({"mode": mode, "predicted_ratio": round(predicted, 4),
                    "measured_ratio": round(measured, 4), "predicted_wall_s": round(wall, 3),
                    "measured_wall_s": round(row["wall_s"], 3),
                    "error": round(abs(predicted - measured) / measured, 4)})
    return out


def projection(costs: Costs, sizes: list[int], rates: dict[str, float], runs: int,
               horizon_h: float) -> list[dict]:
    rows = []
    for name, rate in rates.items():
        for n in sizes:
            outs = {s: mean_effective(s, n, rate, costs, runs, horizon_h) for s in STRATEGIES}
            restart = outs["restart"].effective
            rows.append({"rate": name, "gpus": n, "mtbf_min": round(outs["spares"].mtbf_min, 2),
                         **{s: round(o.effective, 4) for s, o in outs.items()},
                         "tiers_vs_restart": (round(outs["tiers"].effective / restart, 2)
                                              if restart > 0 else None)})
    return rows


def crossover(costs: Costs, gpus: int, target: float, runs: int, horizon_h: float) -> dict:
    """The per-GPU failure rate at which ReCoVer's effective throughput is `target` x that
    of checkpoint-and-restart (bisection on the rate's logarithm)."""
    lo, hi = math.log(1e-7), math.log(1e-2)

    def ratio(lr: float) -> float:
        r = math.exp(lr)
        a = mean_effective("recover", gpus, r, costs, runs, horizon_h).effective
        b = mean_effective("restart", gpus, r, costs, runs, horizon_h).effective
        return a / b if b > 0 else math.inf
    for _ in range(30):
        mid = (lo + hi) / 2
        if ratio(mid) < target:
            lo = mid
        else:
            hi = mid
    rate = math.exp(hi)
    return {"gpus": gpus, "target_ratio": target, "per_gpu_hour": rate,
            "job_mtbf_min": 60 / (rate * gpus)}


def register(sub) -> None:
    p = sub.add_parser("simulate", help="project goodput to 100k+ GPUs under published "
                                        "failure rates: checkpoint-restart, spares, ReCoVer, "
                                        "tiers", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1024,16384,100000,131072",
                   help="comma-separated job sizes")
    p.add_argument("--rates", default="llama3,projected",
                   help=f"failure-rate presets ({', '.join(RATES)}) or per-GPU-hour numbers")
    p.add_argument("--step-s", type=float, default=Costs.step_s)
    p.add_argument("--restart-s", type=float, default=Costs.restart_s,
                   help="checkpoint-and-restart: seconds from a failure to training again")
    p.add_argument("--ckpt-s", type=float, default=Costs.ckpt_s,
                   help="checkpoint-and-restart: training stall per checkpoint")
    p.add_argument("--spare-frac", type=float, default=Costs.spare_frac,
                   help="warm spare nodes as a share of the job's nodes (at least one)")
    p.add_argument("--outage-per-day", type=float, default=Costs.outage_per_day,
                   help="whole-job outages per day (power, storage, scheduler)")
    p.add_argument("--repair-h", type=float, default=Costs.repair_h)
    p.add_argument("--recovery-json", default="runs/bench/recovery.json",
                   help="measured detect/recover/lost steps (phoenixft bench recovery)")
    p.add_argument("--overhead-json", default="runs/bench/overhead.json",
                   help="measured snapshot overhead (phoenixft bench overhead)")
    p.add_argument("--runs", type=int, default=16, help="Monte-Carlo runs per cell")
    p.add_argument("--horizon-h", type=float, default=168.0, help="simulated wall time per run")
    p.add_argument("--validate", default="runs/bench/goodput.json", metavar="GOODPUT_JSON",
                   help="predict this `phoenixft bench goodput` run's ratios and report the "
                        "error (skipped if the file does not exist)")
    p.add_argument("--out", default="runs/bench/simulate.json")
    p.set_defaults(func=cmd_simulate)


def _rates(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        part = part.strip()
        if part in RATES:
            out[part] = RATES[part]
        else:
            try:
                out[part] = float(part)
            except ValueError:
                raise SystemExit(f"phoenixft simulate: unknown rate {part!r}; presets: "
                                 f"{', '.join(RATES)} or a number per GPU-hour") from None
    return out


def cmd_simulate(args) -> int:
    from rich.console import Console
    from rich.table import Table

    base = Costs(step_s=args.step_s, restart_s=args.restart_s, ckpt_s=args.ckpt_s,
                 spare_frac=args.spare_frac, outage_per_day=args.outage_per_day,
                 repair_h=args.repair_h)
    costs = measured_costs(args.recovery_json, args.overhead_json, base)
    sizes = [int(x) for x in args.gpus.split(",")]
    rows = projection(costs, sizes, _rates(args.rates), args.runs, args.horizon_h)
    cross = crossover(costs, 16384, 2.23, args.runs, args.horizon_h)
    table = Table(title="effective throughput (failure-free = 1.00), mean of "
                        f"{args.runs} runs of {args.horizon_h:.0f} h")
    for col in ("rate", "GPUs", "job MTBF", *STRATEGIES, "tiers / restart"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["rate"], f"{r['gpus']:,}", f"{r['mtbf_min']:.1f} min",
                      *(f"{r[s]:.3f}" for s in STRATEGIES),
                      f"{r['tiers_vs_restart']}x" if r["tiers_vs_restart"] else "inf")
    Console().print(table)
    print(f"ReCoVer reaches 2.23x checkpoint-and-restart at 16k GPUs when the job's MTBF is "
          f"{cross['job_mtbf_min']:.1f} min ({cross['per_gpu_hour']:.2e} failures per GPU-hour)")
    checks = []
    if args.validate and Path(args.validate).is_file():
        rec = (json.loads(Path(args.recovery_json).read_text())
               if args.recovery_json and Path(args.recovery_json).is_file() else None)
        checks = validate(json.loads(Path(args.validate).read_text()), rec)
        v = Table(title=f"validation against {args.validate} (goal: error <= 10%)")
        for col in ("mode", "predicted ratio", "measured ratio", "error"):
            v.add_column(col, justify="right")
        for c in checks:
            v.add_row(c["mode"], f"{c['predicted_ratio']:.3f}", f"{c['measured_ratio']:.3f}",
                      f"{100 * c['error']:.1f}%")
        Console().print(v)
    by = {(r["rate"], r["gpus"]): r for r in rows}
    goals = []
    if ("llama3", 16384) in by:
        goals.append({"name": "phoenixft + tiers at 16k GPUs, Llama 3 failure rate",
                      "goal": ">= 0.97", "measured": by["llama3", 16384]["tiers"],
                      "met": by["llama3", 16384]["tiers"] >= 0.97})
    if ("projected", 100000) in by:
        goals.append({"name": "phoenixft + tiers at 100k GPUs, projected failure rate",
                      "goal": ">= 0.9", "measured": by["projected", 100000]["tiers"],
                      "met": by["projected", 100000]["tiers"] >= 0.9})
    for c in checks:
        goals.append({"name": f"simulator predicts the {c['mode']} goodput ratio",
                      "goal": "error <= 10%", "measured": f"{100 * c['error']:.1f}%",
                      "met": c["error"] <= 0.1})
    out = {"benchmark": "simulate", "costs": asdict(costs), "rates": _rates(args.rates),
           "mix": MIX, "rows": rows, "crossover_2_23x": cross, "validation": checks,
           "goals": goals, "runs": args.runs, "horizon_h": args.horizon_h}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0

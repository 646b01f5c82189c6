"""`phoenixft bench overhead`: what per-step snapshots (+ replicas) cost.

Two measurements, both with examples/train_gpt.py and 1 torch thread per worker:

- in one run (the headline): snapshots switched on for K steps and off for the next K,
  again and again, in the same processes under the same load; a step's time counts as
  "on" when the previous step's snapshot was taken (its copy overlaps this step and must
  end before this step's optimizer update). The figure is the paired mean over adjacent
  block pairs, 1 + mean(on - off) / mean(off), with its standard error: step times on a
  shared 2-core machine swing 5-12% from step to step (the CPU time of a step swings as
  much, so CPU time is no quieter), and short blocks, many of them, cancel the drift.
  Beside it, the snapshot thread's own CPU time per snapshot (measured in the thread),
  which on cores already busy with the workers is time taken from them. The default
  configuration runs first, then the same job with `--replicas 1` (a copy on this node).
- across runs: the same job with snapshots on and off, interleaved (on/off, off/on, ...)
  so drift on a shared machine hits both alike; also checks the final state is the same.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import median, run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal
from phoenixft.observe.steps import from_events, step_pairs, step_times


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("overhead", help="step time with snapshots+replicas vs without")
    p.add_argument("--pairs", type=int, default=3, help="interleaved on/off pairs of runs")
    p.add_argument("--steps", type=int, default=40, help="steps of each of those runs")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--block", type=int, default=2, help="K (even): steps per on / off block "
                                                       "in the in-run measurement")
    p.add_argument("--blocks", type=int, default=100, help="on/off block pairs in that run")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model trains (cuda: snapshots copy device-to-host on a "
                        "side stream into page-locked shared memory)")
    p.add_argument("--out", default="runs/bench/overhead.json")
    p.set_defaults(func=command(measure, show))


def _script_args(args: argparse.Namespace, steps: int) -> list[str]:
    return ["--steps", str(steps), "--preset", args.preset, "--device", args.device]


def paired_blocks(events: list[dict], k: int) -> dict:
    """The on/off estimate from a run whose snapshots alternate every `k` steps: per block
    pair, mean on-step minus mean off-step time; the ratio is 1 + their mean over the mean
    off-step time, with its standard error (and, for reading, each pair's own ratio)."""
    on: dict[int, list[float]] = {}
    off: dict[int, list[float]] = {}
    for a, b in step_pairs(from_events(events), skip=k):  # the first block is warm-up
        pair = a.step // (2 * k)
        (on if (a.step // k) % 2 == 0 else off).setdefault(pair, []).append(b.t - a.t)
    pairs = [p for p in sorted(on) if p in off]
    diffs = [statistics.mean(on[p]) - statistics.mean(off[p]) for p in pairs]
    base = statistics.mean([x for p in pairs for x in off[p]]) if pairs else math.nan
    mean = statistics.mean(diffs) if diffs else math.nan
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return {"pairs": len(pairs), "ratio": 1 + mean / base, "se": se / base,
            "pair_ratios": [statistics.mean(on[p]) / statistics.mean(off[p]) for p in pairs],
            "median_step_on_s": median([x for p in pairs for x in on[p]]),
            "median_step_off_s": median([x for p in pairs for x in off[p]])}


def in_run(args: argparse.Namespace, root: Path, replicas: int | None = None) -> dict:
    """One job whose snapshots alternate on/off every `args.block` steps."""
    k, steps = args.block, 2 * args.block * args.blocks + args.block
    name = "in-run" if replicas is None else f"in-run-replicas{replicas}"
    s = run_job(root / name, nproc=args.nproc,
                snapshots={"enabled": True, "blocks": k, "replicas": replicas},
                script_args=_script_args(args, steps))
    return {"steps": steps, "replicas": replicas, **block_figures(s["events"], k)}


def block_figures(events: list[dict], k: int) -> dict:
    """A run whose snapshots alternate on/off every `k` steps: the paired on/off estimate,
    the copies per snapshot, and the snapshot thread's CPU and the training's stall per
    snapshot (also as a share of an off step)."""
    out = {"block": k, **paired_blocks(events, k)}
    stats = [e for e in events if e["event"] == "snapshot_stats"]
    size = next((e for e in events if e["event"] == "snapshot_size"), {})
    n = sum(e["snapshots"] for e in stats)
    out["copies"] = size.get("copies")
    out["thread_cpu_s_per_snapshot"] = (sum(e["thread_cpu_s"] for e in stats) / n) if n else None
    out["stall_s_per_snapshot"] = (sum(e["stall_s"] for e in stats) / n) if n else None
    if out["thread_cpu_s_per_snapshot"] is not None:
        out["thread_cpu_share_of_step"] = out["thread_cpu_s_per_snapshot"] / out["median_step_off_s"]
    return out


def _fmt_in_run(r: dict) -> str:
    return f"{r['ratio']:.4f} ± {r['se']:.4f}"


def _check(args: argparse.Namespace) -> None:
    if args.block < 2 or args.block % 2:
        raise SystemExit(f"phoenixft bench overhead: --block must be even and >= 2, got "
                         f"{args.block} (a snapshot after an odd gap would overwrite the "
                         f"newest committed one)")
    if args.pairs < 1 or args.blocks < 3:
        raise SystemExit(f"phoenixft bench overhead: --pairs must be >= 1 and --blocks >= 3 "
                         f"(the first block pair is warm-up; a standard error needs two more), "
                         f"got {args.pairs} and {args.blocks}")


def _separate_run(args: argparse.Namespace, root: Path, pair: int, snapshots: bool) -> dict:
    """One job with snapshots on or off throughout: its median step and snapshot figures."""
    label = "on" if snapshots else "off"
    s = run_job(root / f"{pair}-{label}", nproc=args.nproc, snapshots={"enabled": snapshots},
                script_args=_script_args(args, args.steps))
    times = step_times(from_events(s["events"]), skip=5)
    size = next((e for e in s["events"] if e["event"] == "snapshot_size"), {})
    stats = [e for e in s["events"] if e["event"] == "snapshot_stats"]
    cpu = (sum(e["thread_cpu_s"] for e in stats) / max(1, sum(e["snapshots"] for e in stats))
           if stats else None)
    print(f"pair {pair} snapshots {label}: median step {median(times) * 1000:.1f} ms")
    return {"pair": pair, "snapshots": snapshots, "median_step_s": median(times),
            "steps_timed": len(times), "digest": s["final_state_digest"],
            "host_bytes_per_rank": size.get("host_bytes_per_rank"),
            "copies": size.get("copies"), "snapshot_thread_cpu_s_per_step": cpu}


def _across_runs(runs: list[dict]) -> dict:
    """Snapshots on against off over the separate runs: medians, their ratio, each pair's."""
    on = [r["median_step_s"] for r in runs if r["snapshots"]]
    off = [r["median_step_s"] for r in runs if not r["snapshots"]]
    pair_ratios = [a["median_step_s"] / b["median_step_s"]
                   for a in runs if a["snapshots"] for b in runs
                   if not b["snapshots"] and b["pair"] == a["pair"]]
    return {"median_step_on_s": median(on), "median_step_off_s": median(off),
            "ratio": median(on) / median(off), "pair_ratios": pair_ratios}


def measure(opts: BenchOptions) -> dict:
    """Separate on/off runs in interleaved pairs, then the in-run on/off blocks, by
    default and with `--replicas 1`."""
    args = opts.own
    _check(args)
    root = opts.runs_dir("overhead")
    t0 = time.time()
    runs = [_separate_run(args, root, i, snapshots)
            for i in range(args.pairs)
            for snapshots in ([True, False] if i % 2 == 0 else [False, True])]
    across = _across_runs(runs)
    inside = in_run(args, root)
    local = in_run(args, root, replicas=1)
    result = {"benchmark": "overhead", "preset": args.preset, "nproc": args.nproc,
              "device": args.device,
              "threads_per_worker": 1, "steps": args.steps, "pairs": args.pairs,
              "median_step_on_s": across["median_step_on_s"],
              "median_step_off_s": across["median_step_off_s"],
              "ratio": across["ratio"], "pair_ratios": across["pair_ratios"], "goal": 1.01,
              "same_final_state": len({r["digest"] for r in runs}) == 1, "runs": runs,
              "in_run": inside, "in_run_local_replica": local,
              "wall_s": time.time() - t0}
    cpus = [r["snapshot_thread_cpu_s_per_step"] for r in runs if r["snapshots"]]
    if cpus and all(c is not None for c in cpus):
        result["snapshot_thread_cpu_s_per_step"] = median(cpus)
    return result


def show(result: dict, opts: BenchOptions) -> None:
    """The in-run lines and the overhead table."""
    console = Console(width=max(Console().width, 130))
    inside, local, runs = result["in_run"], result["in_run_local_replica"], result["runs"]
    for label, r in (("default", inside), ("--replicas 1", local)):
        console.print(f"in one run ({label}, {r['copies']} copies), {r['pairs']} pairs of "
                      f"{r['block']}-step blocks: on/off {_fmt_in_run(r)} (standard error); "
                      f"snapshot thread {r['thread_cpu_s_per_snapshot'] * 1000:.2f} ms CPU per "
                      f"snapshot")
    n_on = sum(1 for r in runs if r["snapshots"])
    table = Table(title=f"snapshot overhead: {result['nproc']} workers x 1 thread, "
                        f"{result['preset']} preset")
    for col in ("", "median step", "runs"):
        table.add_column(col)
    table.add_row("separate runs: snapshots on", f"{result['median_step_on_s'] * 1000:.1f} ms",
                  str(n_on))
    table.add_row("off", f"{result['median_step_off_s'] * 1000:.1f} ms", str(len(runs) - n_on))
    table.add_row("in one run: on/off blocks (goal <= 1.01)", _fmt_in_run(inside),
                  f"{inside['pairs']} pairs of {inside['block']}-step blocks, {inside['copies']} "
                  f"copy per snapshot")
    table.add_row("  snapshot thread CPU per snapshot (goal <= 1% of a step)",
                  f"{inside['thread_cpu_s_per_snapshot'] * 1000:.2f} ms",
                  f"{inside['thread_cpu_share_of_step'] * 100:.2f}% of a step; training "
                  f"stalled {inside['stall_s_per_snapshot'] * 1000:.2f} ms")
    table.add_row("in one run, --replicas 1 (a copy on this node too)", _fmt_in_run(local),
                  f"thread CPU {local['thread_cpu_s_per_snapshot'] * 1000:.2f} ms per snapshot "
                  f"({local['thread_cpu_share_of_step'] * 100:.2f}% of a step)")
    table.add_row("across runs: ratio on/off", f"{result['ratio']:.4f}",
                  "pairs: " + ", ".join(f"{r:.3f}" for r in result["pair_ratios"]))
    hb = runs[0]["host_bytes_per_rank"]
    if hb:
        table.add_row("snapshot host memory per rank", f"{hb / 2**20:.1f} MiB",
                      f"2 slots x {runs[0]['copies']} copies")
    table.add_row("same final state on and off", "yes" if result["same_final_state"] else "NO", "")
    console.print(table)


def goals(result: dict) -> list[Goal]:
    """The issue's goals for snapshots: <= 1.01x the step time, <= 1% of a step of CPU."""
    r = result["in_run"]
    cpu = r["thread_cpu_share_of_step"]
    same = result["same_final_state"]
    return [Goal("step time with snapshots, on/off blocks in one run", "<= 1.01x without",
                 f"{r['ratio']:.4f} ± {r['se']:.4f}", r["ratio"] <= 1.01),
            Goal("snapshot thread CPU per snapshot, cores shared with the workers",
                 "<= 1% of a step", f"{100 * cpu:.2f}%", cpu <= 0.01),
            Goal("same final state with snapshots on and off", "identical", same, same)]


def headline(result: dict) -> str:
    r, loc = result["in_run"], result["in_run_local_replica"]
    return (f"step time with snapshots: {r['ratio']:.3f}x ± {r['se']:.3f} without "
            f"(on/off blocks in one run), snapshot thread "
            f"{100 * r['thread_cpu_share_of_step']:.1f}% of a step; with a copy on "
            f"the same node (--replicas 1) {loc['ratio']:.3f}x ± {loc['se']:.3f}, "
            f"{100 * loc['thread_cpu_share_of_step']:.1f}%")

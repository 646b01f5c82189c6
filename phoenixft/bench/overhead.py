"""`phoenixft bench overhead`: what per-step snapshots + peer replicas cost.

Two measurements, both with examples/train_gpt.py and 1 torch thread per worker:

- in one run (the headline): snapshots switched on for K steps and off for the next K,
  again and again, in the same processes under the same load; a step's time counts as
  "on" when the previous step's snapshot was taken (its copy overlaps this step and must
  end before this step's optimizer update). The figure is the median over adjacent block
  pairs of (median on-step time / median off-step time).
- across runs: the same job with snapshots on and off, interleaved (on/off, off/on, ...)
  so drift on a shared machine hits both alike; also checks the final state is the same.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import median, run_job, step_times


def register(sub) -> None:
    p = sub.add_parser("overhead", help="step time with snapshots+replicas vs without")
    p.add_argument("--pairs", type=int, default=3, help="interleaved on/off pairs")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--block", type=int, default=6, help="K (even): steps per on / off block "
                                                       "in the in-run measurement")
    p.add_argument("--blocks", type=int, default=8, help="on/off block pairs in that run")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model trains (cuda: snapshots copy device-to-host on a "
                        "side stream into page-locked shared memory)")
    p.add_argument("--out", default="runs/bench/overhead.json")
    p.set_defaults(func=cmd_overhead)


def _script_args(args, steps: int) -> list[str]:
    return ["--steps", str(steps), "--preset", args.preset, "--device", args.device]


def in_run(args, root: Path) -> dict:
    """One job whose snapshots alternate on/off every `args.block` steps."""
    k, steps = args.block, 2 * args.block * args.blocks + args.block
    s = run_job(root / "in-run", nproc=args.nproc, snapshots=True, snapshot_blocks=k,
                script_args=_script_args(args, steps))
    ev = [(e["step"], e["gen"], e["t"]) for e in s["events"] if e["event"] == "step"]
    on: dict[int, list[float]] = {}
    off: dict[int, list[float]] = {}
    for (s0, g0, t0), (s1, g1, t1) in zip(ev, ev[1:]):
        if s1 != s0 + 1 or g1 != g0 or s0 < k:  # the first block is warm-up
            continue
        pair = s0 // (2 * k)
        (on if (s0 // k) % 2 == 0 else off).setdefault(pair, []).append(t1 - t0)
    ratios = [median(on[p]) / median(off[p]) for p in sorted(on) if p in off]
    return {"block": k, "steps": steps, "pair_ratios": ratios, "ratio": median(ratios),
            "median_step_on_s": median([x for v in on.values() for x in v]),
            "median_step_off_s": median([x for v in off.values() for x in v])}


def cmd_overhead(args) -> int:
    if args.block < 2 or args.block % 2:
        raise SystemExit(f"phoenixft bench overhead: --block must be even and >= 2, got "
                         f"{args.block} (a snapshot after an odd gap would overwrite the "
                         f"newest committed one)")
    console = Console(width=max(Console().width, 130))
    root = Path(args.out).parent / "overhead-runs"
    runs = []
    t0 = time.time()
    for i in range(args.pairs):
        order = [True, False] if i % 2 == 0 else [False, True]
        for snapshots in order:
            label = "on" if snapshots else "off"
            s = run_job(root / f"{i}-{label}", nproc=args.nproc, snapshots=snapshots,
                        script_args=_script_args(args, args.steps))
            times = step_times(s["events"])
            size = next((e for e in s["events"] if e["event"] == "snapshot_size"), {})
            stats = [e for e in s["events"] if e["event"] == "snapshot_stats"]
            cpu = (sum(e["thread_cpu_s"] for e in stats) / max(1, sum(e["snapshots"] for e in stats))
                   if stats else None)
            runs.append({"pair": i, "snapshots": snapshots, "median_step_s": median(times),
                         "steps_timed": len(times), "digest": s["final_state_digest"],
                         "host_bytes_per_rank": size.get("host_bytes_per_rank"),
                         "snapshot_thread_cpu_s_per_step": cpu})
            console.print(f"pair {i} snapshots {label}: median step {median(times) * 1000:.1f} ms")
    on = [r["median_step_s"] for r in runs if r["snapshots"]]
    off = [r["median_step_s"] for r in runs if not r["snapshots"]]
    pair_ratios = [a["median_step_s"] / b["median_step_s"]
                   for a in runs if a["snapshots"] for b in runs
                   if not b["snapshots"] and b["pair"] == a["pair"]]
    ratio = median(on) / median(off)
    same = len({r["digest"] for r in runs}) == 1
    inside = in_run(args, root)
    console.print(f"in one run, {inside['block']}-step blocks: on/off "
                  f"{inside['ratio']:.4f} (pairs {', '.join(f'{r:.3f}' for r in inside['pair_ratios'])})")
    result = {"benchmark": "overhead", "preset": args.preset, "nproc": args.nproc,
              "device": args.device,
              "threads_per_worker": 1, "steps": args.steps, "pairs": args.pairs,
              "median_step_on_s": median(on), "median_step_off_s": median(off),
              "ratio": ratio, "pair_ratios": pair_ratios, "goal": 1.01,
              "same_final_state": same, "runs": runs, "in_run": inside,
              "wall_s": time.time() - t0}
    table = Table(title=f"snapshot overhead: {args.nproc} workers x 1 thread, {args.preset} preset")
    for col in ("", "median step", "runs"):
        table.add_column(col)
    table.add_row("snapshots + replicas on", f"{median(on) * 1000:.1f} ms", str(len(on)))
    table.add_row("off", f"{median(off) * 1000:.1f} ms", str(len(off)))
    table.add_row("in one run: on/off blocks (goal <= 1.01)", f"{inside['ratio']:.4f}",
                  f"{len(inside['pair_ratios'])} pairs of {inside['block']}-step blocks")
    table.add_row("across runs: ratio on/off", f"{ratio:.4f}",
                  "pairs: " + ", ".join(f"{r:.3f}" for r in pair_ratios))
    hb = runs[0]["host_bytes_per_rank"]
    if hb:
        table.add_row("snapshot host memory per rank", f"{hb / 2**20:.1f} MiB",
                      "2 slots x (own + replica)")
    cpus = [r["snapshot_thread_cpu_s_per_step"] for r in runs if r["snapshots"]]
    if cpus and all(c is not None for c in cpus):
        c = median(cpus)
        result["snapshot_thread_cpu_s_per_step"] = c
        table.add_row("snapshot thread CPU per step", f"{c * 1000:.1f} ms",
                      f"{c / median(off) * 100:.1f}% of a step")
    table.add_row("same final state on and off", "yes" if same else "NO", "")
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0

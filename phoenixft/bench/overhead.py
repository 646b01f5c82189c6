"""`phoenixft bench overhead`: what per-step snapshots + peer replicas cost.

The same job (examples/train_gpt.py) runs with snapshots on and off, interleaved
(on/off, off/on, ...) so drift on a shared machine hits both alike. Each worker uses
1 torch thread. The figure is the ratio of median step times (steps after warm-up); the
final state must be the same either way.
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
    p.add_argument("--out", default="runs/bench/overhead.json")
    p.set_defaults(func=cmd_overhead)


def cmd_overhead(args) -> int:
    console = Console(width=max(Console().width, 130))
    root = Path(args.out).parent / "overhead-runs"
    runs = []
    t0 = time.time()
    for i in range(args.pairs):
        order = [True, False] if i % 2 == 0 else [False, True]
        for snapshots in order:
            label = "on" if snapshots else "off"
            s = run_job(root / f"{i}-{label}", nproc=args.nproc, snapshots=snapshots,
                        script_args=["--steps", str(args.steps), "--preset", args.preset])
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
    result = {"benchmark": "overhead", "preset": args.preset, "nproc": args.nproc,
              "threads_per_worker": 1, "steps": args.steps, "pairs": args.pairs,
              "median_step_on_s": median(on), "median_step_off_s": median(off),
              "ratio": ratio, "pair_ratios": pair_ratios, "goal": 1.01,
              "same_final_state": same, "runs": runs, "wall_s": time.time() - t0}
    table = Table(title=f"snapshot overhead: {args.nproc} workers x 1 thread, {args.preset} preset")
    for col in ("", "median step", "runs"):
        table.add_column(col)
    table.add_row("snapshots + replicas on", f"{median(on) * 1000:.1f} ms", str(len(on)))
    table.add_row("off", f"{median(off) * 1000:.1f} ms", str(len(off)))
    table.add_row("ratio on/off (goal <= 1.01)", f"{ratio:.4f}",
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

"""`phoenixft bench pipeline`: what protecting a pipelined job costs, and a SIGKILL's cost.

All with examples/train_pp.py (the example's Llama split into --pp stages, 1F1B, --nproc /
--pp pipeline replicas), N workers x 1 torch thread, side by side in one invocation:

- step time with snapshots + one same-node replica on against off, in one run: on for K
  steps, off for the next K, again and again (the paired estimate of `bench overhead`);
- a SIGKILL of one stage's rank at two thirds of a run, the same rank at the same step in
  two jobs, each its own process tree, one after the other: phoenixft with a warm spare
  and persistence to a directory (the rank dies as it issues a send/recv of activations,
  `phase=forward`), and plain torchrun pipelining with `dcp.async_save` every K steps and
  `--max-restarts 1` (torchrun_pp_baseline.py, what torchtitan users run; its rank dies as
  it starts the step). From phoenixft's: detection, the recovery and the gap from the kill
  to the next completed step, against the failure-free step time; from both: effective
  steps per second from the first completed step to the last, and their ratio (goodput).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import ROOT, run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.overhead import block_figures
from phoenixft.bench.runner import command
from phoenixft.bench.sharded import killed_goodput
from phoenixft.observe.goals import Goal

PP = ROOT / "examples" / "train_pp.py"
PP_BASELINE = Path(__file__).with_name("torchrun_pp_baseline.py")
GOAL_RATIO = 1.01
GOAL_GOODPUT = 2.23  # ReCoVer's published goodput ratio against checkpoint-and-restart


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pipeline", help="pipeline parallelism: snapshot overhead, SIGKILL of a "
                                        "stage's rank -> next step, goodput vs torchrun")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (replicas: nproc / pp)")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (>= --pp)")
    p.add_argument("--microbatches", type=int, default=8, help="per step, over all replicas")
    p.add_argument("--block", type=int, default=2, help="K (even): steps per on / off block")
    p.add_argument("--blocks", type=int, default=40, help="on/off block pairs")
    p.add_argument("--kill-steps", type=int, default=30,
                   help="steps of the two SIGKILL runs (the kill lands at two thirds)")
    p.add_argument("--ckpt-every", type=int, default=10,
                   help="K: torchrun's dcp.async_save every K steps")
    p.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit per goodput run, s")
    p.add_argument("--out", default="runs/bench/pipeline.json")
    p.set_defaults(func=command(measure, show))


def _extra(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--pp", str(args.pp), "--layers", str(args.layers))


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    replicas = args.nproc // args.pp if args.pp >= 2 else 0
    if (args.block < 2 or args.block % 2 or replicas < 1 or args.nproc % args.pp
            or args.microbatches % replicas or args.microbatches // replicas < args.pp
            or args.layers < args.pp or args.kill_steps < 12
            or not 1 <= args.ckpt_every < 2 * args.kill_steps // 3):
        raise SystemExit("phoenixft bench pipeline: --block must be even and >= 2; --pp >= 2 "
                         "dividing --nproc; --microbatches a multiple of the replicas with "
                         "--pp of them per replica at least (1F1B); --layers >= --pp; "
                         "--kill-steps >= 12; 1 <= --ckpt-every < the kill's step")
    root = opts.runs_dir("pipeline")
    t0 = time.time()
    k, steps = args.block, 2 * args.block * args.blocks + args.block
    s = run_job(root / "blocks", script=str(PP), nproc=args.nproc,
                snapshots={"enabled": True, "blocks": k, "replicas": 1},
                script_args=["--steps", str(steps), "--preset", args.preset, "--threads", "1",
                             "--microbatches", str(args.microbatches), *_extra(args)])
    return {"benchmark": "pipeline", "nproc": args.nproc, "pp": args.pp, "replicas": replicas,
            "threads_per_worker": 1, "preset": args.preset, "layers": args.layers,
            "microbatches": args.microbatches, "schedule": "1f1b",
            "blocks": block_figures(s["events"], k), "goal_ratio": GOAL_RATIO,
            **killed_goodput(root, args, label="pipeline", script=PP, baseline=PP_BASELINE,
                             phase="forward", microbatches=args.microbatches,
                             script_extra=_extra(args)),
            "wall_s": round(time.time() - t0, 1)}


def goals(result: dict) -> list[Goal]:
    b, kill = result["blocks"], result["kill"]
    g = result["torchrun_dcp_async"]
    gap = kill["kill_to_next_step_s"] - kill["step_s"]
    return [Goal("pipeline step time with snapshots + a replica, on/off blocks in one run",
                 f"<= {GOAL_RATIO}x without", f"{b['ratio']:.4f} ± {b['se']:.4f}",
                 b["ratio"] <= GOAL_RATIO),
            Goal("pipeline: SIGKILL of a stage's rank -> next step, beyond a failure-free step",
                 "<= one step time", f"{gap:.2f} s (steps {kill['step_s']:.2f} s)",
                 gap <= kill["step_s"]),
            Goal("pipeline goodput through a SIGKILL vs torchrun + dcp.async_save, restart",
                 f">= {GOAL_GOODPUT}x", f"{g['ratio']:.2f}x", g["ratio"] >= GOAL_GOODPUT)]


def headline(result: dict) -> str:
    b, kill, g = result["blocks"], result["kill"], result["torchrun_dcp_async"]
    return (f"pipeline pp {result['pp']} x {result['replicas']} replicas: step with snapshots + "
            f"a replica {b['ratio']:.3f}x ± {b['se']:.3f} without; SIGKILL of a stage's rank "
            f"-> next step {kill['kill_to_next_step_s']:.2f} s (steps {kill['step_s']:.2f} s); "
            f"goodput {g['ratio']:.2f}x torchrun + dcp.async_save with a restart")


def _rows(result: dict) -> list[tuple[str, str, str]]:
    b, kill, g = result["blocks"], result["kill"], result["torchrun_dcp_async"]
    return [
        (f"step time, snapshots + replica on/off (goal <= {GOAL_RATIO})",
         f"{b['ratio']:.4f} ± {b['se']:.4f}",
         f"{b['pairs']} pairs of {b['block']}-step blocks in one run; median step "
         f"{b['median_step_off_s'] * 1000:.0f} ms off, {b['median_step_on_s'] * 1000:.0f} ms on"),
        ("SIGKILL of a stage's rank in a send/recv -> next step",
         f"{kill['kill_to_next_step_s']:.2f} s",
         f"detect {kill['detect_s']:.3f} s, recover {kill['recover_s']:.3f} s, "
         f"{kill['lost_steps']} steps lost, failure-free steps {kill['step_s']:.2f} s"),
        (f"goodput vs torchrun + dcp.async_save every {g['ckpt_every']}, restart "
         f"(goal >= {GOAL_GOODPUT})", f"{g['ratio']:.2f}x",
         f"SIGKILL at step {g['kill_step']} of {g['steps']}: {g['spares']['eff_steps_s']:.2f} "
         f"against {g['restart']['eff_steps_s']:.2f} steps/s; "
         f"{g['restart'].get('steps_recomputed', '?')} steps recomputed by torchrun")]


def show(result: dict, opts: BenchOptions) -> None:
    table = Table(title=f"pipeline ({result['preset']} preset, {result['layers']} layers, "
                        f"1F1B): {result['nproc']} workers x 1 thread, pp {result['pp']} x "
                        f"{result['replicas']} replicas, {result['microbatches']} microbatches")
    for col in ("", "measured", "how"):
        table.add_column(col)
    for row in _rows(result):
        table.add_row(*row)
    Console(width=max(Console().width, 130)).print(table)


def markdown(result: dict) -> list[str]:
    return ["| figure | measured | how |", "|---|---|---|",
            *[f"| {a} | {b} | {c} |" for a, b, c in _rows(result)]]

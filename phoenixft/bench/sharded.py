"""`phoenixft bench sharded`: what protecting an FSDP2 model costs, and a SIGKILL's cost.

All with examples/train_fsdp.py (a Llama-style model, `fully_shard` per block), N workers
x 1 torch thread, side by side in one invocation:

- step time with snapshots + one same-node replica on against off, in one run: on for K
  steps, off for the next K, again and again (the paired estimate of `bench overhead`);
- host memory for snapshots per rank against the bytes of the rank's shard (its
  parameters' and optimizer state's local shards): two slots (the newest committed
  snapshot survives while the next is written) for its own copy and for each replica;
- a SIGKILL at two thirds of a run, of the same rank (chosen by seed) at the same step,
  in two jobs, each its own process tree, one after the other: phoenixft with a warm
  spare and persistence to a directory (the rank dies inside the step's reduce-scatter),
  and plain torchrun with `dcp.async_save` every K steps and `--max-restarts 1`
  (torchrun_fsdp_baseline.py, what torchtitan users run; the rank dies as it starts the
  step). From phoenixft's: detection, the recovery, and the gap from the kill to the next
  completed step; from both: effective steps per second from the first completed step to
  the last (`bench goodput`'s measure), and their ratio (goodput).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import FSDP, FSDP_BASELINE, run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.overhead import block_figures
from phoenixft.bench.recovery import measure_events
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal

GOAL_RATIO = 1.01


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sharded", help="FSDP2: snapshot overhead, host memory, SIGKILL -> next step")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--block", type=int, default=2, help="K (even): steps per on / off block")
    p.add_argument("--blocks", type=int, default=40, help="on/off block pairs")
    p.add_argument("--kill-steps", type=int, default=30,
                   help="steps of the two SIGKILL runs (the kill lands at two thirds)")
    p.add_argument("--ckpt-every", type=int, default=10,
                   help="K: torchrun's dcp.async_save every K steps")
    p.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit per goodput run, s")
    p.add_argument("--out", default="runs/bench/sharded.json")
    p.set_defaults(func=command(measure, show))


def _job(root: Path, name: str, args: argparse.Namespace, steps: int, **cfg) -> dict:
    return run_job(root / name, script=str(FSDP), nproc=args.nproc,
                   script_args=["--steps", str(steps), "--preset", args.preset], **cfg)


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    if (args.block < 2 or args.block % 2 or args.nproc < 2 or args.kill_steps < 12
            or not 1 <= args.ckpt_every < 2 * args.kill_steps // 3):
        raise SystemExit("phoenixft bench sharded: --block must be even and >= 2, --nproc >= 2, "
                         "--kill-steps >= 12 (steps before the kill time a step), "
                         "1 <= --ckpt-every < the kill's step (two thirds of --kill-steps)")
    root = opts.runs_dir("sharded")
    t0 = time.time()
    k, steps = args.block, 2 * args.block * args.blocks + args.block
    s = _job(root, "blocks", args, steps, snapshots={"enabled": True, "blocks": k, "replicas": 1})
    blocks = block_figures(s["events"], k)
    size = next(e for e in s["events"] if e["event"] == "snapshot_size")
    return {"benchmark": "sharded", "nproc": args.nproc, "threads_per_worker": 1,
            "preset": args.preset, "layout": "fsdp2", "blocks": blocks, "goal_ratio": GOAL_RATIO,
            "shard_bytes": size["bytes_per_slot"], "copies": size["copies"],
            "host_bytes_per_rank": size["host_bytes_per_rank"],
            "host_per_shard": size["host_bytes_per_rank"] / size["bytes_per_slot"],
            **killed_goodput(root, args, label="sharded", script=FSDP, baseline=FSDP_BASELINE,
                             phase="backward", microbatches=args.nproc),
            "wall_s": round(time.time() - t0, 1)}


def killed_goodput(root: Path, args: argparse.Namespace, *, label: str, script: Path,
                   baseline: Path, phase: str, microbatches: int,
                   script_extra: tuple[str, ...] = ()) -> dict:
    """phoenixft (a warm spare, persistence on) and torchrun + dcp.async_save with a
    restart (`baseline`), through the same SIGKILL of `args.nproc` workers' job (see the
    module docstring; phoenixft's rank dies at `phase` of the step): `kill`, phoenixft's
    recovery figures, and `torchrun_dcp_async`, the goodput of both."""
    from phoenixft.bench.faults import FaultConfig, drive
    from phoenixft.bench.goodput import measure_mode
    from phoenixft.bench.goodput_jobs import PhoenixJob, TorchrunJob, Workload
    from phoenixft.bench.torchrun_baseline import microbatch_tokens

    work = Workload(preset=args.preset, steps=args.kill_steps, microbatches=microbatches,
                    nproc=args.nproc)
    kill_step = 2 * args.kill_steps // 3
    cfg = FaultConfig(failures=1, at_steps=(kill_step,), timeout_s=args.timeout)
    faults = cfg.step_faults(args.nproc, shrinking=False)
    jobs = {"spares": PhoenixJob(run_dir=root / "goodput-spares", work=work, script=script,
                                 script_extra=list(script_extra), phase=phase, launcher_args=[
                                     "--spares", "1", "--persist",
                                     # (inside the run dir, emptied at each start: a
                                     # second invocation found the first one's job there)
                                     str(root / "goodput-spares" / "ckpt")]),
            "restart": TorchrunJob(run_dir=root / "goodput-restart", work=work, max_restarts=1,
                                   ckpt_every=args.ckpt_every, script=baseline, ckpt="dcp",
                                   script_extra=list(script_extra))}
    rows = {}
    for mode, job in jobs.items():
        print(f"[{label}] goodput {mode}: {' '.join(job.argv())}", flush=True)
        rows[mode] = measure_mode(mode, drive(job, cfg, faults), work,
                                  microbatch_tokens(args.preset) * microbatches)
        rows[mode]["processes"] = (f"{args.nproc} + 1 spare, 1 torch thread each" if mode == "spares"
                                   else f"{args.nproc}, new ones per restart, 1 torch thread each")
        if not rows[mode].get("completed"):
            raise SystemExit(f"phoenixft bench {label}: the goodput run {mode} did not complete "
                             f"(rc {rows[mode]['rc']}); see {job.run_dir}")
    if isinstance(jobs["restart"], TorchrunJob):
        rows["restart"]["restarts"] = jobs["restart"].restart_report()
    ratio = rows["spares"]["eff_steps_s"] / rows["restart"]["eff_steps_s"]
    keep = ("eff_steps_s", "wall_s", "median_step_s", "kill_to_next_step_s", "steps_recomputed",
            "failures", "processes", "restarts")
    return {"kill": {"step": kill_step, **measure_events(jobs["spares"].events)},
            "torchrun_dcp_async": {
                "kill_step": kill_step, "ckpt_every": args.ckpt_every, "steps": args.kill_steps,
                "ratio": ratio, **{m: {k: r[k] for k in keep if k in r} for m, r in rows.items()}}}


def goals(result: dict) -> list[Goal]:
    b, copies = result["blocks"], result["copies"]
    per = result["host_per_shard"]
    return [Goal("FSDP2 step time with snapshots + a replica, on/off blocks in one run",
                 f"<= {GOAL_RATIO}x without", f"{b['ratio']:.4f} ± {b['se']:.4f}",
                 b["ratio"] <= GOAL_RATIO),
            Goal("FSDP2 snapshot host memory per rank", f"<= 2 slots x {copies} copies of "
                 "the shard", f"{per:.2f}x the shard", per <= 2 * copies + 0.05),
            *_goodput_goal(result.get("torchrun_dcp_async"))]


def _goodput_goal(g: dict | None) -> list[Goal]:
    if not g:
        return []
    return [Goal("FSDP2 goodput through a SIGKILL vs torchrun + dcp.async_save, restart",
                 "> 1x", f"{g['ratio']:.2f}x", g["ratio"] > 1)]


def headline(result: dict) -> str:
    b, kill = result["blocks"], result["kill"]
    return (f"FSDP2, {result['nproc']} workers: step with snapshots + a replica "
            f"{b['ratio']:.3f}x ± {b['se']:.3f} without; snapshot memory "
            f"{result['host_per_shard']:.1f}x the shard per rank; SIGKILL in a reduce-scatter "
            f"-> next step {kill['kill_to_next_step_s']:.2f} s (steps {kill['step_s']:.2f} s)"
            + (f"; goodput {g['ratio']:.2f}x torchrun + dcp.async_save with a restart"
               if (g := result.get("torchrun_dcp_async")) else ""))


def show(result: dict, opts: BenchOptions) -> None:
    b, kill = result["blocks"], result["kill"]
    table = Table(title=f"FSDP2 ({result['preset']} preset): {result['nproc']} workers x 1 "
                        "thread")
    for col in ("", "measured", "how"):
        table.add_column(col)
    table.add_row(f"step time, snapshots + replica on/off (goal <= {GOAL_RATIO})",
                  f"{b['ratio']:.4f} ± {b['se']:.4f}",
                  f"{b['pairs']} pairs of {b['block']}-step blocks in one run; median step "
                  f"{b['median_step_off_s'] * 1000:.0f} ms off, {b['median_step_on_s'] * 1000:.0f} "
                  "ms on")
    table.add_row("snapshot thread CPU per snapshot",
                  f"{b['thread_cpu_s_per_snapshot'] * 1000:.2f} ms",
                  f"{b['thread_cpu_share_of_step'] * 100:.2f}% of a step")
    table.add_row("host memory per rank / shard bytes", f"{result['host_per_shard']:.2f}x",
                  f"{result['host_bytes_per_rank'] / 2**20:.2f} MiB for a "
                  f"{result['shard_bytes'] / 2**20:.2f} MiB shard: 2 slots x "
                  f"{result['copies']} copies")
    table.add_row("SIGKILL in a reduce-scatter -> next step", f"{kill['kill_to_next_step_s']:.2f} s",
                  f"detect {kill['detect_s']:.3f} s, recover {kill['recover_s']:.3f} s, "
                  f"{kill['lost_steps']} steps lost, steps {kill['step_s']:.2f} s")
    g = result.get("torchrun_dcp_async")
    if g:
        table.add_row(f"goodput vs torchrun + dcp.async_save every {g['ckpt_every']}, restart",
                      f"{g['ratio']:.2f}x",
                      f"SIGKILL at step {g['kill_step']} of {g['steps']}: "
                      f"{g['spares']['eff_steps_s']:.2f} against {g['restart']['eff_steps_s']:.2f} "
                      f"steps/s; {g['restart']['steps_recomputed']} steps recomputed by torchrun")
    Console(width=max(Console().width, 130)).print(table)


def markdown(result: dict) -> list[str]:
    b, kill = result["blocks"], result["kill"]
    return ["| figure | measured |", "|---|---|",
            f"| step time, snapshots + replica on/off blocks | {b['ratio']:.4f} ± {b['se']:.4f} |",
            f"| snapshot thread CPU per snapshot | {b['thread_cpu_s_per_snapshot'] * 1000:.2f} ms "
            f"({b['thread_cpu_share_of_step'] * 100:.2f}% of a step) |",
            f"| host memory per rank / shard | {result['host_per_shard']:.2f}x "
            f"({result['copies']} copies x 2 slots) |",
            f"| SIGKILL in a reduce-scatter -> next step | {kill['kill_to_next_step_s']:.2f} s "
            f"(detect {kill['detect_s']:.3f} s, recover {kill['recover_s']:.3f} s) |",
            *_goodput_md(result.get("torchrun_dcp_async"))]


def _goodput_md(g: dict | None) -> list[str]:
    if not g:
        return ["| goodput vs torchrun + dcp.async_save, restart | not measured |"]
    return [f"| goodput vs torchrun + dcp.async_save every {g['ckpt_every']}, restart | "
            f"{g['ratio']:.2f}x ({g['spares']['eff_steps_s']:.2f} against "
            f"{g['restart']['eff_steps_s']:.2f} steps/s; SIGKILL at step {g['kill_step']} of "
            f"{g['steps']}) |"]

"""`phoenixft bench goodput`: effective throughput under a fixed failure schedule.

Same model, steps and microbatches per step in every mode, each mode its own process tree,
run one after another in one invocation:

- clean:   phoenixft, N workers, no faults (the reference)
- spares:  phoenixft, N workers + F warm spares (hot swap)
- shrink:  phoenixft, N workers, no spare, `--min-nproc 1` (ReCoVer: the job shrinks and
           keeps every step's microbatches)
- restart: torchrun --max-restarts F, DDP over gloo, torch.save every K steps, resume from
           the last checkpoint (what users run today)
- restart-clean (optional): the torchrun job without faults, to separate the frameworks'
           failure-free speed from what failures cost
- restart-env (optional): `restart` with a plain `init_process_group("gloo")`, which on
           torch 2.13 fails its restarts on stale gloo addresses (torchrun_baseline.py)

With `--dp-shard S` every mode trains examples/train_fsdp.py's model as HSDP instead:
nproc / S replica groups of S FSDP2 ranks, one microbatch per rank and step. A SIGKILL
costs the dead rank's whole group: `spares` swaps it inside its group, `shrink` goes on
with the other groups taking the lost group's microbatches and `--respawn` brings the
group back at a step boundary (a wall-clock fault waits until it is back: with 2 groups
there is no other group to lose meanwhile), and `restart` is torchrun with
`dcp.async_save` every K steps on the same (replicate, shard) mesh
(torchrun_fsdp_baseline.py), what torchtitan users run without torchft.

Faults are SIGKILLs of one training worker every `--interval` seconds after the first
step (see `faults.py`); by default the interval is the failure-free run's duration divided
by failures + 1, so the faults fall at even fractions of the job on any machine. With
`--fault-steps S1,S2,..` the faults fire instead when the job starts those steps (the
worker kills itself there: a schedule that cannot race a short job's end).
Effective throughput = failure-free-equivalent optimizer steps per second of wall time,
from the first completed step to the last (start-up is paid once per job, failures are
paid at a rate; launch-to-end figures are in the JSON as well). Goals:
ReCoVer >= 2.23x checkpoint-and-restart, and >= 0.9x the failure-free throughput scaled by
the time-weighted mean number of surviving workers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal
from phoenixft.observe.steps import step_times

if TYPE_CHECKING:  # imported where used: `phoenixft --help` must not pay for torch or psutil
    from phoenixft.bench.faults import Outcome
    from phoenixft.bench.goodput_jobs import Workload

MODES = ("clean", "spares", "shrink", "restart", "restart-clean", "restart-env")
LABELS = {"clean": "(d) phoenixft failure-free", "spares": "(a) phoenixft warm spares",
          "shrink": "(b) phoenixft ReCoVer", "restart": "(c) torchrun ckpt+restart",
          "restart-clean": "torchrun failure-free",
          "restart-env": "torchrun ckpt+restart, stock init"}
QUICK = {"preset": "tiny", "steps": 150, "failures": 2, "timeout": 150.0}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("goodput", help="effective throughput under SIGKILLs: spares, ReCoVer "
                                       "shrink, torchrun checkpoint-restart, failure-free",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="clean,spares,shrink,restart",
                   help=f"comma-separated, run in this order; from {', '.join(MODES)}")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step, all ranks")
    p.add_argument("--failures", type=int, default=3, help="SIGKILLs per faulted mode; also the "
                   "spares of `spares` and torchrun's --max-restarts")
    p.add_argument("--interval", type=float, default=None,
                   help="seconds between SIGKILLs (default: the failure-free run's duration / "
                        "(failures + 1), so the faults fall at even fractions of it)")
    p.add_argument("--fault-steps", default=None, metavar="S1,S2,..",
                   help="kill when the job starts these steps instead of on a wall-clock "
                        "schedule (one step per failure)")
    p.add_argument("--ckpt-every", type=int, default=20, help="torchrun baseline: steps per torch.save")
    p.add_argument("--timeout", type=float, default=400.0, help="wall-clock limit per mode, seconds")
    p.add_argument("--seed", type=int, default=0, help="which ranks die (and the data seed)")
    p.add_argument("--dp-shard", type=int, default=0, metavar="S",
                   help="HSDP: replica groups of S FSDP2 ranks (train_fsdp.py; the group is the "
                        "unit of failure; microbatches = nproc); 0: data parallel train_gpt.py")
    p.add_argument("--quick", action="store_true",
                   help="about 2 minutes: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", default="runs/bench/goodput.json",
                   help="the JSON result (with --dp-shard, `phoenixft simulate --hsdp-json` "
                        "reads runs/bench/goodput-hsdp.json)")
    p.add_argument("--plot", default="runs/bench/goodput.png")
    p.set_defaults(func=command(measure, show, quick=QUICK, exit_code=exit_code))


def make_job(mode: str, run_dir: Path, work: Workload, args):
    from phoenixft.bench.goodput_jobs import PhoenixJob, TorchrunJob
    from phoenixft.bench.harness import FSDP, FSDP_BASELINE

    hsdp = ["--dp-shard", str(args.dp_shard)] if args.dp_shard else []
    if mode.startswith("restart"):
        extra = {"script": FSDP_BASELINE, "ckpt": "dcp", "script_extra": hsdp} if hsdp else {}
        return TorchrunJob(run_dir=run_dir, work=work, max_restarts=args.failures,
                           ckpt_every=args.ckpt_every,
                           init="env" if mode == "restart-env" else "per-attempt", **extra)
    shrink = (["--min-nproc", str(args.dp_shard), "--respawn", str(args.failures * args.dp_shard)]
              if hsdp else ["--min-nproc", "1"])
    launcher = {"clean": [], "spares": ["--spares", str(args.failures)], "shrink": shrink}[mode]
    if hsdp:
        return PhoenixJob(run_dir=run_dir, work=work, launcher_args=launcher, script=FSDP,
                          script_extra=hsdp)
    return PhoenixJob(run_dir=run_dir, work=work, launcher_args=launcher)


def processes(mode: str, args) -> str:
    """Worker processes besides the launcher (phoenixft's agent or torchrun's)."""
    if mode == "spares":
        return f"{args.nproc} + {args.failures} spares"
    if mode == "shrink" and args.dp_shard:
        return f"{args.nproc}, up to {args.failures * args.dp_shard} respawned"
    if mode.startswith("restart"):
        return f"{args.nproc}, new ones per restart"
    return str(args.nproc)


def measure_mode(mode: str, out: Outcome, work: Workload, tokens_per_step: int,
                 label: str | None = None) -> dict:
    """Figures of one mode from its step events (see the module docstring)."""
    steps = out.steps
    for k in out.kills:
        k["t_rel"] = round(k["t"] - out.t_launch, 3)
    row = {"mode": mode, "label": label or LABELS[mode], "rc": out.rc, "timed_out": out.timed_out,
           "failures": len(out.kills), "kills": out.kills,
           "progress": [[round(s.t - out.t_launch, 3), s.step, s.world_size, s.epoch] for s in steps]}
    if len(steps) < 2:
        return {**row, "completed": False, "final_step": steps[-1].step if steps else 0,
                "eff_steps_s": 0.0, "tokens_s": 0.0}
    first, last = steps[0], steps[-1]
    completed = last.step == work.steps
    # A job that never finished is charged for all the time it had, not just until its
    # last step (a hung restart makes no progress but still holds the machines).
    wall = (last.t if completed else out.t_exit) - first.t
    mean_workers = _time_mean(steps, wall, lambda w: w)
    # Workers beyond the core count share cores: the compute a job can use is min(W, cores).
    cores = os.cpu_count() or 1
    mean_cores = _time_mean(steps, wall, lambda w: min(w, cores))
    eff = (last.step - first.step) / wall
    seen = [s.step for s in steps]
    gaps = step_times(steps)
    after = [_kill_to_next_step(k, steps) for k in out.kills]
    return {**row, "completed": completed, "final_step": last.step,
            "workers_start": first.world_size, "workers_end": last.world_size,
            "mean_workers": mean_workers, "mean_cores_in_use": mean_cores,
            "wall_s": wall, "launch_to_end_s": last.t - out.t_launch,
            "first_step_after_launch_s": first.t - out.t_launch,
            "eff_steps_s": eff, "tokens_s": eff * tokens_per_step,
            "steps_recomputed": len(seen) - len(set(seen)),
            "median_step_s": statistics.median(gaps) if gaps else None,
            "kill_to_next_step_s": [a for a in after if a is not None]}


def _time_mean(steps, wall: float, f) -> float:
    """Time-weighted mean of f(world size) from the first step over `wall` seconds (the last
    world size holds until the end of `wall`)."""
    total = sum((b.t - a.t) * f(b.world_size) for a, b in zip(steps, steps[1:]))
    return (total + (wall - (steps[-1].t - steps[0].t)) * f(steps[-1].world_size)) / wall


def _kill_to_next_step(kill: dict, steps) -> float | None:
    nxt = next((s for s in steps if s.t > kill["t"] and s.epoch > kill["epoch"]), None)
    return None if nxt is None else nxt.t - kill["t"]


def compare(rows: dict[str, dict], nproc: int) -> None:
    """Ratios against the checkpoint-restart run and the scaled failure-free run, in place."""
    base = rows.get("restart", {}).get("eff_steps_s")
    ref = rows.get("clean", {}).get("eff_steps_s")
    for r in rows.values():
        if base:
            r["vs_restart"] = r["eff_steps_s"] / base
        if ref and r.get("mean_workers"):
            r["vs_clean_scaled"] = r["eff_steps_s"] / (ref * r["mean_workers"] / nproc)
            full = rows["clean"]["mean_cores_in_use"]
            r["vs_clean_scaled_by_cores"] = r["eff_steps_s"] / (ref * r["mean_cores_in_use"] / full)


def _modes(args) -> list[str]:
    """The modes to run, `clean` first when it sets the fault interval."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"phoenixft bench goodput: unknown modes {bad}; choose from {MODES}")
    if args.dp_shard:
        _check_hsdp(args, modes)
    elif args.failures >= args.nproc and "shrink" in modes:
        raise SystemExit(f"phoenixft bench goodput: --failures {args.failures} needs more than "
                         f"--nproc {args.nproc} workers (shrink keeps one survivor)")
    if args.fault_steps is not None:
        try:
            args.fault_steps = [int(x) for x in args.fault_steps.split(",")]
        except ValueError:
            raise SystemExit(f"phoenixft bench goodput: --fault-steps must be comma-separated "
                             f"integers, got {args.fault_steps!r}") from None
        if len(args.fault_steps) != args.failures:
            raise SystemExit(f"phoenixft bench goodput: --fault-steps names "
                             f"{len(args.fault_steps)} steps for --failures {args.failures}")
        if args.interval is not None:
            raise SystemExit("phoenixft bench goodput: give --interval or --fault-steps, not both")
        if not all(1 < s <= args.steps for s in args.fault_steps):
            raise SystemExit(f"phoenixft bench goodput: --fault-steps must lie in (1, --steps "
                             f"{args.steps}], got {args.fault_steps}")
        return modes
    if args.interval is None:
        if "clean" not in modes:
            raise SystemExit("phoenixft bench goodput: give --interval, or run the `clean` mode "
                             "that sets it")
        modes = ["clean"] + [m for m in modes if m != "clean"]
    return modes


def _check_hsdp(args, modes: list[str]) -> None:
    s = args.dp_shard
    if s < 1 or args.nproc % s or args.nproc // s < 2:
        raise SystemExit(f"phoenixft bench goodput: --dp-shard {s} must divide --nproc "
                         f"{args.nproc} into at least 2 replica groups")
    if args.microbatches != args.nproc:
        raise SystemExit(f"phoenixft bench goodput: --dp-shard trains one microbatch per rank: "
                         f"give --microbatches {args.nproc}, not {args.microbatches}")
    if "restart-env" in modes:
        raise SystemExit("phoenixft bench goodput: restart-env is the DDP baseline's; with "
                         "--dp-shard run restart")


HSDP_LABELS = {"clean": "(d) phoenixft HSDP failure-free",
               "spares": "(a) phoenixft HSDP, swap in the group",
               "shrink": "(b) phoenixft HSDP, group leaves + respawn",
               "restart": "(c) torchrun HSDP + dcp.async_save",
               "restart-clean": "torchrun HSDP failure-free"}


def run_mode(mode: str, work: Workload, args, interval_s: float, root: Path,
             tokens_per_step: int) -> dict:
    """Run one mode in its own process tree and measure it."""
    from phoenixft.bench.faults import FaultConfig, drive
    from phoenixft.bench.goodput_jobs import TorchrunJob

    faulted = mode not in ("clean", "restart-clean")
    cfg = FaultConfig(failures=args.failures if faulted else 0, interval_s=interval_s,
                      at_steps=tuple(args.fault_steps or ()) if faulted else (),
                      timeout_s=args.timeout, seed=args.seed,
                      full_world=args.nproc if args.dp_shard and mode == "shrink" else 0)
    step_faults = cfg.step_faults(args.nproc, shrinking=mode == "shrink" and not args.dp_shard)
    job = make_job(mode, root / mode, work, args)
    print(f"[goodput] {mode}: {' '.join(job.argv())}", flush=True)
    out = drive(job, cfg, step_faults)
    r = measure_mode(mode, out, work, tokens_per_step,
                     label=HSDP_LABELS[mode] if args.dp_shard else None)
    r.update(processes=processes(mode, args), run_dir=str(root / mode), loadavg_1m=os.getloadavg()[0])
    if isinstance(job, TorchrunJob):
        r["restarts"] = job.restart_report()
    else:
        r["recoveries"] = job.summary().get("recoveries", [])
    print(f"[goodput] {mode}: rc {r['rc']}, step {r['final_step']}/{args.steps}, "
          f"{len(r['kills'])} kills, {r.get('wall_s', float('nan')):.1f} s", flush=True)
    return r


def _run_modes(args: argparse.Namespace, modes: list[str], work: Workload, root: Path,
               tokens_per_step: int) -> tuple[dict[str, dict], float | None]:
    """Every mode in turn; without --interval or --fault-steps the clean run (first) sets
    the SIGKILL interval: faults at 1/(F+1), 2/(F+1), ... of it."""
    rows: dict[str, dict] = {}
    interval = args.interval
    for mode in modes:
        rows[mode] = run_mode(mode, work, args, interval or 1.0, root, tokens_per_step)
        if interval is None and args.fault_steps is None:
            interval = rows["clean"].get("wall_s", 0.0) / (args.failures + 1)
            if interval <= 0:
                raise SystemExit("phoenixft bench goodput: the clean run failed; see "
                                 f"{rows['clean']['run_dir']}")
            print(f"[goodput] SIGKILL interval: {interval:.1f} s", flush=True)
    return rows, interval


def measure(opts: BenchOptions) -> dict:
    """Each mode as its own process tree, one after another, then their ratios."""
    from phoenixft.bench.goodput_jobs import Workload
    from phoenixft.bench.torchrun_baseline import microbatch_tokens

    args = opts.own
    modes = _modes(args)
    work = Workload(preset=args.preset, steps=args.steps, microbatches=args.microbatches,
                    nproc=args.nproc, seed=args.seed)
    tokens_per_step = args.microbatches * microbatch_tokens(args.preset)
    t0, load_before = time.time(), os.getloadavg()
    root = opts.runs_dir("goodput-hsdp" if args.dp_shard else "goodput")
    rows, interval = _run_modes(args, modes, work, root, tokens_per_step)
    compare(rows, args.nproc)
    return {"benchmark": "goodput", "preset": args.preset, "steps": args.steps,
            "layout": (f"hsdp {args.nproc // args.dp_shard}x{args.dp_shard}" if args.dp_shard
                       else "dp"),
            "nproc": args.nproc, "microbatches": args.microbatches,
            "tokens_per_step": tokens_per_step, "threads_per_worker": 1,
            "cpu_count": os.cpu_count(), "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "failures": args.failures,
            "interval_s": interval, "interval_auto": args.interval is None,
            "fault_steps": args.fault_steps,
            "ckpt_every": args.ckpt_every, "seed": args.seed,
            "goals": {"shrink_vs_restart": 2.23, "shrink_vs_clean_scaled": 0.9},
            "modes": rows, "bench_wall_s": time.time() - t0}


def show(result: dict, opts: BenchOptions) -> None:
    """The table, and the progress plot (`--plot`)."""
    from phoenixft.bench.goodput_report import plot_progress, print_table

    print_table(result)
    plot_progress(result, Path(opts.own.plot))
    print(f"wrote {opts.own.plot}")


def exit_code(result: dict) -> int:
    """1 if a mode did not complete: its figures are a timeout's, not a run's."""
    return 0 if all(r.get("completed") for r in result["modes"].values()) else 1


def goals(result: dict) -> list[Goal]:
    """ReCoVer >= 2.23x checkpoint-and-restart and >= 0.9x the failure-free run scaled by
    its surviving workers; every mode completed."""
    m = result["modes"]
    shrink, restart = m.get("shrink", {}), m.get("restart", {})
    out = []
    if shrink.get("vs_restart") is not None:
        out.append(Goal("ReCoVer vs checkpoint-and-restart", ">= 2.23x",
                        round(shrink["vs_restart"], 3), shrink["vs_restart"] >= 2.23))
    if shrink.get("vs_clean_scaled") is not None:
        out.append(Goal("ReCoVer vs failure-free scaled by survivors", ">= 0.9x",
                        round(shrink["vs_clean_scaled"], 3), shrink["vs_clean_scaled"] >= 0.9))
    if restart.get("completed") is not None:
        done = all(r.get("completed") for r in m.values())
        out.append(Goal("every mode completed", "yes", done, done))
    return out


def headline(result: dict) -> str:
    m = result["modes"]
    parts = [f"{k} {m[k]['eff_steps_s'] / m['clean']['eff_steps_s']:.2f}"
             for k in ("spares", "shrink", "restart") if k in m and m[k].get("eff_steps_s")]
    return "goodput vs failure-free, " + ", ".join(parts) + f" ({result['failures']} SIGKILLs)"

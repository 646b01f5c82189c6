"""`phoenixft bench checkpoint`: what a checkpoint costs training, and how much it writes.

Side by side in one process (1 process, `--threads` torch threads), on the same model,
optimizer and data, one mode after the other:

- none: the step time with no checkpoint at all (the reference);
- phoenixft: a standalone `Session` with `--persist` to a local directory: each step's
  snapshot copied off the critical path, then a base (every K records) or a delta persisted in
  the background, at the steps its CPU share allows (`--persist-cpu-share`, 5% of a core by
  default: every stride-th step). Stall = the time the training thread waited for a
  snapshot copy; durable = from the end of the step to its manifest; beside it the same
  Session without snapshots or persistence ("phoenixft, no checkpoint"), which is what the
  session itself costs over a plain loop;
- torch.save: model + optimizer state dicts saved synchronously (write then rename);
- dcp.save / dcp.async_save: torch.distributed.checkpoint (async: stall = until the
  call returns plus the wait on the previous save; durable = until its future completes).
Each at one checkpoint per step and one per K steps (the per-step stall is then amortised).
The first `WARM` steps of each run are not timed (step times and stalls alike). Besides
the stall, every mode reports its wall time per step against the plain loop's ("step vs
none"): background work (a writer thread, the persister) costs no stall but competes for
the same cores, and a stall alone would hide that.

Then delta sizes, as a fraction of the full state (model + optimizer as torch.save writes
it), for (a) full fine-tuning with AdamW,
(b) a frozen backbone with LoRA-style adapters training, (c) sparse updates of a large
embedding (SGD: only the looked-up rows change), beside the bytes one dcp.save checkpoint
writes for the same model. The untrained tensors (the frozen backbone) are persisted once
per generation, not per step: shown apart.

Then the session against a plain loop in alternating blocks of 3 steps in one process
(`--pairs` pairs), without checkpoints, with snapshots only, and with snapshots +
persistence: the goal "with vs
without" is the quotient of these two paired ratios, since single runs one after the other
swing 10-20% here from run to run. Each checkpointing block ends by waiting for its
snapshot's commit and for the persister to go idle, so its background work is charged to
it and not to the plain block after it (an upper bound of its cost).

Goals (issue: tiered checkpoints): stall <= 1% of the step at one checkpoint per step;
wall per step with snapshots + persistence <= 1.05x the session without; delta <= 5% of
the full state for (b) and (c); persisted bytes per step for (b) >= 10x fewer than DCP's.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal, as_dicts, print_goals


def _at_least_2(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"needs at least 2 pairs (a standard error), got {n}")
    return n


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="training stall and bytes written per checkpoint: "
                       "phoenixft tiers vs torch.save vs torch.distributed.checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--every", type=int, default=10, help="K: the per-K-steps frequency and "
                   "phoenixft's base interval")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--persist-cpu-share", type=float, default=0.05,
                   help="phoenixft's persister: its share of one core (as phoenixft run's)")
    p.add_argument("--pairs", type=_at_least_2, default=16, help="block pairs of the session-"
                   "vs-plain-loop comparison (alternating blocks of 3 steps in one process)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a "
                   "temporary directory on local disk)")
    p.add_argument("--out", default="runs/bench/checkpoint.json")
    p.set_defaults(func=command(measure, show))


def _modes(args: argparse.Namespace) -> tuple[dict, dict]:
    """Every checkpointing mode at both frequencies (by int frequency), and the session
    against a plain loop in alternating blocks."""
    from phoenixft.bench import checkpoint_runs as runs

    modes = {"none": runs.plain_run(args, None, "none")}
    for name, fn in runs.SAVES.items():
        print(f"[checkpoint] {name}", flush=True)
        modes[name] = runs.plain_run(args, fn, name.replace(".", "_"))
    print("[checkpoint] phoenixft", flush=True)
    modes["phoenixft, no checkpoint"] = {1: runs.phoenix_run(args, "full", 1, args.steps,
                                                             checkpoints=False)}
    print("[checkpoint] the session vs a plain loop, alternating blocks", flush=True)
    paired = {m: runs.session_vs_plain(args, m) for m in ("without", "snapshots", "with")}
    modes["phoenixft"] = {1: runs.phoenix_run(args, "full", 1, args.steps),
                          args.every: runs.phoenix_run(args, "full", args.every, args.steps)}
    for by_freq in modes.values():  # wall per step, waits included, against the plain loop
        for r in by_freq.values():
            wall = r["step_s"] + (0.0 if "stall_per_ckpt_s" not in r else r["stall_per_step_s"])
            r["step_vs_none"] = wall / modes["none"][1]["step_s"]
    return modes, paired


def _scenarios(args: argparse.Namespace) -> dict:
    """Delta sizes of the three workloads against the full state and one DCP checkpoint."""
    from phoenixft.bench import checkpoint_runs as runs

    scenarios = {}
    for kind, label in (("full", "(a) full fine-tuning"),
                        ("adapters", "(b) frozen backbone, LoRA adapters"),
                        ("embedding", "(c) sparse embedding updates")):
        print(f"[checkpoint] delta sizes: {label}", flush=True)
        r = runs.phoenix_run(args, kind, args.every, args.every + 4, settle=True)
        r["dcp_bytes"] = runs.dcp_bytes(args, kind)
        r["delta_fraction"] = (r["delta_bytes"] or 0) / r["full_state_bytes"]
        r["label"] = label
        scenarios[kind] = r
    return scenarios


def measure(opts: BenchOptions) -> dict:
    """Every mode, then the delta sizes, in one process."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store waits time out by design
    import torch

    args = opts.own
    torch.set_num_threads(opts.threads)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"[checkpoint] {opts.preset} preset, {args.steps} steps per mode, K={args.every}, "
          f"1 process x {opts.threads} torch threads", flush=True)
    modes, paired = _modes(args)
    result = {"benchmark": "checkpoint", "preset": opts.preset, "steps": args.steps,
              "every": args.every, "processes": 1, "threads": opts.threads,
              "cpu_count": os.cpu_count(), "step_s": modes["none"][1]["step_s"],
              "modes": {m: {str(k): v for k, v in r.items()} for m, r in modes.items()},
              "scenarios": _scenarios(args), "session_vs_plain": paired}
    result["goals"] = as_dicts(goals(result))
    return {**result, "bench_wall_s": time.time() - t_start}


def goals(result: dict) -> list[Goal]:
    """The issue's goals for tiered checkpoints (the module docstring)."""
    scenarios = result["scenarios"]
    stall = result["modes"]["phoenixft"]["1"]["stall_per_step_s"] / result["step_s"]
    b = scenarios["adapters"]
    ratio = b["dcp_bytes"] / max(1.0, b["bytes_per_step"])
    paired = result["session_vs_plain"]
    cost, cost_se = paired_cost(paired)
    return [
        Goal("phoenixft stall at one checkpoint per step", "<= 1% of a step",
             f"{100 * stall:.2f}%", stall <= 0.01),
        Goal("phoenixft wall per step with snapshots + persistence offered every step, vs "
             "the same session without", "<= 1.05x",
             f"{cost:.3f}x +- {cost_se:.3f} (paired blocks, each against a plain "
             f"loop; persisting every {paired['with']['stride']}th step at the end)",
             cost <= 1.05),
        Goal("delta size, frozen backbone + adapters", "<= 5% of the full state",
             f"{100 * b['delta_fraction']:.2f}%", b["delta_fraction"] <= 0.05),
        Goal("delta size, sparse embedding updates", "<= 5% of the full state",
             f"{100 * scenarios['embedding']['delta_fraction']:.2f}%",
             scenarios["embedding"]["delta_fraction"] <= 0.05),
        Goal("persisted bytes per step, frozen backbone + adapters, vs one DCP checkpoint",
             ">= 10x fewer", f"{ratio:.1f}x fewer", ratio >= 10),
    ]


def headline(result: dict) -> str:
    """The stall and the paired wall-per-step cost: the first two goals' figures."""
    return "; ".join(f"{g.name}: {g.measured}" for g in goals(result)[:2])


def markdown(result: dict) -> list[str]:
    """The cost table (`cost_rows`) and the session line, for BENCHMARKS.md."""
    rows = ["| " + " | ".join(COST_COLUMNS) + " |", "|" + "---|" * len(COST_COLUMNS)]
    rows += ["| " + " | ".join(r) + " |" for r in cost_rows(result)]
    p = result["modes"].get("phoenixft", {}).get("1", {})
    return rows + ["", f"Plain loop: {1000 * result['step_s']:.0f} ms a step. phoenixft "
                   f"persisted every {p.get('stride')}th step (its persister's CPU share, 5% of "
                   "a core by default). " + session_line(result)]


COST_COLUMNS = ("mode", "every (steps)", "stall per checkpoint ms", "stall, % of a step",
                "wall per step vs no checkpoint", "durable after ms", "bytes per checkpoint")


def cost_rows(result: dict) -> list[tuple[str, ...]]:
    """Every mode's cost (`COST_COLUMNS`): the training thread's stall, and its wall per
    step against the plain loop's (background work competes for the same cores: a stall
    alone hides it)."""
    rows = []
    for mode, by_freq in result["modes"].items():
        if mode == "none":
            continue
        for freq, r in by_freq.items():
            per_ckpt = r.get("stall_per_ckpt_s", r["stall_per_step_s"])
            rows.append((mode, str(freq), f"{1000 * per_ckpt:.1f}",
                         f"{100 * r['stall_per_step_s'] / result['step_s']:.2f}%",
                         f"{r['step_vs_none']:.2f}x",
                         "-" if r.get("durable_s") is None else f"{1000 * r['durable_s']:.0f}",
                         f"{r.get('bytes_per_ckpt', r.get('bytes_per_step', 0)):.3g}"))
    return rows


def paired_cost(paired: dict) -> tuple[float, float]:
    """The session with checkpoints against the session without, from their two paired
    ratios against a plain loop (so the machine's drift between the two cancels), with
    the standard error of the quotient."""
    w, wo = paired["with"], paired["without"]
    q = w["mean"] / wo["mean"]
    return q, q * ((w["se"] / w["mean"]) ** 2 + (wo["se"] / wo["mean"]) ** 2) ** 0.5


def session_line(result: dict) -> str:
    """The session's wall per step against a plain loop, measured in alternating blocks."""
    p = result.get("session_vs_plain")
    if not p:
        return ""
    wo, w = p["without"], p["with"]
    snap = p.get("snapshots")
    snaps = (f"; with snapshots, nothing persisted, {snap['mean']:.3f}x +- {snap['se']:.3f}"
             if snap else "")
    return (f"Against a plain loop, in {wo['pairs']} alternating pairs of {wo['block']}-step "
            f"blocks in one process (mean of the pair ratios +- standard error): the session "
            f"alone {wo['mean']:.3f}x +- {wo['se']:.3f}{snaps}; with snapshots and persistence "
            f"{w['mean']:.3f}x +- {w['se']:.3f} ({w['records']} records in "
            f"{w['steps']} steps). The table's single runs, one mode "
            f"after the other, swing more than that from run to run.")


def show(result: dict, opts: BenchOptions) -> None:
    """The cost table, the paired session line, the bytes table and the goals."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    step_s = result["step_s"]
    t = Table(title=f"checkpoint cost: {result['preset']} preset, step {1000 * step_s:.0f} ms "
                    f"without checkpoints; 1 process x {result['threads']} torch threads")
    for col in COST_COLUMNS:
        t.add_column(col)
    for row in cost_rows(result):
        t.add_row(*row)
    console.print(t)
    console.print(session_line(result))
    d = Table(title="bytes written per step: phoenixft deltas vs the full state and one DCP "
                    "checkpoint")
    for col in ("scenario", "full state", "phoenixft delta", "delta / full",
                "phoenixft bytes/step (bases incl.)", "untrained, once", "DCP checkpoint",
                "DCP / phoenixft per step"):
        d.add_column(col)
    for r in result["scenarios"].values():
        d.add_row(r["label"], f"{r['full_state_bytes']:.3g}", f"{r['delta_bytes'] or 0:.3g}",
                  f"{100 * r['delta_fraction']:.2f}%", f"{r['bytes_per_step']:.3g}",
                  f"{r['fixed_bytes_once']:.3g}", f"{r['dcp_bytes']:.3g}",
                  f"{r['dcp_bytes'] / max(1, r['bytes_per_step']):.1f}x")
    console.print(d)
    print_goals(console, goals(result))

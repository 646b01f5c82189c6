"""`phoenixft bench consensus`: faults that do not crash: stragglers, and what the
fingerprint vote against silent data corruption costs a failure-free step.

examples/train_gpt.py (data parallel, `--data ids`, M microbatches a step), N workers x 1
torch thread, each mode its own process tree, one after another in one invocation:

- clean:      failure-free, the reference throughput;
- nofp:       failure-free with the fingerprint vote off (--fingerprint-every 0);
- fp_blocks:  failure-free with the vote (and the seal) on for 2 steps and off for the
              next 2, again and again: their cost inside one run, in the same processes
              under the same load, as `bench overhead` measures snapshots (paired block
              means, with a standard error; twin runs here differ by more than the effect);
              the vote carried in the step's own all-reduce (the default);
- fp_blocks_sep: the same with --fingerprint-vote separate (one more tiny all-reduce a
              voted step, before its update: the scheme before the carried one);
- slow:       rank 1 made F times slower from step S on (`slow:` fault), the straggler
              only reported (what a job without the action gets);
- swap:       the same with 1 warm spare and `--straggler swap`;
- rebalance:  the same, no spare, `--straggler rebalance`;
- noisy, noisy2: failure-free beside one and two noisy neighbours (busy processes this
              benchmark starts and stops), for false alarms per 1,000 steps;
- freeze:     rank 1 stopped (SIGSTOP) for 150 ms of every 250 ms from step S on
              (`freeze:` fault), the straggler only reported: how soon it is named;
- k8:         failure-free with --fingerprint-every 8 (the vote's cost when it samples);
- recompute:  failure-free with --recompute-every K (sampled recomputation): its cost,
              the checks' own time by rank 0's clock (the recomputed passes, the digests,
              the exchange) over the run's wall time, inside the one run;
- wrong:      rank 1 computes wrong gradients from step S on (`wrong:` fault) with
              --recompute-every K: steps until it is found (the next check step);
- flip_grad, flip_param, flip_optim: 1 warm spare, one bit of rank 1's reduced
              gradients / parameters / optimizer state flipped at step S (`flip:` fault):
              steps until it is found, and whether the run still ends on `clean`'s digest.

Throughput is steps per second from the first completed step to the last; each faulted
mode against `clean` (goal with a spare: >= 0.9x). Detection latency: steps from the
slow fault to the `straggler` event, or from the flip to the `fingerprint_mismatch` event.
The fingerprints' cost: the throughput lost against `nofp`, at the default
--fingerprint-every 1 (goal <= 0.5%) and at 8; and, by rank 0's clock inside its step,
the seal's and the digests' own compute and the wait for the vote's all-reduce (which
replaces part of the wait at the all-gather) over the median step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.overhead import paired_blocks
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal, as_dicts, print_goals

MODES = ("clean", "nofp", "fp_blocks", "fp_blocks_sep", "k8", "slow", "swap", "rebalance", "noisy",
         "noisy2", "freeze", "recompute", "wrong", "flip_grad", "flip_param", "flip_optim")
NOISY = {"noisy": 1, "noisy2": 2}  # mode -> busy processes beside it
FREEZE = "ms=150:period=250"
GOAL_SWAP = 0.9
GOAL_VOTE = 0.005
GOAL_RECOMPUTE = 0.01
FP_BLOCK = 2  # steps per on / off block of the fp_blocks modes
BLOCKS = ("fp_blocks", "fp_blocks_sep")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("consensus", help="stragglers: throughput with swap / rebalance / "
                                         "nothing against failure-free, false alarms",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "ref"])
    p.add_argument("--steps", type=int, default=300,
                   help="steps of each run (the faults' one-time costs are paid once)")
    p.add_argument("--microbatches", type=int, default=12)
    p.add_argument("--slow-step", type=int, default=10, help="S: rank 1 is slow from here on")
    p.add_argument("--factor", type=float, default=4.0, help="F: how many times slower")
    p.add_argument("--window", type=int, default=10, help="--straggler-window of the jobs")
    p.add_argument("--recompute-every", type=int, default=100,
                   help="K of the recompute and wrong modes")
    p.add_argument("--noisy-steps", type=int, default=300,
                   help="steps of the failure-free runs beside busy processes")
    p.add_argument("--out", default="runs/bench/consensus.json")
    p.set_defaults(func=command(measure, show))


def _job(root: Path, mode: str, args: argparse.Namespace) -> dict:
    steps = args.noisy_steps if mode in NOISY else args.steps
    cfg: dict = {"nproc": args.nproc, "stragglers": {"window": args.window}}
    if mode in ("nofp", "k8"):
        cfg["fingerprints"] = {"every": 0 if mode == "nofp" else 8}
    if mode in BLOCKS:
        cfg["fingerprints"] = {"every": 1, "blocks": FP_BLOCK,
                               "vote": "separate" if mode == "fp_blocks_sep" else "carried"}
    if mode.startswith("flip_"):
        cfg.update(spares=1, inject=[f"flip:rank=1:step={args.slow_step}:where={mode[5:]}"])
    if mode in ("recompute", "wrong"):
        cfg["fingerprints"] = {"recompute_every": args.recompute_every}
        cfg.update(spares=1)
    if mode == "wrong":
        cfg["inject"] = [f"wrong:rank=1:step={args.slow_step}"]
    if mode == "freeze":
        cfg["inject"] = [f"freeze:rank=1:step={args.slow_step}:{FREEZE}"]
    if mode in ("slow", "swap", "rebalance"):
        cfg["inject"] = [f"slow:rank=1:step={args.slow_step}:factor={args.factor}"]
    if mode == "swap":
        cfg.update(spares=1)
        cfg["stragglers"]["action"] = "swap"
    if mode == "rebalance":
        cfg["stragglers"]["action"] = "rebalance"
    noisy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(NOISY.get(mode, 0))]
    try:
        s = run_job(root / mode, script_args=["--steps", str(steps), "--preset", args.preset,
                                              "--data", "ids", "--threads", "1",
                                              "--microbatches", str(args.microbatches)], **cfg)
    finally:
        for busy in noisy:
            busy.kill()
            busy.wait()
    steps_ev = [e for e in s["events"] if e["event"] == "step"]
    first, last = steps_ev[0], steps_ev[-1]
    gaps = [b["t"] - a["t"] for a, b in zip(steps_ev, steps_ev[1:])]
    votes = [e.get("vote_s", 0.0) + e.get("seal_s", 0.0) for e in steps_ev[1:]]
    digests = [e.get("digest_s", 0.0) + e.get("seal_s", 0.0) for e in steps_ev[1:]]
    found = [e for e in s["events"] if e["event"] == "straggler"]
    blocks = paired_blocks(s["events"], FP_BLOCK) if mode in BLOCKS else None
    if blocks:  # the fingerprints' CPU on rank 0's training thread (waits excluded)
        blocks.update(fp_cpu_blocks(steps_ev))
    sdc = [e["step"] for e in s["events"]
           if e["event"] in ("fingerprint_mismatch", "recompute_mismatch")]
    return {"mode": mode, "steps": last["step"], "wall_s": round(last["t"] - first["t"], 3),
            "steps_s": (last["step"] - first["step"]) / (last["t"] - first["t"]),
            "stragglers": [{"rank": e["rank"], "step": e["step"], "ratio": e["ratio"],
                            "why": e.get("why")} for e in found],
            "swapped": [e["wid"] for e in s["events"] if e["event"] == "straggler_swapped"],
            "sdc_found_at": sdc, "quarantined": s.get("quarantined", []),
            "failures": len(s["failures"]), "digest": s["final_state_digest"],
            "check_share": sum(e.get("check_s", 0.0) for e in steps_ev[1:]) / (last["t"] - first["t"]),
            "median_step_s": statistics.median(gaps), "mean_check_s": statistics.fmean(votes),
            "mean_digest_s": statistics.fmean(digests),
            **({"blocks": blocks} if blocks else {})}


def fp_cpu_blocks(steps_ev: list[dict]) -> dict:
    """Median `fp_cpu_s` (the fingerprints' own time by rank 0's thread CPU clock: on a
    machine with fewer cores than processes the steadier figure, as no wait is in it) of
    the on and the off steps of an `fp_blocks` run, in microseconds."""
    from phoenixft.config import Fingerprints
    from phoenixft.train.fingerprints import off_block  # (torch: not at the CLI's start-up)
    cfg, on, off = Fingerprints(every=1, blocks=FP_BLOCK), [], []
    for e in steps_ev[2 * FP_BLOCK:]:
        (off if off_block(cfg, e["step"]) else on).append(e.get("fp_cpu_s", 0.0))
    return {"fp_cpu_on_us": statistics.median(on) * 1e6 if on else None,
            "fp_cpu_off_us": statistics.median(off) * 1e6 if off else None}


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    if args.nproc < 3 or not 1 < args.slow_step < args.steps or not args.factor > 1 \
            or not 0 < args.recompute_every <= args.steps:
        raise SystemExit("phoenixft bench consensus: --nproc >= 3 (a recomputed microbatch "
                         "is computed on 3 ranks), 1 < --slow-step < --steps, --factor > 1, "
                         "0 < --recompute-every <= --steps")
    root, t0 = opts.runs_dir("consensus"), time.time()
    rows = {}
    for mode in MODES:
        print(f"[consensus] {mode}", flush=True)
        rows[mode] = _job(root, mode, args)
    return {**summarize(rows, args), "wall_s": round(time.time() - t0, 1)}


def summarize(rows: dict, args: argparse.Namespace) -> dict:
    """The result from the runs' rows (`_job`): ratios, latencies, costs and goals."""
    clean = rows["clean"]["steps_s"]
    for r in rows.values():
        r["vs_clean"] = r["steps_s"] / clean
        # what the fault cost once, in seconds: a longer run pays it once too
        r["extra_s"] = round(r["wall_s"] - (r["steps"] - 1) / clean, 3)
        named = [x["step"] for x in r["stragglers"] if x["rank"] == 1] + r["sdc_found_at"]
        r["detected_after_steps"] = (named[0] - args.slow_step
                                     if named and r["mode"] not in NOISY else None)
        r["digest_as_clean"] = r["digest"] == rows["clean"]["digest"]
    noisy = [rows[m] for m in NOISY]
    result = {"benchmark": "consensus", "nproc": args.nproc, "threads_per_worker": 1,
              "preset": args.preset, "microbatches": args.microbatches, "factor": args.factor,
              "slow_step": args.slow_step, "window": args.window, "rows": rows,
              "false_alarms_per_1000_steps": (1000 * sum(len(r["stragglers"]) for r in noisy)
                                              / sum(r["steps"] for r in noisy)),
              "false_alarms": {m: len(rows[m]["stragglers"]) for m in NOISY},
              # what fingerprints cost: throughput lost against the twin run without them
              # (the vote's wait replaces part of the all-gather's, so its own clock says
              # little); and the seal's and digests' own compute, timed inside the step
              "fingerprint_cost": 1 - rows["clean"]["steps_s"] / rows["nofp"]["steps_s"],
              "fingerprint_cost_k8": 1 - rows["k8"]["steps_s"] / rows["nofp"]["steps_s"],
              # the same inside one run: on/off blocks (the goal's figure)
              "fingerprint_cost_in_run": rows["fp_blocks"]["blocks"]["ratio"] - 1,
              "fingerprint_cost_in_run_se": rows["fp_blocks"]["blocks"]["se"],
              "fingerprint_cpu_us": (rows["fp_blocks"]["blocks"].get("fp_cpu_on_us") or 0.0)
              - (rows["fp_blocks"]["blocks"].get("fp_cpu_off_us") or 0.0),
              "fingerprint_cost_in_run_separate": rows["fp_blocks_sep"]["blocks"]["ratio"] - 1,
              "fingerprint_cost_in_run_separate_se": rows["fp_blocks_sep"]["blocks"]["se"],
              "recompute_every": args.recompute_every,
              "recompute_cost": rows["recompute"]["check_share"],
              "vote_wait_share_of_step": (rows["clean"]["mean_check_s"]
                                          / rows["clean"]["median_step_s"]),
              "digest_share_of_step": (rows["clean"]["mean_digest_s"]
                                       / rows["clean"]["median_step_s"])}
    result["goals"] = as_dicts(goals(result))
    return result


def goals(result: dict) -> list[Goal]:
    r = result["rows"]
    cost, se = result["fingerprint_cost_in_run"], result["fingerprint_cost_in_run_se"]
    return [Goal("fingerprints' cost, --fingerprint-every 1 (the default): step time on over "
                 f"off, {FP_BLOCK}-step blocks in one run (+ its standard error)",
                 f"<= {GOAL_VOTE:.1%}", f"{cost:.2%} +- {se:.2%}", cost + se <= GOAL_VOTE),
            Goal("straggler swapped for a spare: throughput vs failure-free",
                 f">= {GOAL_SWAP}x", f"{r['swap']['vs_clean']:.3f}x",
                 r["swap"]["vs_clean"] >= GOAL_SWAP),
            Goal("false alarms per 1,000 failure-free steps beside one and two busy "
                 "processes", "0", result["false_alarms_per_1000_steps"],
                 result["false_alarms_per_1000_steps"] == 0),
            Goal(f"recomputation's cost at K={result['recompute_every']} (its checks' time "
                 "over the run's, rank 0's clock)", f"<= {GOAL_RECOMPUTE:.0%}",
                 f"{result['recompute_cost']:.2%}", result["recompute_cost"] <= GOAL_RECOMPUTE),
            Goal("wrong gradients found by the recomputation (steps after the fault)",
                 f"<= {result['recompute_every']}", _after(r["wrong"]),
                 r["wrong"]["detected_after_steps"] is not None
                 and r["wrong"]["detected_after_steps"] <= result["recompute_every"]),
            Goal("a rank stopped 150 ms of every 250 ms named (steps after the first stop)",
                 f"<= {result['window']}", _after(r["freeze"]),
                 r["freeze"]["detected_after_steps"] is not None
                 and r["freeze"]["detected_after_steps"] <= result["window"]),
            Goal("a flipped bit (gradients, parameters, optimizer state) found and the run "
                 "ends on the failure-free digest", "3 of 3",
                 f"{sum(_sdc_ok(r[m]) for m in SDC)} of {len(SDC)}",
                 all(_sdc_ok(r[m]) for m in SDC))]


SDC = ("flip_grad", "flip_param", "flip_optim")


def _after(row: dict) -> str:
    return "not named" if row["detected_after_steps"] is None else str(row["detected_after_steps"])


def _sdc_ok(row: dict) -> bool:
    return row["detected_after_steps"] is not None and row["digest_as_clean"] \
        and row["detected_after_steps"] <= 1


def headline(result: dict) -> str:
    r = result["rows"]
    return (f"rank 1 {result['factor']:g}x slower: throughput vs failure-free "
            f"{r['slow']['vs_clean']:.2f}x reported only, {r['swap']['vs_clean']:.2f}x "
            f"swapped for a spare, {r['rebalance']['vs_clean']:.2f}x rebalanced; "
            f"rank 1 frozen 150 ms of every 250 ms named {_after(r['freeze'])} steps after; "
            f"{result['false_alarms_per_1000_steps']:g} false alarms per 1,000 steps beside "
            f"one and two busy processes; fingerprints cost "
            f"{result['fingerprint_cost_in_run']:.1%} (+- "
            f"{result['fingerprint_cost_in_run_se']:.1%}) of a step")


def show(result: dict, opts: BenchOptions) -> None:
    table = Table(title=f"stragglers: {result['nproc']} workers x 1 torch thread, "
                        f"{result['preset']} preset, {result['microbatches']} microbatches a "
                        f"step; rank 1 {result['factor']:g}x slower from step "
                        f"{result['slow_step']} (window {result['window']})")
    for col in ("mode", "steps/s", "vs failure-free", "extra s", "named (steps after the fault)",
                "swapped / quarantined", "failures", "digest as clean"):
        table.add_column(col)
    for r in result["rows"].values():
        after = r["detected_after_steps"]
        table.add_row(r["mode"], f"{r['steps_s']:.2f}", f"{r['vs_clean']:.3f}x",
                      f"{r['extra_s']:.2f}", "-" if after is None else str(after),
                      ", ".join(r["quarantined"]) or "-", str(r["failures"]),
                      "yes" if r["digest_as_clean"] else "no")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    r0 = result["rows"]["clean"]
    console.print(f"false alarms: {result['false_alarms_per_1000_steps']:g} per 1,000 steps "
                  f"({result['rows']['noisy']['steps']} failure-free steps beside one busy "
                  f"process, {result['rows']['noisy2']['steps']} beside two); fingerprints: "
                  f"{result['fingerprint_cost_in_run']:.2%} +- "
                  f"{result['fingerprint_cost_in_run_se']:.2%} of a step on/off in one run "
                  f"(carried; separate: {result['fingerprint_cost_in_run_separate']:.2%} +- "
                  f"{result['fingerprint_cost_in_run_separate_se']:.2%}; carried, rank 0's "
                  f"thread CPU: {result.get('fingerprint_cpu_us', 0):.0f} us a step), "
                  f"{result['fingerprint_cost']:.2%} of throughput at "
                  f"K=1, {result['fingerprint_cost_k8']:.2%} at K=8 (each against the run "
                  f"without, one run each); by rank 0's clock the seal and digests take "
                  f"{result['digest_share_of_step']:.3%} of a {r0['median_step_s'] * 1e3:.1f} ms "
                  f"step, and waiting for the vote {result['vote_wait_share_of_step']:.2%} "
                  f"(in place of part of the all-gather's wait); recomputation every "
                  f"{result['recompute_every']} steps: {result['recompute_cost']:.2%} of the "
                  f"run's time by rank 0's clock")
    print_goals(console, goals(result))


def markdown(result: dict) -> list[str]:
    rows = ["| mode | steps/s | vs failure-free | extra s | named (steps after the fault) | "
            "swapped / quarantined | digest as clean |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"].values():
        rows.append(f"| {r['mode']} | {r['steps_s']:.2f} | {r['vs_clean']:.3f}x | "
                    f"{r['extra_s']:.2f} | "
                    f"{r['detected_after_steps'] if r['detected_after_steps'] is not None else '-'}"
                    f" | {', '.join(r['quarantined']) or '-'} | "
                    f"{'yes' if r['digest_as_clean'] else 'no'} |")
    return rows + ["", f"False alarms: {result['false_alarms_per_1000_steps']:g} per 1,000 "
                       "failure-free steps beside one and two busy processes. Fingerprints cost "
                       f"{result['fingerprint_cost_in_run']:.2%} +- "
                       f"{result['fingerprint_cost_in_run_se']:.2%} of a step on/off in one run "
                  f"(carried; separate: {result['fingerprint_cost_in_run_separate']:.2%} +- "
                  f"{result['fingerprint_cost_in_run_separate_se']:.2%}; carried, rank 0's "
                  f"thread CPU: {result.get('fingerprint_cpu_us', 0):.0f} us a step), "
                       f"{result['fingerprint_cost']:.2%} of throughput at K=1 and "
                       f"{result['fingerprint_cost_k8']:.2%} at K=8 against the run without; "
                       f"the seal and digests' own compute is {result['digest_share_of_step']:.3%}"
                       f" of a step. Recomputation every {result['recompute_every']} steps: "
                       f"{result['recompute_cost']:.2%} of the run's time (its checks by rank "
                       "0's clock)."]

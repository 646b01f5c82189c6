"""`phoenixft bench torchft`: torchft 0.2.0 and phoenixft side by side, one process tree.

Both train the same model (`--preset`) on the same microbatches (M per step, computed as
pure functions of (step, id)) with 2 data-parallel members at 1 torch thread each:
- plain DDP under torchrun, failure-free: the step time both are compared with;
- phoenixft: 2 workers + 1 warm spare (`phoenixft run --data ids`), failure-free, then with
  worker 1 SIGKILLed at `--kill-step`;
- torchft: 2 replica groups of 1 process (`Manager` + `OptimizerWrapper`, lighthouse on
  loopback, see `torchft_job`), failure-free, then with replica group 1 SIGKILLed at the
  same step and restarted at once by this process (as torchelastic would).

Figures per faulty run: kill -> the survivor's next committed step (survivor stall), kill
-> back to full strength (phoenixft: the spare's first step; torchft: the restarted
replica's first committed step), steps whose update was thrown away, and microbatches
not trained on (torchft's survivor trains on its own share only while its peer is down).

With `--hsdp S` the job is HSDP instead: 2 replica groups of S FSDP2 ranks, phoenixft's
group leaving and coming back against torchft's group restarted (torchft_hsdp.py).

torchft is an optional dependency (`pip install -e '.[torchft]'`, on the same CPU torch
2.13.0; the test extra has it), or lives in an environment of its own named by `--python`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from phoenixft.bench.goodput_jobs import TorchrunJob, Workload
from phoenixft.bench.harness import ROOT, run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.recovery import measure_events
from phoenixft.bench.runner import command
from phoenixft.bench.torchft_figures import plain_step_s, run_pair, torchft_fault
from phoenixft.bench.torchft_run import TorchftRun
from phoenixft.observe.goals import Goal, as_dicts, print_goals


def default_python() -> str:
    """$PHOENIXFT_TORCHFT_PYTHON, else this interpreter if torchft is installed beside
    phoenixft (`pip install -e '.[torchft]'`), else .venv-torchft/bin/python."""
    if os.environ.get("PHOENIXFT_TORCHFT_PYTHON"):
        return os.environ["PHOENIXFT_TORCHFT_PYTHON"]
    if importlib.util.find_spec("torchft") is not None:
        return sys.executable
    return str(ROOT / ".venv-torchft" / "bin" / "python")

INSTALL = ("pip install -e '.[torchft]' (torchft beside phoenixft, on the same CPU torch), or "
           "python3 -m venv .venv-torchft && .venv-torchft/bin/pip install torch==2.13.0 numpy "
           "'opentelemetry-sdk>=1.39' 'opentelemetry-exporter-otlp-proto-http>=1.39' && "
           ".venv-torchft/bin/pip install --no-deps torchft==0.2.0")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("torchft", help="torchft 0.2.0 beside phoenixft: same job, same kill")
    p.add_argument("--python", default=None,
                   help="the interpreter of an environment with torchft 0.2.0 (default: "
                        "$PHOENIXFT_TORCHFT_PYTHON, this one if it has torchft, else "
                        ".venv-torchft/bin/python)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--kill-step", type=int, default=12)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0,
                   help="seconds without a heartbeat before a member is declared dead (both)")
    p.add_argument("--free-runs", action=argparse.BooleanOptionalAction, default=True,
                   help="failure-free runs of both for the step time (--no-free-runs: the "
                        "median step before the kill instead; quicker, for smoke tests)")
    p.add_argument("--hsdp", type=int, default=0, metavar="S",
                   help="HSDP: 2 replica groups of S FSDP2 ranks (examples/train_fsdp.py's "
                        "model, one microbatch per rank), group 1's last rank killed; 0: DDP")
    p.add_argument("--out", default="runs/bench/torchft.json")
    p.set_defaults(func=command(measure, show))


def torchft_version(python: str) -> str:
    """torchft's version in `python`'s environment, or SystemExit saying how to make one."""
    try:
        out = subprocess.run([python, "-c", "import importlib.metadata as m, torch, torchft; "
                              "print(m.version('torchft'), torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    except OSError as exc:
        raise SystemExit(f"phoenixft bench torchft: cannot run {python} ({exc}); make a torchft "
                         f"environment with:\n  {INSTALL}\nor name one with --python") from None
    if out.returncode != 0:
        raise SystemExit(f"phoenixft bench torchft: {python} cannot import torchft:\n"
                         f"{out.stderr.strip()[-600:]}\nmake one with:\n  {INSTALL}")
    return out.stdout.strip()


def phoenix_fault(events: list[dict]) -> dict:
    """bench recovery's figures, named as torchft's are: the spare's first step is also
    the survivor's (both are in the step the job resumes with)."""
    m = measure_events(events)
    return {"kill_to_survivor_step_s": m["kill_to_next_step_s"],
            "kill_to_full_strength_s": m["kill_to_next_step_s"],
            "restart_to_ready_s": None,  # the spare was warm before the kill
            "detect_s": m["detect_s"], "recover_s": m["recover_s"],
            "lost_steps": m["lost_steps"], "steps_short_of_data": 0,
            "microbatches_not_trained": 0}


def _ddp_step_s(root: Path, work: Workload) -> float:
    """Plain DDP under torchrun, failure-free: the median step (the reference for both)."""
    return plain_step_s(TorchrunJob(run_dir=root / "ddp", work=work, max_restarts=0,
                                    ckpt_every=10**9), "plain DDP")


def measure(opts: BenchOptions) -> dict:
    """Plain DDP, then both systems failure-free and with the same SIGKILL."""
    args = opts.own
    args.python = args.python or default_python()
    version = torchft_version(args.python)
    root = opts.runs_dir("torchft")
    work = Workload(preset=args.preset, steps=args.steps, microbatches=args.microbatches, nproc=2)
    t0 = time.time()
    if args.hsdp:
        return _hsdp(args, root, version, t0)
    print(f"torchft {version}; plain DDP (failure-free reference)", flush=True)
    ddp_step = _ddp_step_s(root, work)
    def phoenix(name: str, inject: list[str]) -> dict:
        return run_job(root / name, nproc=2, spares=1, inject=inject,
                       timeouts={"heartbeat_timeout_s": args.heartbeat_timeout},
                       script_args=[*work.script_args(), "--data", "ids"])

    def torchft(name: str, kill: int | None) -> TorchftRun:
        run = TorchftRun(args.python, root / name, work, kill_step=kill,
                         heartbeat_timeout_s=args.heartbeat_timeout)
        run.events = run.run()
        return run

    px_step, tf_step, px_kill, tf_kill = run_pair(args, phoenix, torchft, kill_rank=1)
    rows = {
        "phoenixft": {"step_s": round(px_step, 4), "step_ratio_vs_ddp": round(px_step / ddp_step, 4),
                      **phoenix_fault(px_kill["events"])},
        "torchft": {"step_s": round(tf_step, 4), "step_ratio_vs_ddp": round(tf_step / ddp_step, 4),
                    **torchft_fault(tf_kill.events, tf_kill.restarts, args.microbatches)},
    }
    result = {"benchmark": "torchft", "torchft_version": version, "preset": args.preset,
              "steps": args.steps, "microbatches": args.microbatches, "kill_step": args.kill_step,
              "step_time_from": "failure-free runs" if args.free_runs else "steps before the kill",
              "processes": "2 members x 1 torch thread each (+1 spare for phoenixft, +1 "
                           "lighthouse for torchft)",
              "ddp_step_s": round(ddp_step, 4), "rows": rows}
    result["goals"] = as_dicts(goals(result))
    return {**result, "wall_s": round(time.time() - t0, 1)}


def _hsdp(args: argparse.Namespace, root: Path, version: str, t0: float) -> dict:
    from phoenixft.bench.torchft_hsdp import runs

    if args.hsdp < 1 or args.kill_step < 2 or args.kill_step >= args.steps:
        raise SystemExit(f"phoenixft bench torchft: --hsdp {args.hsdp} must be >= 1 and "
                         f"--kill-step {args.kill_step} within (1, --steps {args.steps})")
    print(f"torchft {version}; HSDP 2 x {args.hsdp}; plain torchrun (failure-free reference)",
          flush=True)
    result = {"benchmark": "torchft", "torchft_version": version, "preset": args.preset,
              "steps": args.steps, "kill_step": args.kill_step,
              "step_time_from": "failure-free runs" if args.free_runs else "steps before the kill",
              **runs(args, root)}
    result["goals"] = as_dicts(goals(result))
    return {**result, "wall_s": round(time.time() - t0, 1)}


COLUMNS = ["step_s", "step_ratio_vs_ddp", "kill_to_survivor_step_s", "kill_to_full_strength_s",
           "restart_to_ready_s", "lost_steps", "steps_short_of_data", "microbatches_not_trained"]


def show(result: dict, opts: BenchOptions) -> None:
    """Both systems' figures side by side, the DDP step, the goals."""
    console = Console(width=max(Console().width, 130))
    table = Table(title=f"torchft {result['torchft_version']} vs phoenixft "
                        f"({result.get('layout', 'ddp')}, {result['preset']} preset, "
                        f"{result['processes']}, kill at step {result['kill_step']}, loopback)")
    table.add_column("system")
    for c in COLUMNS:
        table.add_column(c.replace("_", " "))
    for name, r in result["rows"].items():
        table.add_row(name, *("-" if r[c] is None else str(r[c]) for c in COLUMNS))
    console.print(table)
    console.print(f"{result.get('reference', 'plain DDP')} step: {result['ddp_step_s']:.4f} s")
    if "how" in result["rows"]["phoenixft"]:
        console.print(f"phoenixft's recovery: {result['rows']['phoenixft']['how']}")
    print_goals(console, goals(result))


def goals(result: dict) -> list[Goal]:
    """phoenixft's survivor stall and time back to full strength no worse than torchft's,
    and no microbatch left untrained through the kill."""
    px, tf = result["rows"]["phoenixft"], result["rows"]["torchft"]
    return [
        Goal("survivor stall after a kill, phoenixft vs torchft", "<= torchft's",
             f"{px['kill_to_survivor_step_s']} s vs {tf['kill_to_survivor_step_s']} s",
             px["kill_to_survivor_step_s"] <= tf["kill_to_survivor_step_s"]),
        Goal("back to full strength after a kill, phoenixft vs torchft", "<= torchft's",
             f"{px['kill_to_full_strength_s']} s vs "
             f"{tf['kill_to_full_strength_s'] or 'not within the run'} s",
             tf["kill_to_full_strength_s"] is None
             or px["kill_to_full_strength_s"] <= tf["kill_to_full_strength_s"]),
        Goal("microbatches not trained on through a kill", "0",
             f"phoenixft {px['microbatches_not_trained']}, "
             f"torchft {tf['microbatches_not_trained']}",
             px["microbatches_not_trained"] == 0),
    ]


def headline(result: dict) -> str:
    p, t = result["rows"]["phoenixft"], result["rows"]["torchft"]
    return (f"SIGKILL -> survivor's next step: phoenixft {p['kill_to_survivor_step_s']:.2f} s, "
            f"torchft {t['kill_to_survivor_step_s']:.2f} s; back to full strength "
            f"{p['kill_to_full_strength_s']:.2f} s vs {t['kill_to_full_strength_s']} s; "
            f"microbatches not trained {p['microbatches_not_trained']} vs "
            f"{t['microbatches_not_trained']}; step time vs {_ref(result)} "
            f"{p['step_ratio_vs_ddp']:.2f}x vs {t['step_ratio_vs_ddp']:.2f}x")


def markdown(result: dict) -> list[str]:
    """Both systems' figures as a markdown table, for BENCHMARKS.md."""
    cols = [("step_s", "step s"), ("step_ratio_vs_ddp", f"step / {_ref(result)}"),
            ("kill_to_survivor_step_s", "kill -> survivor's next step s"),
            ("kill_to_full_strength_s", "kill -> full strength s"),
            ("lost_steps", "updates thrown away"),
            ("microbatches_not_trained", "microbatches not trained")]
    rows = ["| system | " + " | ".join(c for _, c in cols) + " |",
            "|---" * (len(cols) + 1) + "|"]
    for name, r in result["rows"].items():
        rows.append(f"| {name} | " + " | ".join(str(r[k]) for k, _ in cols) + " |")
    return rows + ["", f"torchft {result['torchft_version']}; {_ref(result)} step "
                   f"{result['ddp_step_s']} s; {result['processes']}."]


def _ref(result: dict) -> str:
    """What the step times are compared with: plain DDP, or plain torchrun on the HSDP mesh."""
    return "plain torchrun HSDP" if result.get("layout", "").startswith("hsdp") else "plain DDP"


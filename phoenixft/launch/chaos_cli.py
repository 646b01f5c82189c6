"""`phoenixft chaos`: `phoenixft run` with a seeded random schedule of N faults
(`faults/chaos.py`), for users to test their own jobs the way phoenixft's own soak test
does. Same run directory artifacts; the schedule is printed first and logged as the
run's `--inject` specs. With `--compare`, the same job then runs without faults and the
two final state digests are compared: the exit status says whether they are identical.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

from phoenixft.faults.chaos import ChaosConfig, schedule, spares_needed
from phoenixft.faults.inject import InjectSpecError
from phoenixft.launch.options import add_run_arguments, agent_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="phoenixft run with a seeded random schedule of faults",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--faults", type=int, required=True, help="how many faults")
    p.add_argument("--steps", type=int, required=True,
                   help="the job's length in steps (the script's own setting): faults land "
                        "inside it")
    p.add_argument("--microbatches-per-rank", type=int, default=1,
                   help="microbatches each rank computes per step (for mid-step faults)")
    p.add_argument("--compare", action="store_true",
                   help="then run the job without faults and compare the final states")
    add_run_arguments(p, spares_default=None)
    p.set_defaults(func=cmd_chaos)


def cmd_chaos(args) -> int:
    from phoenixft.launch.agent import Agent
    from phoenixft.launch.config import LaunchError
    from phoenixft.launch.torchrun import placement

    try:
        nproc, nnodes, _, _ = placement(args)
        specs = schedule(ChaosConfig(seed=args.seed, faults=args.faults, steps=args.steps,
                                     world_size=nproc * nnodes, nnodes=nnodes,
                                     microbatches_per_rank=args.microbatches_per_rank))
        if args.inject:
            raise LaunchError("chaos makes its own --inject schedule; use `phoenixft run` to "
                              "choose faults by hand")
        if args.spares is None:
            args.spares = spares_needed(specs, nproc)
        if args.replicas is None:  # corrupt faults need a copy beside the damaged one
            args.replicas = 1
        args.inject = [str(s) for s in specs]
        print(f"phoenixft chaos: seed {args.seed}, {len(specs)} faults, {args.spares} spares, "
              f"{args.replicas} replica(s):", flush=True)
        for s in specs:
            print(f"  {s}", flush=True)
        rc = Agent(agent_config_from_args(args)).run()
        if not args.compare or rc != 0:
            return rc
        ref = copy.copy(args)
        ref.inject, ref.spares, ref.run_dir = [], 0, f"{args.run_dir.rstrip('/')}-failure-free"
        print(f"phoenixft chaos: the same job without faults, in {ref.run_dir}", flush=True)
        if Agent(agent_config_from_args(ref)).run() != 0:
            return 1
    except (InjectSpecError, LaunchError, ValueError) as exc:
        print(f"phoenixft chaos: error: {exc}", file=sys.stderr)
        return 2
    a, b = (json.loads((Path(d) / "summary.json").read_text())["final_state_digest"]
            for d in (args.run_dir, ref.run_dir))
    print(f"phoenixft chaos: final state {'identical' if a == b else 'DIFFERENT'} "
          f"({a[:16]} vs {b[:16]} failure-free)", flush=True)
    return 0 if a == b else 1

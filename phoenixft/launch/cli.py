"""`phoenixft run`, `phoenixft demo` and `phoenixft status`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phoenixft.faults.inject import InjectSpecError
from phoenixft.launch.options import add_run_arguments, agent_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="launch a training script with warm spares (like torchrun)",
                         description="Start N workers and S warm spares of SCRIPT on this node.")
    add_run_arguments(run)
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="4 workers + 1 spare, one killed mid-run, live view")
    demo.add_argument("--steps", type=int, default=None)
    demo.add_argument("--run-dir", default="runs/demo")
    demo.set_defaults(func=_lazy("phoenixft.launch.demo", "cmd_demo"))

    st = sub.add_parser("status", help="print a run directory's status.json")
    st.add_argument("run_dir", nargs="?", default="runs/latest")
    st.add_argument("--watch", action="store_true",
                    help="follow the running job: members, step, loss, failures, until it ends")
    st.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    st.add_argument("--wait", type=float, default=60.0, metavar="S",
                    help="with --watch: how long to wait for a job to appear in RUN_DIR "
                         "(default 60 s)")
    st.set_defaults(func=cmd_status)


def _lazy(module: str, name: str):
    def call(args):
        import importlib
        return getattr(importlib.import_module(module), name)(args)
    return call


def cmd_run(args) -> int:
    from phoenixft.launch.config import LaunchError
    from phoenixft.launch.forkserver import ForkServer
    from phoenixft.launch.rundir import RunDirLock
    try:
        cfg = agent_config_from_args(args)
        lock = RunDirLock(Path(cfg.run_dir), cfg.node_rank)  # a busy directory: refused now
        forks = None
        if cfg.start_method == "forkserver":  # before the agent's own imports: both at once
            forks = ForkServer(cfg.python, cfg.timeouts.startup_timeout_s)
        from phoenixft.launch.agent import Agent
        rc = Agent(cfg, forks, lock).run()
    except (InjectSpecError, LaunchError) as exc:
        print(f"phoenixft run: error: {exc}", file=sys.stderr)
        return 2
    _exit_now(rc)


def _exit_now(rc: int) -> None:
    """End the agent's process now that the job is over, as a worker ends: its `atexit`
    handlers run and its output is flushed, but the interpreter's teardown of torch's
    modules (0.5 s here, after every job) is skipped."""
    import atexit
    import os
    import traceback

    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failing handler must not hide the job's outcome
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed or full stream: nothing more to say)
            pass
    os._exit(rc)


def cmd_status(args) -> int:
    import math
    p = Path(args.run_dir) / "status.json"
    if not args.watch:
        if not p.exists():
            print(f"phoenixft status: no status.json in {args.run_dir}", file=sys.stderr)
            return 2
        try:
            st = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            print(f"phoenixft status: {p} cannot be read ({exc}); the job rewrites it while "
                  "it runs, and events.jsonl beside it has the whole account", file=sys.stderr)
            return 2
        print(json.dumps(st, indent=2))
        return 0
    for name in ("interval", "wait"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            print(f"phoenixft status: --{name} must be a number of seconds > 0, got {v}",
                  file=sys.stderr)
            return 2
    from phoenixft.launch.watch import watch
    return watch(Path(args.run_dir), args.interval, args.wait)

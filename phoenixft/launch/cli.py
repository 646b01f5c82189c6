"""`phoenixft run`, `phoenixft demo` and `phoenixft status`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from phoenixft.faults.inject import InjectSpecError, parse_spec


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



def add_run_arguments(run: argparse.ArgumentParser, spares_default: int | None = 0) -> None:
    """The options of `phoenixft run` (shared with `phoenixft chaos`)."""
    run.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", default=None,
                     metavar="N", help="active workers on this node: a number, or gpu / cpu / "
                                       "auto as torchrun takes them (default 1)")
    run.add_argument("--spares", type=int, default=spares_default,
                     help="warm spare workers on this node")
    run.add_argument("--max-local-workers", type=int, default=None, metavar="N",
                     help="the most workers (--nproc + --spares) this node may start (default: "
                          "32 per core, and no more than its free memory holds at 64 MiB each)")
    run.add_argument("--nnodes", type=int, default=None,
                     help="nodes of the job (default 1, or SLURM_NNODES under Slurm)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=None,
                     help="this node's index (default 0, or SLURM_NODEID under Slurm)")
    run.add_argument("--store", "--rdzv-endpoint", "--rdzv_endpoint", default=None,
                     help="HOST:PORT or [IPv6]:PORT of the job store (node 0 hosts it; default "
                          "127.0.0.1 and a free port; under Slurm the first host of the job's "
                          "node list)")
    run.add_argument("--master-addr", "--master_addr", default=None,
                     help="torchrun's spelling: the store host (with --master-port)")
    run.add_argument("--master-port", "--master_port", type=int, default=None,
                     help="torchrun's spelling: the store port (with --master-addr)")
    run.add_argument("--standalone", action="store_true",
                     help="a single-node job with a store on 127.0.0.1 (as torchrun's)")
    run.add_argument("-m", "--module", action="store_true",
                     help="SCRIPT is a module name, run as `python -m` would (as torchrun -m)")
    run.add_argument("--external-store", action="store_true",
                     help="the store at --store runs on its own (`phoenixft store`): no agent "
                          "hosts it, and another agent takes the lead if the leader's node dies")
    run.add_argument("--auth-token", default=None,
                     help="shared secret every agent proves to a store other hosts can reach "
                          "(or set PHOENIXFT_AUTH_TOKEN)")
    run.add_argument("--local-addr", default=None,
                     help="this host's address for the workers' process groups (default: the "
                          "address that routes to the store, or GLOO_SOCKET_IFNAME's)")
    run.add_argument("--run-dir", default="runs/latest")
    run.add_argument("--inject", action="append", default=[], metavar="SPEC",
                     help="fault to inject, e.g. kill:rank=1:step=20 or stop:rank=0:step=5")
    run.add_argument("--heartbeat-timeout", type=float, default=3.0,
                     help="seconds of heartbeat silence after which a worker counts as hung")
    run.add_argument("--replicas", type=int, default=None,
                     help="peers holding a copy of each rank's snapshot (default: one on another "
                          "node, none in a one-node job, whose snapshots outlive their workers in "
                          "the node's shared memory anyway); K: K peers, on other nodes first, "
                          "then on this node (a copy there guards against a damaged slot file)")
    run.add_argument("--min-nproc", type=int, default=None,
                     help="when no spare is left, go on with the survivors down to this many "
                          "ranks, keeping every step's microbatches (ReCoVer); default: stop")
    run.add_argument("--policy", default="constant", choices=["constant", "shrink-batch"],
                     help="microbatches per step after a shrink: constant (same gradients as "
                          "a failure-free run) or shrink-batch (fewer: the batch shrinks)")
    run.add_argument("--respawn", type=int, default=0,
                     help="replacement workers this agent may start; they grow the job back")
    run.add_argument("--persist", default=None, metavar="URL",
                     help="persist every rank's snapshots to a directory or s3://bucket/prefix "
                          "in the background (bases + deltas, a manifest commits each step)")
    run.add_argument("--persist-every", type=int, default=10, metavar="K",
                     help="a base record every K records, deltas in between (a record is "
                          "taken every stride-th step, see --persist-cpu-share)")
    run.add_argument("--persist-keep", type=int, default=2, metavar="N",
                     help="bases kept in storage (with their deltas and manifests)")
    run.add_argument("--persist-cpu-share", type=float, default=0.05, metavar="F",
                     help="the share of one core each rank's background persister may use on "
                          "average (default 0.05); steps offered while it rests are merged "
                          "into the next record, so storage lags further behind instead of "
                          "training slowing down (1: persist every step it can)")
    run.add_argument("--resume", action="store_true",
                     help="continue the job whose checkpoints are in --persist URL from its "
                          "newest committed step")
    run.add_argument("--metrics-port", type=int, default=None, metavar="P",
                     help="serve Prometheus metrics of the run (steps, step time, failures, "
                          "recovery time, spares, snapshots) on this port")
    run.add_argument("--metrics-host", default="127.0.0.1",
                     help="address for --metrics-port (default 127.0.0.1)")
    run.add_argument("--start-method", default="forkserver", choices=["forkserver", "spawn"],
                     help="forkserver (default): workers are forks of one process per node "
                          "that imported torch once; spawn: each a fresh interpreter")
    run.add_argument("--quiet", action="store_true",
                     help="only failures and the summary (no progress or recovery lines)")
    run.add_argument("--log-every", default="10", metavar="N|Ns",
                     help="a progress line every N steps (default 10) or every N seconds (30s)")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)


def _lazy(module: str, name: str):
    def call(args):
        import importlib
        return getattr(importlib.import_module(module), name)(args)
    return call


def agent_config_from_args(args):
    from phoenixft.launch.config import AgentConfig
    from phoenixft.launch.torchrun import placement
    specs = [parse_spec(s) for s in args.inject]
    nproc, nnodes, node_rank, store = placement(args)
    return AgentConfig(script=args.script, script_args=list(args.script_args),
                       module=args.module, nproc=nproc, spares=args.spares, nnodes=nnodes,
                       node_rank=node_rank, store=store,
                       external_store=args.external_store, auth_token=args.auth_token,
                       local_addr=args.local_addr, run_dir=args.run_dir,
                       inject=specs, heartbeat_timeout_s=args.heartbeat_timeout,
                       replicas=args.replicas, echo=not args.quiet, min_nproc=args.min_nproc,
                       policy=args.policy, respawn=args.respawn, persist=args.persist,
                       persist_every=args.persist_every, persist_keep=args.persist_keep,
                       persist_cpu_share=args.persist_cpu_share,
                       resume=args.resume, metrics_port=args.metrics_port,
                       metrics_host=args.metrics_host, start_method=args.start_method,
                       log_every=args.log_every, max_local_workers=args.max_local_workers)


def cmd_run(args) -> int:
    from phoenixft.launch.config import LaunchError
    from phoenixft.launch.forkserver import ForkServer
    from phoenixft.launch.rundir import RunDirLock
    try:
        cfg = agent_config_from_args(args)
        lock = RunDirLock(Path(cfg.run_dir), cfg.node_rank)  # a busy directory: refused now
        forks = None
        if cfg.start_method == "forkserver":  # before the agent's own imports: both at once
            forks = ForkServer(cfg.python, cfg.startup_timeout_s)
        from phoenixft.launch.agent import Agent
        return Agent(cfg, forks, lock).run()
    except (InjectSpecError, LaunchError) as exc:
        print(f"phoenixft run: error: {exc}", file=sys.stderr)
        return 2


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

"""The options of `phoenixft run` (and `phoenixft chaos`), one declaration each.

Each `Option` names its flags, the setting it fills in the config tree (a dotted path in
`AgentConfig`, phoenixft/config.py) and its help; its default is the tree's own. The
parser, the `AgentConfig` built from the parsed flags, and the flag names in every
configuration error all come from this one table, so an option is spelled in one place.
Options with no path (`--nproc`, `--store`, torchrun's spellings) are read together by
`torchrun.placement`, which also looks at Slurm's environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from phoenixft.config import ConfigError, build, default_of
from phoenixft.faults.inject import parse_spec
from phoenixft.launch.config import AgentConfig, LaunchError


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    path: str | None  # where in AgentConfig; None: read by torchrun.placement
    help: str
    kw: dict[str, Any] = field(default_factory=dict)  # argparse's type, metavar, choices, action

    @property
    def dest(self) -> str:
        """argparse's attribute: the first long flag's name (as argparse would pick)."""
        long = next(f for f in self.flags if f.startswith("--"))
        return long.lstrip("-").replace("-", "_")


def _opt(*flags: str, path: str | None = None, help: str, **kw: Any) -> Option:
    return Option(flags, path, help, kw)


PLACEMENT = (
    _opt("--nproc", "--nproc-per-node", "--nproc_per_node", metavar="N",
         help="active workers on this node: a number, or gpu / cpu / auto as torchrun takes "
              "them (default 1)"),
    _opt("--nnodes", type=int, help="nodes of the job (default 1, or SLURM_NNODES under Slurm)"),
    _opt("--node-rank", "--node_rank", type=int,
         help="this node's index (default 0, or SLURM_NODEID under Slurm)"),
    _opt("--store", "--rdzv-endpoint", "--rdzv_endpoint",
         help="HOST:PORT or [IPv6]:PORT of the job store (node 0 hosts it; default 127.0.0.1 "
              "and a free port; under Slurm the first host of the job's node list)"),
    _opt("--master-addr", "--master_addr",
         help="torchrun's spelling: the store host (with --master-port)"),
    _opt("--master-port", "--master_port", type=int,
         help="torchrun's spelling: the store port (with --master-addr)"),
    _opt("--standalone", action="store_true",
         help="a single-node job with a store on 127.0.0.1 (as torchrun's)"),
)

OPTIONS = (
    _opt("--spares", path="spares", type=int, help="warm spare workers on this node"),
    _opt("--max-local-workers", path="max_local_workers", type=int, metavar="N",
         help="the most workers (--nproc + --spares) this node may start (default: 32 per "
              "core, and no more than its free memory holds at 64 MiB each)"),
    _opt("-m", "--module", path="module", action="store_true",
         help="SCRIPT is a module name, run as `python -m` would (as torchrun -m)"),
    _opt("--external-store", path="external_store", action="store_true",
         help="the store at --store runs on its own (`phoenixft store`): no agent hosts it, "
              "and another agent takes the lead if the leader's node dies"),
    _opt("--auth-token", path="auth_token",
         help="shared secret every agent proves to a store other hosts can reach (or set "
              "PHOENIXFT_AUTH_TOKEN)"),
    _opt("--local-addr", path="local_addr",
         help="this host's address for the workers' process groups (default: the address "
              "that routes to the store, or GLOO_SOCKET_IFNAME's)"),
    _opt("--run-dir", path="run_dir", help="where the run's events, status and summary go"),
    _opt("--inject", path="inject", action="append", metavar="SPEC",
         help="fault to inject, e.g. kill:rank=1:step=20 or stop:rank=0:step=5"),
    _opt("--heartbeat-timeout", path="timeouts.heartbeat_timeout_s", type=float,
         help="seconds of heartbeat silence after which a worker counts as hung"),
    _opt("--replicas", path="snapshots.replicas", type=int,
         help="peers holding a copy of each rank's snapshot (default: one on another node, "
              "none in a one-node job, whose snapshots outlive their workers in the node's "
              "shared memory anyway); K: K peers, on other nodes first, then on this node (a "
              "copy there guards against a damaged slot file)"),
    _opt("--min-nproc", path="min_nproc", type=int,
         help="when no spare is left, go on with the survivors down to this many ranks, "
              "keeping every step's microbatches (ReCoVer); default: stop"),
    _opt("--policy", path="policy", choices=["constant", "shrink-batch"],
         help="microbatches per step after a shrink: constant (same gradients as a "
              "failure-free run) or shrink-batch (fewer: the batch shrinks)"),
    _opt("--straggler", path="stragglers.action", choices=["off", "report", "swap", "rebalance"],
         help="a rank that makes the others wait, step after step: report (an event "
              "and a console line; the default), swap (also hand its rank to a spare at the "
              "next committed step; nothing is rolled back), rebalance (give it fewer of each "
              "step's microbatches, in proportion to its speed: same M, same gradients; data "
              "parallel only) or off"),
    _opt("--straggler-ratio", path="stragglers.ratio", type=float, metavar="R",
         help="a rank is slow when its compute per step is R times the other ranks' median "
              "or more (default 2) on three in four of its last --straggler-window steps, "
              "or when its process stood still (stopped, frozen) long enough, on two steps "
              "or more, for those steps to take R times as long"),
    _opt("--straggler-window", path="stragglers.window", type=int, metavar="N",
         help="steps a straggler's ratio is watched over (default 20)"),
    _opt("--fingerprint-every", path="fingerprints.every", type=int, metavar="K",
         help="every K steps the ranks vote on digests of the reduced gradients and "
              "their parameters (data parallel, HSDP's replica groups, tensor parallelism's "
              "tp copies; see --fingerprint-vote), and every step each rank checks its "
              "optimizer shard against its last snapshot's seal; a rank found is replaced "
              "like a dead one (default 1; 0: off)"),
    _opt("--fingerprint-vote", path="fingerprints.vote", choices=["carried", "separate"],
         help="carried (default): each rank's digests ride in the next step's own "
              "all-reduce, no synchronisation of their own; a difference found there rolls "
              "the job back to the step before the one it came from (with a strict majority "
              "the rank named is replaced as well). separate: one more tiny all-reduce after "
              "each voted step's, before its update (with 2 ranks the step's collectives are "
              "replayed to name the one that differs)"),
    _opt("--recompute-every", path="fingerprints.recompute_every", type=int, metavar="K",
         help="every K steps each rank also recomputes the first microbatch of the two "
              "ranks before it and the three gradients of each are compared before the "
              "update: a rank whose arithmetic is off (which every rank would sum alike) is "
              "named and replaced like a dead one (data parallel, 3 ranks or more, data drawn "
              "from microbatch ids; default 0: off)"),
    _opt("--rebuild-groups", path="groups.keep", action="store_false",
         help="rebuild every process group at every recovery (default: a recovery keeps "
              "the mesh groups it finds whole, e.g. the FSDP2 groups of the replica groups "
              "that lost nobody, and rebuilds only the rest)"),
    _opt("--respawn", path="respawn", type=int,
         help="replacement workers this agent may start; they grow the job back"),
    _opt("--persist", path="persistence.url", metavar="URL",
         help="persist every rank's snapshots to a directory or s3://bucket/prefix in the "
              "background (bases + deltas, a manifest commits each step)"),
    _opt("--persist-every", path="persistence.every", type=int, metavar="K",
         help="a base record every K records, deltas in between (a record is taken every "
              "stride-th step, see --persist-cpu-share)"),
    _opt("--persist-keep", path="persistence.keep", type=int, metavar="N",
         help="bases kept in storage (with their deltas and manifests)"),
    _opt("--persist-cpu-share", path="persistence.cpu_share", type=float, metavar="F",
         help="the share of one core each rank's background persister may use on average; "
              "steps offered while it rests are merged into the next record, so storage "
              "lags further behind instead of training slowing down (1: persist every step "
              "it can)"),
    _opt("--resume", path="persistence.resume", action="store_true",
         help="continue the job whose checkpoints are in --persist URL from its newest "
              "committed step"),
    _opt("--init-from", path="persistence.init_from", metavar="DIR",
         help="start a new job from a checkpoint in torch.distributed.checkpoint's default "
              "format (a .metadata file and .distcp shards: phoenixft's final checkpoint, "
              "torchtitan's, or dcp.save of torchtitan's keys): the sharded model's "
              "parameters, its optimizer state and the step (train_state.step)"),
    _opt("--metrics-port", path="metrics_port", type=int, metavar="P",
         help="serve Prometheus metrics of the run (steps, step time, failures, recovery "
              "time, spares, snapshots) on this port"),
    _opt("--metrics-host", path="metrics_host", help="address for --metrics-port"),
    _opt("--start-method", path="start_method", choices=["forkserver", "spawn"],
         help="forkserver: workers are forks of one process per node that imported torch "
              "once; spawn: each a fresh interpreter"),
    _opt("--quiet", path="echo", action="store_false",
         help="only failures and the summary (no progress or recovery lines)"),
    _opt("--log-every", path="log_every", metavar="N|Ns",
         help="a progress line every N steps or every N seconds (30s)"),
)

# settings named in errors that have no option of their own
_NAMES = {"nproc": "--nproc", "nnodes": "--nnodes", "node_rank": "--node-rank",
          "store": "--store"}


def flag_of(path: str) -> str:
    """How the CLI spells the setting at `path`: its first long flag."""
    for opt in OPTIONS:
        if opt.path == path:
            return next((f for f in opt.flags if f.startswith("--")), opt.flags[0])
    return _NAMES.get(path, path)


def add_run_arguments(parser: argparse.ArgumentParser, spares_default: int | None = 0) -> None:
    """The options above, then SCRIPT and its arguments. Defaults are the tree's
    (`spares_default` overrides --spares: `phoenixft chaos` sizes it itself)."""
    for opt in PLACEMENT:
        parser.add_argument(*opt.flags, dest=opt.dest, default=None if opt.kw.get("action")
                            != "store_true" else False, help=opt.help, **opt.kw)
    for opt in OPTIONS:
        default = default_of(AgentConfig, opt.path)
        if opt.path == "spares":
            default = spares_default
        elif opt.path == "inject":
            default = []
        elif opt.kw.get("action") == "store_false":
            default = True
        elif isinstance(default, str) and opt.kw.get("choices"):
            default = str(default)
        shown = default is not None and not isinstance(default, (bool, list))
        help = f"{opt.help} (default {default})" if shown and "default" not in opt.help \
            else opt.help
        parser.add_argument(*opt.flags, dest=opt.dest, default=default, help=help, **opt.kw)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)


def agent_config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The AgentConfig the parsed flags declare; a bad value is a LaunchError naming its
    flag."""
    from phoenixft.launch.torchrun import placement
    nproc, nnodes, node_rank, store = placement(args)
    tree: dict[str, Any] = {"script": args.script, "script_args": list(args.script_args),
                            "nproc": nproc, "nnodes": nnodes, "node_rank": node_rank,
                            "store": store}
    for opt in OPTIONS:
        value = getattr(args, opt.dest)
        if opt.path == "inject":
            value = [parse_spec(s) for s in value]
        node = tree
        *branches, leaf = opt.path.split(".")
        for b in branches:
            node = node.setdefault(b, {})
        node[leaf] = value
    try:
        return build(AgentConfig, tree)
    except ConfigError as exc:
        raise LaunchError(exc.render(flag_of)) from None

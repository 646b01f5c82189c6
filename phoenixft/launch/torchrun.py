"""Where a job runs, from torchrun's spellings or from Slurm's environment.

`phoenixft run` takes torchrun's flags beside its own (`--nproc-per-node`, `--node-rank`,
`--rdzv-endpoint`, `--master-addr/--master-port`, `--standalone`, `-m`). Under Slurm
(`SLURM_JOB_ID` and `SLURM_NNODES` set, one `phoenixft run` per node through `srun`)
no node flag is needed: the node count and index come from `SLURM_NNODES` and
`SLURM_NODEID`, and the store is on the first host of `SLURM_JOB_NODELIST` at
`MASTER_PORT`, or at 10000 + the last four digits of the job id (so two jobs on the same
nodes do not collide). Flags given on the command line win.
"""

from __future__ import annotations

import os
import re

from phoenixft.launch.config import LaunchError


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `gpu[003-005,007],cpu1` -> `gpu003`."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def nproc_value(text: str | None) -> int:
    if text is None:
        return 1
    if text.isdigit():
        return int(text)
    if text in ("gpu", "auto", "cpu"):
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and gpus == 0:
            raise LaunchError("--nproc-per-node gpu: this host has no GPU")
        return gpus if text != "cpu" and gpus else os.cpu_count() or 1
    raise LaunchError(f"--nproc must be a number or gpu / cpu / auto, got {text!r}")


def placement(args, env=os.environ) -> tuple[int, int, int, str | None]:
    """(nproc, nnodes, node_rank, store) from the flags, then Slurm, then defaults."""
    nproc = nproc_value(args.nproc)
    nnodes, node_rank, store = args.nnodes, args.node_rank, args.store
    if args.master_addr is not None or args.master_port is not None:
        if store is not None:
            raise LaunchError("give the store once: --store/--rdzv-endpoint or "
                              "--master-addr/--master-port")
        if args.master_addr is None or args.master_port is None:
            raise LaunchError("--master-addr and --master-port go together")
        host = args.master_addr
        store = f"[{host}]:{args.master_port}" if ":" in host else f"{host}:{args.master_port}"
    if args.standalone:
        if (nnodes or 1) != 1 or store is not None:
            raise LaunchError("--standalone is a single-node job with its own store: drop "
                              "--nnodes/--store")
        return nproc, 1, 0, None
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env and int(env["SLURM_NNODES"]) > 1:
        nnodes = nnodes if nnodes is not None else int(env["SLURM_NNODES"])
        node_rank = node_rank if node_rank is not None else int(env.get("SLURM_NODEID", "0"))
        if store is None:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise LaunchError("under Slurm without SLURM_JOB_NODELIST: pass --store HOST:PORT")
            port = env.get("MASTER_PORT") or str(10000 + int(env["SLURM_JOB_ID"][-4:]))
            store = f"{first_host(nodelist)}:{port}"
    return nproc, nnodes if nnodes is not None else 1, node_rank or 0, store

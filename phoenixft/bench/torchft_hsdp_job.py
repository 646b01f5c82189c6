"""One rank of a torchft 0.2.0 HSDP replica group, for `phoenixft bench torchft --hsdp`.

Run under torchrun, one torchrun per replica group (`--nproc-per-node S`). FSDP2 shards
examples/train_fsdp.py's model (the Llama of `phoenixft.models.llama`, `fully_shard` per
block, then the root) over the group's own ("dp_shard",) mesh, and torchft averages the
gradients across the participating groups as torchtitan does with torchft: every
`FSDPModule`'s all-reduce hook runs an all-reduce over torchft's managed process group
(after FSDP2's reduce-scatter, inside backward). torchft 0.2.0 ships no managed device
mesh (`torchft.device_mesh` is not in its wheel), so this hook is its way to HSDP.

`Manager` + `OptimizerWrapper` as in torchft_job.py: `zero_grad` starts the quorum, the
update is applied only if `should_commit`; a group that (re)joins heals from a live one
over torchft's HTTP transport (each rank's local shards of the parameters and of AdamW's
state: every group shards the same way). Rank k of group r computes microbatch
j = r x S + k of each step, so with every group up a step consumes the same M = R x S
microbatches as phoenixft's job; a group that is down costs its S microbatches a step.
Group 0's rank 0 writes the events (start, ready, step, done); the rank that `--kill-at`
names SIGKILLs itself (first attempt only), and torchrun then stops its group.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_state(model, opt, params):
    """This rank's local shards of the model and of AdamW's state (what a healing group's
    rank at the same place needs). The shards are taken once, while every parameter is
    FSDP2's sharded DTensor: torchft calls these from its own thread, and
    `model.state_dict()` there would reshard the root's parameters under a running forward
    ("aten.mul.Tensor got mixed torch.Tensor and DTensor")."""
    shards = {name: _local(p.data) for name, p in model.named_parameters()}

    def state_dict() -> dict:
        return {"model": {k: v.detach().clone() for k, v in shards.items()},
                "optim": {str(i): {k: _local(v).clone() for k, v in opt.state[p].items()}
                          for i, p in enumerate(params) if p in opt.state}}

    def load_state_dict(sd: dict) -> None:
        with torch.no_grad():
            for k, v in shards.items():
                v.copy_(sd["model"][k])
        for i, p in enumerate(params):
            st = sd["optim"].get(str(i))
            if st is not None:
                opt.state[p] = {k: (DTensor.from_local(v.clone(), p.device_mesh, p.placements,
                                                       shape=p.shape, stride=p.stride())
                                    if v.dim() else v.clone()) for k, v in st.items()}
    return state_dict, load_state_dict


def main(argv: list[str] | None = None) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ManagedProcessGroup

    from phoenixft.bench.torchrun_baseline import BATCH
    from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset
    from phoenixft.observe.events import EventLog
    from phoenixft.train.data import MicrobatchWindows, stdlib_corpus

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, size = dist.get_rank(), dist.get_world_size()
    log = EventLog(args.events if rank == 0 else None, replica=args.replica, attempt=args.attempt)
    t_launch = log.emit("start", pid=os.getpid())["t"]
    cfg = preset(args.preset)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp_shard",))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    state_dict, load_state_dict = _shard_state(model, opt, params)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"hsdp_{args.replica}", lighthouse_addr=args.lighthouse,
                      hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    across = ManagedProcessGroup(manager)
    across.register("dp_replicate")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(lambda g: dist.all_reduce(g, group=across, op=dist.ReduceOp.AVG))
    optim = OptimizerWrapper(manager, opt)
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    log.emit("ready", init_s=round(time.time() - t_launch, 3))
    while args.go_file and not Path(args.go_file).exists():  # all groups start together
        time.sleep(0.02)
    j = args.replica * size + rank
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        if args.kill_at == step and args.attempt == 0 and rank == args.kill_rank:
            EventLog(args.events, replica=args.replica, attempt=args.attempt).emit(
                "inject", step=step, pid=os.getpid(), rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)
        optim.zero_grad()  # starts the quorum (async: it overlaps the forward pass)
        x, y = windows.get(step, j)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()  # reduce-scatter in the group, then the hook's cross-group mean
        committed = manager.should_commit()
        if committed:
            opt.step()
        log.emit("step", step=step, committed=committed, loss=float(loss.detach()),
                 participants=manager.num_participants(),
                 microbatches=size * manager.num_participants())
    log.emit("done", step=manager.current_step())
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--attempt", type=int, default=0)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL at this step (first "
                    "attempt only), the rank --kill-rank")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--go-file", default=None, help="start training once this file exists")
    ap.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()

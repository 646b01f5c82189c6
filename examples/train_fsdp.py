"""Train a small Llama-style model sharded with FSDP2, under phoenixft or plain torchrun.

    phoenixft run --nproc 4 --spares 1 examples/train_fsdp.py --steps 50
    phoenixft run --nproc 4 --spares 1 examples/train_fsdp.py --tp 2   # (2, 2) mesh
    phoenixft run --nproc 4 --min-nproc 2 examples/train_fsdp.py --dp-shard 2  # HSDP, 2 x 2
    torchrun --nproc-per-node 4 examples/train_fsdp.py --steps 50      # no phoenixft

The model is sharded the way torchtitan does it: `parallelize(model, mesh)` applies
tensor parallelism to each block's MLP over mesh["tp"] when --tp > 1 (gate and up
projections column-wise, the down projection row-wise), then calls `fully_shard` on every
decoder block over mesh["dp_shard"], then on the root. Under phoenixft the session gives
the mesh (("dp_shard",) over the job's ranks, or ("dp_shard", "tp") with groups of --tp
consecutive ranks) and owns the loop's failures:
a dead rank's spare takes its shards from a snapshot, the survivors keep their model and
optimizer objects, and training goes on. Under plain torchrun the same functions run
with torch's own process group and a mesh of its own, as the independent reference:
both print the same per-step losses, bit for bit (one microbatch per data-parallel rank and step).

A microbatch's data is a pure function of its id (step, j), so a replacement computes
exactly the data the dead rank would have.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset
from phoenixft.train.data import MicrobatchWindows, stdlib_corpus

BATCH = {"tiny": 4, "small": 8, "ref": 8}


def parallelize(model: LlamaForCausalLM, mesh, bf16: bool = False, dp_shard: int = -1) -> None:
    """Tensor parallelism over mesh["tp"] when the mesh has it, then FSDP2 over
    mesh["dp_shard"]: each decoder block is a unit, the root the last."""
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())
    names = mesh.mesh_dim_names
    # FSDP2 over the data-parallel dimensions: ("dp_shard",), or ("dp_replicate",
    # "dp_shard") for plain FSDP2's own HSDP under torchrun
    dp = mesh[tuple(n for n in names if n != "tp")] if "tp" in names else mesh
    if dp_shard not in (-1, mesh["dp_shard"].size() if len(names) > 1 else dp.size()):
        raise ValueError(f"--dp-shard {dp_shard}: the mesh's dp_shard dimension has "
                         f"{dp.size()} ranks (ranks / --tp); pass -1 to take it")
    for block in model.model.layers:
        if "tp" in names:
            # src_data_rank=None: every rank built the same weights (seeded), so each
            # takes its shard locally (a spare parallelizes alone, when it takes its rank)
            parallelize_module(block.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(),
                                                       "up_proj": ColwiseParallel(),
                                                       "down_proj": RowwiseParallel()},
                               src_data_rank=None)
        fully_shard(block, mesh=dp, mp_policy=mp)
    fully_shard(model, mesh=dp, mp_policy=mp)


def device_of(args) -> torch.device:
    """cuda: this worker's GPU (LOCAL_RANK modulo the GPUs visible)."""
    if args.device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def build(args):
    torch.manual_seed(args.seed)  # every rank builds the same initial parameters
    cfg = preset(args.preset)
    model = LlamaForCausalLM(cfg).to(device_of(args))
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    return model, windows


def optimizer(args):
    return lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def loss_of(model, windows, step: int, j: int) -> torch.Tensor:
    dev = next(model.parameters()).device
    x, y = (t.to(dev) for t in windows.get(step, j))
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def under_phoenixft(args) -> None:
    import phoenixft
    sess = phoenixft.Session()
    model, windows = build(args)
    sess.setup(model, optimizer(args), microbatches=args.microbatches, tp=args.tp,
               parallelize=lambda m, mesh: parallelize(m, mesh, args.bf16, args.dp_shard),
               dp_shard=None if args.dp_shard == -1 else args.dp_shard)
    for step in sess.steps(args.steps):
        for j in step.microbatches():
            step.backward(loss_of(model, windows, step.index, j))
        if args.clip:
            step.clip_grad_norm_(args.clip)  # the global norm over every rank's shards


def clip_reference(model, max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_`; with tensor parallelism over the MLPs only, the gradients
    live on two meshes, whose per-parameter norms torch's function cannot stack: the norm
    is then taken per mesh (reduced over its ranks) and the two combined, as torchtitan's
    clipping reduces a DTensor norm with `full_tensor()`. Meshes are told apart by value
    (`==`): FSDP2's units hold equal meshes that are distinct objects, and grouping them by
    object stacked more partial norms, a total different in the last bit."""
    from torch.distributed.tensor import DTensor
    params = [p for p in model.parameters() if p.grad is not None]
    meshes = {p.grad.device_mesh: None for p in params}  # (equal meshes are one: DeviceMesh's ==)
    if len(meshes) == 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    groups = [[p for p in params if p.grad.device_mesh == mesh] for mesh in meshes]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g]).full_tensor() for g in groups]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for g in groups:
        torch.nn.utils.clip_grads_with_norm_(g, max_norm, total)  # (takes the parameters)
    return total


def save_like_torchtitan(model, opt, step: int, where: str) -> None:
    """dcp.save of the state torchtitan's checkpointer saves: the model's keys at the top
    level, the optimizer's state dict flattened, the step (`phoenixft run --init-from`
    starts a job from such a directory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {**get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, opt, options=flat),
             "train_state": {"step": torch.tensor(step, dtype=torch.int32)}}
    dcp.save(state, checkpoint_id=where)


def under_torchrun(args) -> None:
    """The plain FSDP2 loop phoenixft is compared with: one microbatch per data-parallel
    rank and step (microbatch j = the rank's dp coordinate), FSDP2's own gradient average,
    AdamW on the DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo" if args.device == "cpu" else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, windows = build(args)
    if args.dp_shard not in (-1, world // args.tp):  # HSDP: FSDP2's own replicate dimension
        if args.tp != 1:
            raise SystemExit("this example's torchrun path runs HSDP without --tp")
        mesh = init_device_mesh(args.device, (world // args.dp_shard, args.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    elif args.tp == 1:
        mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh(args.device, (world // args.tp, args.tp),
                                mesh_dim_names=("dp_shard", "tp"))
    parallelize(model, mesh, args.bf16, args.dp_shard)
    dp_rank, tp_rank = divmod(rank, args.tp)  # (HSDP: the rank's place over both dp dims)
    opt = optimizer(args)([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for index in range(1, args.steps + 1):
        loss = loss_of(model, windows, index, dp_rank)
        loss.backward()
        if args.clip:
            norms.append(float(clip_reference(model, args.clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the step's mean loss as phoenixft reports it: each dp rank's loss summed over
        # the ranks in the float32 buffer of the step's all-reduce (a tp group counts once)
        total = loss.detach().double().float().reshape(1)  # (on the loss's device)
        if tp_rank:
            total.zero_()
        dist.all_reduce(total)
        losses.append(float(total) / (world // args.tp))
    if args.save_dcp:
        save_like_torchtitan(model, opt, args.steps, args.save_dcp)
    state = {}
    for name, p in model.named_parameters():  # the final state, as phoenixft digests it
        state[f"model.{name}"] = p.full_tensor().detach()
        for k, v in opt.state[p].items():
            state[f"optim.{k}.{name}"] = v.full_tensor() if v.dim() else v
    if rank == 0 and args.out:
        from phoenixft.train.digest import state_digest
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "final_state_digest": state_digest(state),
                       "grad_norms": norms}, f)
    dist.barrier()  # (a rank tearing gloo down while another still works may abort it)
    dist.destroy_process_group()
    # torch's C++ teardown at interpreter exit still aborted a rank now and then under the
    # test suite's load ("terminate called without an active exception", SIGABRT): leave
    # without it once everything is written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "ref"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel degree: a (ranks/tp, tp) mesh, the MLPs split over tp")
    ap.add_argument("--dp-shard", type=int, default=-1,
                    help="FSDP2's degree (torchtitan's flag): -1 (default) the ranks / tp; "
                         "under phoenixft a smaller N makes HSDP, replica groups of N x tp "
                         "ranks (a group is the unit of failure)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="under phoenixft: microbatches per step over all ranks (default one "
                         "per rank); keep it when resuming onto another number of ranks")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip gradients to this global norm (torchtitan's max_norm; 0: no clipping)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: this worker's GPU (the mesh's groups then use NCCL)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 parameters in compute, fp32 reduction (MixedPrecisionPolicy)")
    ap.add_argument("--save-dcp", default=None, metavar="DIR",
                    help="under plain torchrun: at the end, dcp.save the model, optimizer and "
                         "step as torchtitan's checkpointer lays them out")
    ap.add_argument("--out", default=None,
                    help="under plain torchrun: rank 0 writes the per-step losses and the final "
                         "state's digest here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if "PHOENIXFT_STORE" in os.environ:
        under_phoenixft(args)
    else:
        under_torchrun(args)


if __name__ == "__main__":
    main()

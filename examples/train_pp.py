"""Train a small Llama-style model with pipeline parallelism, the way torchtitan does it.

    torchrun --nproc-per-node 2 examples/train_pp.py --pp 2 --schedule 1f1b --out-dir pp2
    torchrun --nproc-per-node 4 examples/train_pp.py --pp 2 --dp 2 --out-dir pp2dp2
    python examples/train_pp.py --out-dir ref        # the same job unpipelined, one process

The model is split into --pp stages (`LlamaStage`: the first holds the embedding, each a
contiguous run of decoder layers, the last the norm and the output head; with
`--schedule interleaved` each rank holds two stages, rank s the stages s and s + pp). The
ranks form a (dp, pp) mesh: each of the --dp pipeline replicas runs its share of the
step's --microbatches through a `torch.distributed.pipelining` schedule (GPipe, 1F1B or
interleaved 1F1B), the replicas' gradients are averaged over the mesh's dp dimension, and
AdamW steps each stage's parameters. Clipping takes the global norm over every stage.

Run as one process (no torchrun), the script trains the same model unpipelined over the
same microbatches: the independent reference. With one replica, the pipelined run's
per-step losses and final parameters equal it bit for bit; with several, the replicas'
gradient average sums in another order (a bound of about 1e-6 relative).

Under `phoenixft run` the same job is protected (`phoenixft.Pipeline`):

    phoenixft run --nproc 4 --spares 1 examples/train_pp.py --pp 2 --schedule 1f1b

phoenixft builds the mesh (its replicas are --nproc / (--pp x --dp-shard); --dp is not
used), this script's `split` returns the rank's stage, each step's loop body is
`step.run_schedule(batch)`, and a dead stage's rank is hot-swapped while the other ranks
keep their processes. --dp-shard > 1 shards each stage with FSDP2, --tp > 1 cuts its
MLPs with tensor parallelism (phoenixft run only).
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, LlamaStage, preset
from phoenixft.train.data import MicrobatchWindows, stdlib_corpus

BATCH = {"tiny": 4, "small": 8, "ref": 8}
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def build(args):
    torch.manual_seed(args.seed)  # every rank builds the same initial parameters
    cfg = preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    model = LlamaForCausalLM(cfg)
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    return model, windows


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def step_data(windows, step: int, ids: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Microbatches `ids` of `step`, stacked along the batch dimension (the schedule splits
    them back into one chunk per microbatch)."""
    pairs = [windows.get(step, j) for j in ids]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def adamw(args, params):
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)


def save(out_dir: str, name: str, module: torch.nn.Module) -> None:
    from safetensors.torch import save_file
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in module.state_dict().items()},
              str(Path(out_dir) / f"{name}.safetensors"))


def reference(args) -> None:
    """The same job in one process, unpipelined: each microbatch's gradient accumulated,
    then divided by the step's microbatches (what the schedule's `scale_grads` does)."""
    model, windows = build(args)
    opt = adamw(args, model.parameters())
    losses = []
    for index in range(1, args.steps + 1):
        total = 0.0
        for j in range(args.microbatches):
            x, y = windows.get(index, j)
            loss = loss_fn(model(x), y)
            loss.backward()
            total += float(loss.detach())
        for p in model.parameters():
            p.grad.div_(args.microbatches)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / args.microbatches)
    if args.out_dir:
        save(args.out_dir, "stage0", model)
        (Path(args.out_dir) / "losses.json").write_text(json.dumps({"losses": losses}))


def clip_across_stages(params, max_norm: float, pp_group) -> torch.Tensor:
    """The global gradient norm over every stage (each stage's sum of squares, summed over
    the pp dimension), and the gradients scaled to it, as torchtitan clips a pipeline."""
    import torch.distributed as dist
    grads = [p.grad for p in params]
    sq = torch.nn.utils.get_total_norm(grads).pow(2)
    dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def pipelined(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world != args.pp * args.dp:
        raise SystemExit(f"--pp {args.pp} x --dp {args.dp} = {args.pp * args.dp} ranks, "
                         f"torchrun started {world}")
    if args.microbatches % args.dp:
        raise SystemExit(f"--microbatches {args.microbatches} must divide among --dp {args.dp} "
                         "replicas")
    mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    per_rank = 2 if args.schedule == "interleaved" else 1
    n = args.pp * per_rank
    model, windows = build(args)
    mods = [LlamaStage(model, i, n) for i in range(s, n, args.pp)]
    del model
    stages = [PipelineStage(m, m.stage, n, torch.device("cpu"), group=mesh["pp"].get_group())
              for m in mods]
    local_m = args.microbatches // args.dp
    if per_rank == 1:
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
        schedule = cls(stages[0], local_m, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, local_m, loss_fn=loss_fn)
    params = [p for m in mods for p in m.parameters()]
    opt = adamw(args, params)
    first, last = mods[0].stage == 0, mods[-1].stage == n - 1
    ids = range(d * local_m, (d + 1) * local_m)  # this replica's microbatches
    losses = []
    for index in range(1, args.steps + 1):
        x, y = step_data(windows, index, ids)
        mine: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), **({"target": y, "losses": mine} if last else {}))
        for p in params:  # the replicas' average (each already divided by its microbatches)
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad.div_(args.dp)
        if args.clip:
            clip_across_stages(params, args.clip, mesh["pp"].get_group())
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.tensor([sum(float(v.detach()) for v in mine)], dtype=torch.float64)
        dist.all_reduce(total, group=mesh["dp"].get_group())  # (0 on the other stages)
        losses.append(float(total) / args.microbatches)
    if args.out_dir and d == 0:
        for m in mods:
            save(args.out_dir, f"stage{m.stage}", m)
        if last:
            (Path(args.out_dir) / "losses.json").write_text(json.dumps({"losses": losses}))
    dist.barrier()  # (a rank tearing gloo down while another still works may abort it)
    dist.destroy_process_group()


def parallelize_stage(stage: LlamaStage, mesh) -> None:
    """--tp > 1: each decoder layer's MLP cut over mesh["tp"] (gate and up by columns, down
    by rows), then FSDP2 over mesh["dp_shard"] per layer and on the stage."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    for layer in stage.model.layers.values():
        # src_data_rank=None: every rank built the same weights (a spare cuts its own)
        parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(),
                                                   "up_proj": ColwiseParallel(),
                                                   "down_proj": RowwiseParallel()},
                           src_data_rank=None)
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(stage, mesh=mesh["dp_shard"])


def protected(args) -> None:
    """The pipelined job under `phoenixft run`: phoenixft splits, schedules and recovers."""
    import phoenixft

    sess = phoenixft.Session()
    model, windows = build(args)
    pipeline = phoenixft.Pipeline(
        pp=args.pp, schedule=args.schedule, loss_fn=loss_fn,
        split=lambda m, pp_mesh: LlamaStage(m, pp_mesh.get_local_rank(), args.pp))
    sess.setup(model, lambda params: adamw(args, params), pipeline=pipeline,
               dp_shard=args.dp_shard, tp=args.tp, microbatches=args.microbatches,
               parallelize=parallelize_stage if args.tp > 1 else None)
    for step in sess.steps(args.steps):
        step.run_schedule(lambda j, i=step.index: windows.get(i, j))
        if args.clip:
            step.clip_grad_norm_(args.clip)
    if args.out_dir:
        full = sess.full_state()  # (collective: every stage's state, on every rank)
        if sess.rank == 0:
            from safetensors.torch import save_file
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
            save_file({k.removeprefix("model."): v.contiguous() for k, v in full.items()
                       if k.startswith("model.")}, str(Path(args.out_dir) / "stages.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (0: the preset's; a stage needs one at least)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (ranks per replica)")
    ap.add_argument("--dp", type=int, default=1, help="pipeline replicas (data parallel)")
    ap.add_argument("--dp-shard", type=int, default=1,
                    help="ranks per stage, sharding it with FSDP2 (phoenixft run only)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallelism inside each stage (its MLPs; phoenixft run only)")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                    help="interleaved: two stages per rank (needs 2 x --pp layers at least)")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="microbatches per step over all replicas")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--clip", type=float, default=0.0,
                    help="clip gradients to this global norm over every stage (0: no clipping)")
    ap.add_argument("--out-dir", default=None,
                    help="write each stage's final parameters (stage{i}.safetensors, from the "
                         "first replica) and the per-step losses (losses.json) here")
    args = ap.parse_args()
    for flag in ("steps", "pp", "dp", "dp_shard", "tp", "microbatches", "threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    if "PHOENIXFT_STORE" in os.environ:
        protected(args)  # (phoenixft.Pipeline refuses an interleaved schedule, saying why)
    elif args.dp_shard != 1 or args.tp != 1:
        ap.error("--dp-shard and --tp > 1 (FSDP2, tensor parallelism inside each stage) are "
                 "this example's under phoenixft run only")
    elif "RANK" in os.environ:
        pipelined(args)
    elif args.pp != 1 or args.dp != 1:
        raise SystemExit(f"--pp {args.pp} --dp {args.dp} needs {args.pp * args.dp} ranks: "
                         f"start it with torchrun --nproc-per-node {args.pp * args.dp}")
    else:
        reference(args)


if __name__ == "__main__":
    main()

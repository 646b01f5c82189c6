"""Checkpoint-and-restart baseline for `phoenixft bench pipeline`: a pipelined job under
plain torchrun with torch.distributed.checkpoint's `async_save`, as torchtitan users run
it.

The same model, corpus, split and schedule as examples/train_pp.py under plain torchrun:
the Llama split into --pp stages (`LlamaStage`), a (dp, pp) mesh, 1F1B over each
replica's share of the step's microbatches, the replicas' gradients averaged over the
mesh's dp dimension, AdamW on each stage. Every `--ckpt-every` steps every rank starts
`dcp.async_save` of its stage's model and optimizer state dicts (their keys are the whole
model's names: the ranks' saves together are the model) into ``<ckpt>/step-N`` over a
gloo group of its own; the previous save is awaited first (one in flight, as torchtitan
does). On (re)start every rank loads the newest complete save (its `.metadata` written)
and carries on after it. torchrun's `--max-restarts` restarts the whole group when one
worker dies: each failure costs a restart plus the steps since the last complete save.

Progress goes to `--events` in torchrun_baseline.py's format, whose fault injection
(`--kill-at`) and process-group set-up it shares. Nothing of phoenixft's session is used.

Run: torchrun --nproc-per-node 4 --max-restarts 1 -m phoenixft.bench.torchrun_pp_baseline
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh

from phoenixft.bench.torchrun_baseline import (
    BATCH,
    init_process_group,
    job_args,
    maybe_self_kill,
    parse_kills,
)
from phoenixft.bench.torchrun_fsdp_baseline import AsyncSaves
from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, LlamaStage, preset
from phoenixft.observe.events import EventLog
from phoenixft.train.data import MicrobatchWindows, stdlib_corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="small", choices=sorted(BATCH))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the preset's)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--microbatches", type=int, default=4, help="per step, over all replicas")
    job_args(ap, ckpt_every=10, ckpt="runs/baseline/dcp-pp", init="per-attempt")
    return ap.parse_args(argv)


# the optimizer's state dict keyed by parameter name, as torchtitan saves it: nested, its
# "param_groups" would be one key that every stage writes with its own parameters, and
# DCP keeps one rank's copy of a key
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    args = parse_args(argv)
    kills = parse_kills(args.kill_at)
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.pp or args.microbatches % (world // args.pp):
        raise SystemExit(f"--pp {args.pp} must divide the world ({world}) and the replicas "
                         f"({world // max(1, args.pp)}) --microbatches {args.microbatches}")
    dp = world // args.pp
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(args.events, rank=rank, attempt=attempt)
    t_launch = log.emit("start", pid=os.getpid(), world_size=world)["t"]
    timeout = timedelta(seconds=args.pg_timeout)
    init_process_group(args.init, rank, world, attempt, timeout)
    saver = dist.new_group(backend="gloo", timeout=timeout)  # async saves' own collectives
    mesh = init_device_mesh("cpu", (dp, args.pp), mesh_dim_names=("dp", "pp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    cfg = preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers)
    torch.manual_seed(args.seed)
    stage_mod = LlamaStage(LlamaForCausalLM(cfg), s, args.pp)
    local_m = args.microbatches // dp
    stage = PipelineStage(stage_mod, s, args.pp, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, local_m, loss_fn=_loss)
    params = [p for p in stage_mod.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    saves = AsyncSaves(Path(args.ckpt), stage_mod, opt, args.ckpt_every, saver, log, rank,
                       options=FLAT)
    start = saves.load_newest()
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    log.emit("resumed", step=start, init_s=round(time.time() - t_launch, 3))

    claims = Path(args.events or args.ckpt).parent
    first, last = s == 0, s == args.pp - 1
    ids = range(d * local_m, (d + 1) * local_m)
    for step in range(start + 1, args.steps + 1):
        maybe_self_kill(kills, rank, step, claims, log, world)
        pairs = [windows.get(step, j) for j in ids]
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(torch.cat([x for x, _ in pairs]))
        elif last:
            schedule.step(target=torch.cat([y for _, y in pairs]), losses=losses)
        else:
            schedule.step()
        for p in params:  # the replicas' average
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad.div_(dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if last and d == 0:
            log.emit("step", step=step, loss=sum(float(v) for v in losses) / len(losses),
                     world_size=world)
        saves.after_step(step)
    saves.finish()
    log.emit("done", step=args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

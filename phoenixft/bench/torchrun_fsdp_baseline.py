"""Checkpoint-and-restart baseline for `phoenixft bench sharded`: an FSDP2 job under plain
torchrun with torch.distributed.checkpoint's `async_save`, as torchtitan users run it.

The same model, corpus, sharding and microbatches as examples/train_fsdp.py (a
`fully_shard` unit per decoder block, then the root; one microbatch per rank and step,
FSDP2's own gradient average, AdamW on the DTensors). Every `--ckpt-every` steps every
rank starts `dcp.async_save` of the model and optimizer state dicts
(`get_state_dict`) into ``<ckpt>/step-N`` over a gloo group of its own (the training
collectives do not wait behind it); a save is complete when DCP wrote its ``.metadata``.
Before the next save starts, the previous one is awaited (one in flight, as torchtitan
does). With `--dp-shard S` below the world size the mesh is (world / S, S) and
`fully_shard` makes it HSDP (torchtitan's dp_replicate x dp_shard). On (re)start every
rank loads the newest complete save with `dcp.load` and carries on from the step after
it. torchrun's `--max-restarts` restarts the whole group when one worker dies: each
failure costs a restart plus the steps since the last complete save.

Progress goes to `--events` (start, resumed, step, checkpoint, done), in the format of
torchrun_baseline.py, whose fault injection (`--kill-at`) and process-group set-up it
shares. Nothing of phoenixft's session is used.

Run: torchrun --nproc-per-node 4 --max-restarts 1 -m phoenixft.bench.torchrun_fsdp_baseline
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from phoenixft.bench.torchrun_baseline import (
    BATCH,
    init_process_group,
    job_args,
    maybe_self_kill,
    parse_kills,
)
from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset
from phoenixft.observe.events import EventLog
from phoenixft.train.data import MicrobatchWindows, stdlib_corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="tiny", choices=sorted(BATCH))
    ap.add_argument("--microbatches", type=int, default=None,
                    help="microbatches per step: the number of ranks (one each), as "
                         "examples/train_fsdp.py runs by default")
    job_args(ap, ckpt_every=10, ckpt="runs/baseline/dcp", init="per-attempt")
    ap.add_argument("--dp-shard", type=int, default=-1,
                    help="ranks per FSDP2 shard group; fewer than the world makes it HSDP "
                         "(world / dp_shard replica groups), -1: the world")
    return ap.parse_args(argv)


def newest_complete(root: Path) -> tuple[int, Path] | None:
    """The newest save DCP finished (its .metadata is written last)."""
    done = [(int(p.name.removeprefix("step-")), p) for p in root.glob("step-*")
            if (p / ".metadata").exists()]
    return max(done) if done else None


class AsyncSaves:
    """torchtitan's way with `dcp.async_save`: the model's and optimizer's state dicts
    (`get_state_dict`) saved every K steps into ``<root>/step-N`` over a gloo group of
    their own, one save in flight (the previous awaited before the next starts), and on
    (re)start the newest complete one loaded. Rank 0 logs each save's start (the stall)
    and end."""

    def __init__(self, root: Path, module, opt, every: int, group, log: EventLog, rank: int,
                 options=None) -> None:
        self.root, self.module, self.opt, self.every = root, module, opt, every
        self.group, self.log, self.rank, self.options = group, log, rank, options
        self.pending = None  # the save in flight: (step, future, when it started)
        root.mkdir(parents=True, exist_ok=True)

    def load_newest(self) -> int:
        """The newest complete save into the module and optimizer; its step (0: none)."""
        found = newest_complete(self.root)
        if found is None:
            return 0
        step, path = found
        msd, osd = get_state_dict(self.module, self.opt, options=self.options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.module, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self.options)
        return step

    def after_step(self, step: int) -> None:
        if step % self.every:
            return
        t0 = time.perf_counter()
        self._await()
        msd, osd = get_state_dict(self.module, self.opt, options=self.options)
        fut = dcp.async_save({"model": msd, "optim": osd},
                             checkpoint_id=str(self.root / f"step-{step}"),
                             process_group=self.group)
        self.pending = (step, fut, t0)
        if self.rank == 0:
            self.log.emit("checkpoint_started", step=step,
                          stall_s=round(time.perf_counter() - t0, 4))

    def _await(self) -> None:
        if self.pending is None:
            return
        step, fut, t0 = self.pending
        fut.result()
        self.pending = None
        if self.rank == 0:
            self.log.emit("checkpoint", step=step, save_s=round(time.perf_counter() - t0, 4))

    def finish(self) -> None:
        self._await()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kills = parse_kills(args.kill_at)
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.microbatches not in (None, world):
        raise SystemExit(f"--microbatches {args.microbatches}: this baseline runs one per rank "
                         f"({world})")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(args.events, rank=rank, attempt=attempt)
    t_launch = log.emit("start", pid=os.getpid(), world_size=world)["t"]
    timeout = timedelta(seconds=args.pg_timeout)
    init_process_group(args.init, rank, world, attempt, timeout)
    saver = dist.new_group(backend="gloo", timeout=timeout)  # async saves' own collectives

    cfg = preset(args.preset)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    shard = world if args.dp_shard == -1 else args.dp_shard
    if shard < 1 or world % shard:
        raise SystemExit(f"--dp-shard {args.dp_shard} must divide the world size {world}")
    # a 2-D mesh makes fully_shard HSDP: shards within a group, replicas across groups
    mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)) if shard == world
            else init_device_mesh("cpu", (world // shard, shard),
                                  mesh_dim_names=("dp_replicate", "dp_shard")))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=0.01)
    saves = AsyncSaves(Path(args.ckpt), model, opt, args.ckpt_every, saver, log, rank)
    start = saves.load_newest()
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    log.emit("resumed", step=start, init_s=round(time.time() - t_launch, 3))

    claims = Path(args.events or args.ckpt).parent
    for step in range(start + 1, args.steps + 1):
        maybe_self_kill(kills, rank, step, claims, log, world)
        x, y = windows.get(step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            log.emit("step", step=step, loss=float(loss.detach()), world_size=world)
        saves.after_step(step)
    saves.finish()
    log.emit("done", step=args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A plain torchrun + DDP training loop: the "before" of docs/migrating.md.

    torchrun --standalone --nproc-per-node 2 examples/migrate/ddp_torchrun.py --steps 20

What real jobs use: a DataLoader with a DistributedSampler, bf16 autocast, gradient
clipping, an LR schedule, and the trained model saved at the end. Its phoenixft twin,
ddp_phoenixft.py, differs only in the lines marked `# phoenixft:` there.
"""

import argparse
import itertools
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from windows import Windows, build_model, save_model


def epochs(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield from loader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--windows", type=int, default=4096, help="dataset size (samples)")
    ap.add_argument("--out", default=None, help="save the trained model here")
    ap.add_argument("--losses", default=None, help="write the step losses here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model()
    ds = Windows(args.windows)
    loader = DataLoader(ds, batch_size=4, drop_last=True,
                        sampler=DistributedSampler(ds, world, rank, seed=0))
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    batches = epochs(loader)

    losses = []
    for _ in range(args.steps):
        x, y = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)

    if rank == 0 and args.out:
        save_model(model.module, args.out)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.barrier()  # leave together: a rank that tore its group down while rank 0 was still
    dist.destroy_process_group()  # saving was aborted by gloo once ("terminate called ...")


if __name__ == "__main__":
    main()

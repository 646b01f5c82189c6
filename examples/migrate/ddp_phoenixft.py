"""ddp_torchrun.py moved to phoenixft: the "after" of docs/migrating.md.

    phoenixft run --nproc-per-node 2 --spares 1 examples/migrate/ddp_phoenixft.py --steps 20

The lines that changed are marked `# phoenixft:`; everything else is the DDP script's.
A worker SIGKILLed mid-run is replaced by the spare, which takes over the dead rank's
shard, data position, RNG and LR schedule; the run ends with the failure-free state.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from windows import Windows, build_model

import phoenixft  # phoenixft:


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--windows", type=int, default=4096, help="dataset size (samples)")
    ap.add_argument("--out", default=None, help="save the trained model here")
    args = ap.parse_args()
    torch.set_num_threads(1)

    sess = phoenixft.Session()  # phoenixft: instead of init_process_group
    torch.manual_seed(0)
    model = build_model()
    ds = Windows(args.windows)
    loader = phoenixft.ResumableLoader(lambda: DataLoader(  # phoenixft: built once the rank is known
        ds, batch_size=4, drop_last=True,
        sampler=DistributedSampler(ds, sess.world_size, sess.rank, seed=0)))
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01),  # phoenixft:
               scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps),
               track={"data": loader})

    for step in sess.steps(args.steps):  # phoenixft: the session runs the steps
        for _ in step.microbatches():  # phoenixft: (one per rank, as DDP)
            x, y = next(loader)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            step.backward(loss)  # phoenixft: zero_grad/step/sched.step are the session's
        step.clip_grad_norm_(1.0)  # phoenixft:

    if args.out:
        sess.save_pretrained(args.out)  # phoenixft: rank 0 writes


if __name__ == "__main__":
    main()

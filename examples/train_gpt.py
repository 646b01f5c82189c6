"""Train a small Llama-style byte-level model on the Python standard library, under
phoenixft. Run it with `phoenixft run --nproc 2 --spares 1 examples/train_gpt.py`.

The optimizer state is sharded over ranks (ZeRO-1). With `--data rank` (default) each
rank draws its own windows from its own generator, so a dead rank's state exists nowhere
else but in its snapshot and that snapshot's peer replica. With `--data ids` a
microbatch's windows are a pure function of its id (step, j), so survivors can take over
a dead rank's microbatches (ReCoVer: `phoenixft run --min-nproc 1`).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import phoenixft
from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset, save_hf
from phoenixft.train.data import MicrobatchWindows, RandomWindows, stdlib_corpus

BATCH = {"tiny": 4, "small": 8, "ref": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "ref"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="microbatches per step, over all ranks (default: one per rank)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="parameter dtype; with bfloat16 the session keeps fp32 master weights "
                         "and optimizer state in each rank's shard")
    ap.add_argument("--data", default="rank", choices=["rank", "ids"],
                    help="rank: per-rank sampler state; ids: data is a function of the microbatch id")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: this worker's GPU (LOCAL_RANK modulo the GPUs visible; the "
                         "process groups then use NCCL)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    sess = phoenixft.Session()
    cfg = preset(args.preset)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).to(device)
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    # Each rank draws from its own stream, seeded at the first draw once the rank is
    # known; after a failure the replacement gets the generator state from the snapshot.
    ctx, batch = cfg.max_position_embeddings, BATCH[args.preset]
    if args.data == "rank":
        data = RandomWindows(corpus, context=ctx, batch=batch,
                             seed=lambda: args.seed * 1000 + sess.rank)
        track = {"data": data}
    else:
        windows = MicrobatchWindows(corpus, context=ctx, batch=batch, seed=args.seed)
        track = {}
    sess.setup(model, lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
               track=track, microbatches=args.microbatches)

    for step in sess.steps(args.steps):
        for j in step.microbatches():
            x, y = data.next_batch() if args.data == "rank" else windows.get(step.index, j)
            x, y = x.to(device), y.to(device)
            logits = model(x)
            step.backward(F.cross_entropy(logits.flatten(0, 1), y.flatten()))

    if sess.rank == 0 and os.environ.get("PHOENIXFT_RUN_DIR"):
        out = save_hf(model, Path(os.environ["PHOENIXFT_RUN_DIR"]) / "model")
        print(f"saved {out}")


if __name__ == "__main__":
    main()

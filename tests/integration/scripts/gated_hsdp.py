"""examples/train_fsdp.py's model and parallelize under HSDP (replica groups of
--dp-shard ranks), able to hold at a step until --spares respawned workers registered
(gated.py's gate: a test that needs a replica group to come back while the job runs
waits for that state, not for the job to be slow enough)."""

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from gated import hold, wait_for_failure_plan  # this script's folder, as for any script

import phoenixft

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_fsdp.py"
_spec = importlib.util.spec_from_file_location("train_fsdp", EXAMPLE)
train_fsdp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_fsdp)
build, loss_of, optimizer, parallelize = (
    train_fsdp.build, train_fsdp.loss_of, train_fsdp.optimizer, train_fsdp.parallelize)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dp-shard", type=int, default=2)
    ap.add_argument("--hold-at", type=int, default=0, help="wait at this step for new spares")
    ap.add_argument("--spares", type=int, default=2, help="respawned workers to wait for")
    args = ap.parse_args()
    model_args = argparse.Namespace(preset="tiny", seed=0, lr=3e-3, device="cpu", bf16=False)
    torch.set_num_threads(1)
    run_dir = Path(os.environ["PHOENIXFT_RUN_DIR"])
    wait_for_failure_plan(run_dir, os.environ["PHOENIXFT_WORKER_ID"])
    sess = phoenixft.Session()
    model, windows = build(model_args)
    sess.setup(model, optimizer(model_args), dp_shard=args.dp_shard,
               parallelize=lambda m, mesh: parallelize(m, mesh, False, args.dp_shard))
    for step in sess.steps(args.steps):
        if step.index == args.hold_at and not step.retry:
            hold(run_dir, None, args.spares)
        for j in step.microbatches():
            step.backward(loss_of(model, windows, step.index, j))


if __name__ == "__main__":
    main()

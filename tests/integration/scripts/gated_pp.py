"""examples/train_pp.py's pipelined job under `phoenixft run`, able to hold at a step until
--spares respawned workers registered (gated.py's gate: a test that needs a pipeline
replica to come back while the job runs waits for that state, not for the job to be slow
enough)."""

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from gated import hold, wait_for_failure_plan  # this script's folder, as for any script

import phoenixft

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_pp.py"
_spec = importlib.util.spec_from_file_location("train_pp", EXAMPLE)
train_pp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_pp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp-shard", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--hold-at", type=int, default=0, help="wait at this step for new spares")
    ap.add_argument("--spares", type=int, default=2, help="respawned workers to wait for")
    args = ap.parse_args()
    job = argparse.Namespace(preset="tiny", layers=4, seed=0, lr=3e-3)
    torch.set_num_threads(1)
    run_dir = Path(os.environ["PHOENIXFT_RUN_DIR"])
    wait_for_failure_plan(run_dir, os.environ["PHOENIXFT_WORKER_ID"])
    sess = phoenixft.Session()
    model, windows = train_pp.build(job)
    pipeline = phoenixft.Pipeline(
        pp=args.pp, schedule="1f1b", loss_fn=train_pp.loss_fn,
        split=lambda m, mesh: train_pp.LlamaStage(m, mesh.get_local_rank(), args.pp))
    sess.setup(model, lambda p: train_pp.adamw(job, p), pipeline=pipeline,
               dp_shard=args.dp_shard, tp=args.tp, microbatches=4,
               parallelize=train_pp.parallelize_stage if args.tp > 1 else None)
    for step in sess.steps(args.steps):
        if step.index == args.hold_at and not step.retry:
            hold(run_dir, None, args.spares)
        step.run_schedule(lambda j, i=step.index: windows.get(i, j))
        step.clip_grad_norm_(1.0)


if __name__ == "__main__":
    main()

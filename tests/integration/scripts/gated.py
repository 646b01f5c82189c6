"""A tiny ReCoVer job (each microbatch's data is a pure function of its id) that can hold
at a step until a respawned worker has registered, or until the test creates a file in the
run directory. A test that needs the world to grow back, or the storage to change, while
the job still runs waits for that state, instead of hoping the job is slow enough.

A respawned worker (one generation 0 did not know) registers only once the leader has
planned the failure it replaces: a replacement that registered first would take the dead
rank as a spare (correct too, and seen on a loaded machine), and the job would never
shrink and grow back, which is what the tests of this script are about."""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import phoenixft
from phoenixft.observe.events import read_events


def wait_until(done, what: str) -> None:
    """Poll `done()` (bounded: 120 s) for a state of the run."""
    deadline = time.monotonic() + 120
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within 120 s")
        time.sleep(0.05)


def wait_for_failure_plan(run_dir: Path, wid: str) -> None:
    def generations() -> list[dict]:
        return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "generation"]
    first = generations()
    if not first or wid in first[0]["members"].values():
        return  # a worker of the job's start
    wait_until(lambda: len(generations()) >= 2, "generation after the first")


def hold(run_dir: Path, until_file: str | None, spares: int = 1) -> None:
    """Wait for the file in the run directory, or for `spares` respawned workers'
    registrations when no file is named."""
    if until_file is not None:
        wait_until((run_dir / until_file).exists, f"{until_file} in the run dir")
    else:
        wait_until(lambda: sum(e["event"] == "spare_added"
                               for e in read_events(run_dir / "events.jsonl")) >= spares,
                   f"{spares} respawned worker(s) registered")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--hold-at", type=int, default=0, help="wait at this step for a new spare")
    ap.add_argument("--hold-until-file", default=None,
                    help="at --hold-at, wait for this file in the run directory instead")
    ap.add_argument("--hold-again-at", type=int, default=0,
                    help="a second hold, until --hold-again-until-file appears")
    ap.add_argument("--hold-again-until-file", default=None)
    ap.add_argument("--hold-after-file", default=None,
                    help="once training finished, wait for this file before exiting")
    args = ap.parse_args()
    if args.hold_until_file and not args.hold_at:
        ap.error("--hold-until-file needs --hold-at STEP")
    torch.set_num_threads(1)
    run_dir = Path(os.environ["PHOENIXFT_RUN_DIR"])
    wait_for_failure_plan(run_dir, os.environ["PHOENIXFT_WORKER_ID"])
    sess = phoenixft.Session()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-2), microbatches=args.microbatches)
    for step in sess.steps(args.steps):
        if step.index == args.hold_at and not step.retry:
            hold(run_dir, args.hold_until_file)
        if args.hold_again_at and step.index == args.hold_again_at and not step.retry:
            hold(run_dir, args.hold_again_until_file)
        for j in step.microbatches():
            g = torch.Generator().manual_seed(step.index * 1000 + j)
            x = torch.randn(8, 16, generator=g)
            step.backward(F.mse_loss(model(x), x.sum(1, keepdim=True).sin()))
    if args.hold_after_file:
        wait_until((run_dir / args.hold_after_file).exists, f"{args.hold_after_file} in the run dir")
    if sess.rank == 0:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(run_dir / "params.safetensors"))


if __name__ == "__main__":
    main()

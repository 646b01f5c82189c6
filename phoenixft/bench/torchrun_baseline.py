"""Checkpoint-and-restart baseline for `phoenixft bench goodput`: plain DDP under torchrun.

This is the job as users run it today, written the way they write it: DDP over gloo,
gradient accumulation over this rank's share of the step's microbatches, `torch.save`
of model + optimizer every `--ckpt-every` steps from rank 0, and on (re)start every rank
loads the newest checkpoint and carries on from the step after it. torchrun's
`--max-restarts` restarts the whole worker group when one worker dies, so each failure
costs a full restart plus the steps since the last checkpoint. It uses no part of
phoenixft's session: only the same model (`phoenixft.models.llama`), the same corpus
(`phoenixft.train.data`) and the same microbatch size, so the benchmark compares
recovery strategies, not models.

Microbatch (step, j) is a pure function of its id (`MicrobatchWindows`, as with
`examples/train_gpt.py --data ids`), so a restarted job recomputes exactly the data it lost
and every mode of the benchmark trains on the same windows. Rank r computes ids j = r, r+W, ...;
the loss is scaled by W/M so that DDP's mean over W ranks yields the sum over the M
microbatches divided by M, as phoenixft's session does.

Progress goes to `--events` (JSON lines: start, resumed, step, checkpoint, done) for the
benchmark to schedule faults and draw the timeline.

Run: torchrun --nproc-per-node 4 --max-restarts 3 -m phoenixft.bench.torchrun_baseline
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset
from phoenixft.observe.events import EventLog
from phoenixft.train.data import MicrobatchWindows, stdlib_corpus

# Windows of `context` tokens per microbatch, per preset: examples/train_gpt.py's sizes.
BATCH = {"tiny": 4, "small": 8, "ref": 8}


def microbatch_tokens(preset_name: str) -> int:
    """Tokens in one microbatch (windows x context), the unit of the benchmark's tokens/s."""
    return BATCH[preset_name] * preset(preset_name).max_position_embeddings


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from `path` if it exists; returns the step it holds (0: none)."""
    if not path.exists():
        return 0
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    return int(ckpt["step"])


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Write then rename, so a worker killed mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def init_process_group(how: str, rank: int, world: int, attempt: int, timeout: timedelta) -> None:
    """`env`: `init_process_group("gloo")` as users write it. On torch 2.13 a restarted
    group then reads the previous attempt's gloo addresses, left under the same keys in
    torchrun's store, and fails with "Connection refused" (each failed attempt uses up a
    restart). `per-attempt`: the same store under a prefix per restart attempt, the fix a
    user finds after hitting that, so that the baseline measures checkpoint-and-restart
    rather than that bug."""
    if how == "env":
        dist.init_process_group("gloo", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt/{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def job_args(ap: argparse.ArgumentParser, *, ckpt_every: int, ckpt: str, init: str) -> None:
    """The flags every torchrun baseline shares (this one, torchrun_fsdp_baseline.py,
    torchrun_pp_baseline.py): checkpoints, the progress log, the fault injection, the
    process group's set-up; each its own defaults for the first three."""
    ap.add_argument("--ckpt-every", type=int, default=ckpt_every, help="steps between checkpoints")
    ap.add_argument("--ckpt", default=ckpt, help="where the checkpoints go")
    ap.add_argument("--events", default=None, help="JSON-lines progress log")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--init", default=init, choices=["env", "per-attempt"],
                    help="how the process group finds its peers (see init_process_group)")
    ap.add_argument("--kill-at", action="append", default=[], metavar="RANK:STEP",
                    help="SIGKILL this worker when rank RANK starts step STEP, once per job "
                         "(claimed with a file beside --events; a restart replaying the step "
                         "lives on)")
    ap.add_argument("--pg-timeout", type=float, default=60.0,
                    help="process-group timeout in seconds (gloo's default of 30 min turns a "
                         "hung restart into a hung job)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="tiny", choices=sorted(BATCH))
    ap.add_argument("--microbatches", type=int, default=8, help="microbatches per optimizer step")
    job_args(ap, ckpt_every=20, ckpt="runs/baseline/ckpt.pt", init="env")
    return ap.parse_args(argv)


def parse_kills(specs: list[str]) -> list[tuple[int, int]]:
    out = []
    for spec in specs:
        rank, _, step = spec.partition(":")
        if not (rank.isdigit() and step.isdigit()) or int(step) < 1:
            raise SystemExit(f"--kill-at must be RANK:STEP with STEP >= 1, got {spec!r}")
        out.append((int(rank), int(step)))
    return out


def maybe_self_kill(kills: list[tuple[int, int]], rank: int, step: int, claims: Path,
                    log: EventLog, world: int) -> None:
    """A real SIGKILL of this worker at the start of `step`, once per job: the fault is
    claimed by creating a file (O_EXCL), so a restarted attempt replaying the step goes on."""
    for i, (r, s) in enumerate(kills):
        if (r, s) != (rank, step):
            continue
        try:
            os.close(os.open(claims / f"kill-{i}.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        log.emit("inject", step=step, pid=os.getpid(), world_size=world)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kills = parse_kills(args.kill_at)
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = EventLog(args.events, rank=rank, attempt=attempt)
    t_launch = log.emit("start", pid=os.getpid(), world_size=world)["t"]
    init_process_group(args.init, rank, world, attempt, timedelta(seconds=args.pg_timeout))

    cfg = preset(args.preset)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    ckpt = Path(args.ckpt)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    start = load_checkpoint(ckpt, model, opt)
    ddp = DDP(model)
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    mine = list(range(rank, args.microbatches, world))
    log.emit("resumed", step=start, init_s=round(time.time() - t_launch, 3))

    claims = Path(args.events or args.ckpt).parent
    for step in range(start + 1, args.steps + 1):
        maybe_self_kill(kills, rank, step, claims, log, world)
        loss_sum = 0.0
        for i, j in enumerate(mine):
            x, y = windows.get(step, j)
            # Gradients are all-reduced only on this rank's last microbatch.
            with ddp.no_sync() if i < len(mine) - 1 else nullcontext():
                loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
                (loss * world / args.microbatches).backward()
            loss_sum += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            log.emit("step", step=step, loss=loss_sum / max(1, len(mine)), world_size=world)
            if step % args.ckpt_every == 0:
                t0 = time.perf_counter()
                save_checkpoint(ckpt, model, opt, step)
                log.emit("checkpoint", step=step, save_s=round(time.perf_counter() - t0, 4))
    log.emit("done", step=args.steps)
    dist.barrier()  # without it a rank tearing down gloo early made a peer abort (SIGABRT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

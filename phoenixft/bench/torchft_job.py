"""The torchft side of `phoenixft bench torchft`: one replica group of torchft 0.2.0, or its
lighthouse. It runs in torchft's own Python environment (torchft is not a phoenixft
dependency), importing from phoenixft only the model, the corpus and the event log, so both
sides train the same model on the same microbatches.

The loop is torchft's documented one: `Manager` + `OptimizerWrapper` (`zero_grad` starts the
quorum, `step` commits only if every participant succeeded), gradients averaged over the
participating replica groups with `manager.allreduce` (one flat buffer per step), and the
model and optimizer state handed to a healing replica through torchft's HTTP transport.
Each replica group here is one process (group world size 1); replica group r computes
microbatches j = r, r + R, ... of the step's M, so with all R groups up a step consumes
the same M microbatches as phoenixft's job. A replica that is down costs its share of
the step's data (torchft has no quota takeover): each step event says how many
microbatches it consumed.

Run `python -m phoenixft.bench.torchft_job lighthouse --addr-file F` first, then one
`python -m phoenixft.bench.torchft_job replica --replica R --lighthouse ADDR ...` per group.
The benchmark process restarts a SIGKILLed replica, as torchelastic would.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F


def lighthouse(args: argparse.Namespace) -> None:
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                              join_timeout_ms=int(args.join_timeout * 1000),
                              quorum_tick_ms=100,
                              heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    tmp = Path(args.addr_file + ".tmp")
    tmp.write_text(server.address())
    os.replace(tmp, args.addr_file)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


def _manager(args: argparse.Namespace, model, opt, store):
    """torchft's Manager for this replica group (group world size 1), its state the model
    and optimizer, handed to a healing replica over torchft's HTTP transport."""
    from torchft import Manager, ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": opt.state_dict()},
        replica_id=f"replica_{args.replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30))


def replica(args: argparse.Namespace) -> None:
    from torchft.optim import OptimizerWrapper

    from phoenixft.bench.torchrun_baseline import BATCH
    from phoenixft.models.llama import EOS_ID, LlamaForCausalLM, preset
    from phoenixft.observe.events import EventLog
    from phoenixft.train.data import MicrobatchWindows, stdlib_corpus

    torch.set_num_threads(args.threads)
    log = EventLog(args.events, replica=args.replica, attempt=args.attempt)
    t_launch = log.emit("start", pid=os.getpid())["t"]
    cfg = preset(args.preset)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    corpus = stdlib_corpus(EOS_ID, max_bytes=2_000_000 if args.preset == "tiny" else None)
    windows = MicrobatchWindows(corpus, context=cfg.max_position_embeddings,
                                batch=BATCH[args.preset], seed=args.seed)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = _manager(args, model, opt, store)
    optim = OptimizerWrapper(manager, opt)
    params = [p for p in model.parameters() if p.requires_grad]
    log.emit("ready", init_s=round(time.time() - t_launch, 3))
    while args.go_file and not Path(args.go_file).exists():  # all groups start together
        time.sleep(0.02)
    mine = list(range(args.replica, args.microbatches, args.replicas))
    while manager.current_step() < args.steps:
        step = manager.current_step() + 1
        if args.kill_at == step and args.attempt == 0:
            log.emit("inject", step=step, pid=os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        optim.zero_grad()  # starts the quorum (async: it overlaps the forward pass)
        loss_sum = 0.0
        for j in mine:
            x, y = windows.get(step, j)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            (loss / len(mine)).backward()
            loss_sum += float(loss.detach())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()  # the mean over participating replica groups
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        committed = manager.should_commit()
        if committed:
            opt.step()
        log.emit("step", step=step, committed=committed, loss=loss_sum / len(mine),
                 participants=manager.num_participants(),
                 microbatches=len(mine) * manager.num_participants())
    log.emit("done", step=manager.current_step())
    manager.shutdown(wait=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--addr-file", required=True)
    lh.add_argument("--heartbeat-timeout", type=float, default=2.0)
    lh.add_argument("--join-timeout", type=float, default=1.0)
    r = sub.add_parser("replica")
    r.add_argument("--replica", type=int, required=True)
    r.add_argument("--replicas", type=int, required=True)
    r.add_argument("--attempt", type=int, default=0)
    r.add_argument("--lighthouse", required=True)
    r.add_argument("--events", required=True)
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--preset", default="small")
    r.add_argument("--microbatches", type=int, default=8)
    r.add_argument("--kill-at", type=int, default=None, help="SIGKILL itself at this step "
                   "(first attempt only)")
    r.add_argument("--go-file", default=None, help="start training once this file exists")
    r.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    r.add_argument("--lr", type=float, default=3e-3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    (lighthouse if args.role == "lighthouse" else replica)(args)


if __name__ == "__main__":
    main()

"""Peer replication of snapshot slots over a generation's replication group.

A slot travels as its used bytes (header + data) in two messages: its size, then the
bytes, written straight into the receiver's replica slot file (shared memory owned by
the receiver's agent). Sends and receives of one round are posted together, so a ring
of ranks never deadlocks, and every wait goes through `wait_work` (deadline + abandon
on a newer generation). This runs on its own process group and thread, never on the
training group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phoenixft.checkpoint.slots import SlotFile
from phoenixft.comm.collectives import Interrupt, wait_work


def exchange_slots(pg: dist.ProcessGroup, *, send: SlotFile | None, send_nbytes: int,
                   dsts: list[int], recv: dict[int, SlotFile], interrupt: Interrupt,
                   timeout_s: float) -> None:
    """Send `send` (its first `send_nbytes`) to every rank in `dsts` and receive one slot
    from every rank in `recv` (src -> slot file to fill)."""
    size_out = torch.tensor([send_nbytes], dtype=torch.int64)
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in recv}
    works = [pg.send([size_out], d, 0) for d in dsts]
    works += [pg.recv([t], src, 0) for src, t in sizes_in.items()]
    for w in works:
        wait_work(w, interrupt, timeout_s, "replica size exchange")
    works = []
    if send is not None:
        payload = send.tensor[:send_nbytes]
        works += [pg.send([payload], d, 1) for d in dsts]
    for src, slot in recv.items():
        n = int(sizes_in[src].item())
        slot.ensure(n)
        works.append(pg.recv([slot.tensor[:n]], src, 1))
    for w in works:
        wait_work(w, interrupt, timeout_s, "replica transfer")

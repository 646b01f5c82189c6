"""A process group's `Ledger`: what decides whether a later generation may keep the group
(`train/kept_groups.py`). Real gloo groups of two ranks, one per thread of this process,
over loopback: the counts of both members agree after matched operations, a collective
whose wait was given up leaves its group unclean until the member behind issues it too
(`drain`; then the ledger learns it finished), and gloo's reduce-scatter, which never
reports `is_completed`, is counted finished once waited for but cannot be drained."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from phoenixft.comm.collectives import GenerationChanged, GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from phoenixft.comm.ledger import agreement, drain
from phoenixft.comm.swap_group import SwapGroup


def _pair(prefix: str) -> list[GroupOps]:
    """A gloo group of 2, both members in this process (built concurrently)."""
    store = dist.HashStore()
    pgs: list = [None, None]

    def build(r: int) -> None:
        pgs[r] = new_group(store, prefix, r, 2, device=torch.device("cpu"), timeout_s=30)
    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    out = []
    for pg in pgs:
        it = Interrupt()
        it.enter(0)
        out.append(GroupOps(pg, it, 30.0))
    return out


def _both(fn0, fn1) -> None:
    err: list[BaseException] = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            err.append(exc)
    threads = [threading.Thread(target=run, args=(f,)) for f in (fn0, fn1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not err, err


def test_matched_collectives_and_sends_leave_both_ledgers_clean_and_agreeing():
    a, b = _pair("matched/")
    x, y = torch.ones(3), torch.ones(3)
    _both(lambda: (a.allreduce(x, "sum"), a.send(x, 1, 0, "send")),
          lambda: (b.allreduce(y, "sum"), b.recv(y, 0, 0, "recv")))
    sa, sb = a.ledger.summary(), b.ledger.summary()
    assert sa["clean"] and sb["clean"]
    assert (sa["collectives"], sa["sent"], sb["received"]) == (1, {"1": 1}, {"0": 1})
    assert agreement([sa, sb]) == {}
    # a send its receiver never posted: both clean, the counts tell
    assert agreement([{**sa, "sent": {"1": 2}}, sb]) is None
    assert agreement([{**sa, "spoiled": True}, sb]) is None


def test_a_collective_given_up_on_stays_open_until_the_member_behind_drains_it():
    """a's all-reduce was abandoned (a new plan) before b issued it: b is one behind; it
    issues the same all-reduce of zeros (`drain`), a's finishes, and the group agrees."""
    a, b = _pair("abandoned/")
    x = torch.ones(2)
    threading.Timer(0.1, a.interrupt.announce, args=(1,)).start()
    with pytest.raises(GenerationChanged):
        a.allreduce(x, "a lone all-reduce")  # its peer has not issued it
    assert not a.ledger.summary()["clean"]
    assert "never completed" in a.ledger.why_not()
    plan = agreement([a.ledger.summary(), b.ledger.summary()])
    assert plan == {1: [["allreduce", 2, "float32", "cpu", "RedOpType.SUM"]]}
    drain(b.pg, b.ledger, plan[1])
    for ops in (a, b):
        ops.interrupt.enter(1)
        ops.ledger.settle(ops.interrupt, 10, "the drained all-reduce")
    assert a.ledger.summary()["clean"] and b.ledger.summary()["clean"]
    assert agreement([a.ledger.summary(), b.ledger.summary()]) == {}
    assert x.tolist() == [1.0, 1.0]  # (a's abandoned buffer: its values are never read)


def test_a_reduce_scatter_through_a_swap_group_is_counted_finished_once_waited():
    a, b = _pair("scatter/")
    groups = []
    for r, ops in enumerate((a, b)):
        g = SwapGroup(r, 2, name=f"test_rs_{r}")
        g.swap(ops, 0)
        groups.append(g)
    outs = [torch.zeros(2), torch.zeros(2)]

    def scatter(r: int):
        return lambda: groups[r]._reduce_scatter_base(outs[r], torch.arange(4.0)).wait()
    _both(scatter(0), scatter(1))
    assert outs[0].tolist() == [0.0, 2.0] and outs[1].tolist() == [4.0, 6.0]
    assert agreement([a.ledger.summary(), b.ledger.summary()]) == {}
    # one member behind on a reduce-scatter (FSDP2's, inside the user's passes): it
    # cannot be issued again, so the group cannot agree (it is rebuilt)
    groups[0]._reduce_scatter_base(torch.zeros(2), torch.arange(4.0))
    assert agreement([a.ledger.summary(), b.ledger.summary()]) is None

"""The parallelism seam's one shared test body (train/layout.py): every `StateLayout`
implementation trains, saves its unique state, changes, restores it, and reshards it onto
other world sizes, and must come back to the same world-size-free state bit for bit.
Threads as ranks over real gloo groups and a real TCPStore.

A new layout (FSDP2 / tensor parallel) is added to LAYOUTS and passes the same body."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch
from torch import nn

from phoenixft.cluster import store as kv
from phoenixft.comm.collectives import GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from phoenixft.train.flat_layout import FlatZero1
from tests.support.threads import ranks

LAYOUTS = {
    "flat-zero1": lambda model: FlatZero1(model, lambda p: torch.optim.AdamW(p, lr=1e-2)),
}
_prefixes = itertools.count()


@pytest.fixture()
def group():
    server, port = kv.host_store("127.0.0.1")
    addr = f"127.0.0.1:{port}"

    def make(rank: int, size: int, prefix: str) -> GroupOps:
        interrupt = Interrupt()
        interrupt.enter(0)
        pg = new_group(kv.connect(addr), f"{prefix}/", rank, size, device=torch.device("cpu"))
        return GroupOps(pg, interrupt, 30)

    yield make
    del server


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # (threads share torch's generator: seed and build under a lock)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


_build = threading.Lock()


def build(kind: str, seed: int):
    with _build:
        m = model(seed)
        return m, LAYOUTS[kind](m)


def train_step(m: nn.Module, lay, ops: GroupOps, step: int, rank: int, world: int) -> None:
    """One data-parallel step: this rank's batch, the gradient region all-reduced and
    averaged, the layout's update."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(4, 5, generator=g)
    m.zero_grad(set_to_none=True)
    m(x).pow(2).mean().backward()
    grads = torch.zeros(lay.grad_numel(), dtype=lay.master_dtype)
    lay.write_grads(grads)
    ops.allreduce(grads, f"grads {step}")
    grads.div_(world)
    lay.update(grads, ops, f"update {step}")


def snapshot(lay) -> tuple[dict, dict]:
    """What a snapshot keeps: copies of the unique tensors, the meta through JSON."""
    return ({k: v.detach().clone() for k, v in lay.unique_tensors().items()},
            json.loads(json.dumps(lay.unique_meta())))


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_save_change_restore_reshard_compare(kind, group):
    world = 2

    def first_run(r):
        ops = group(r, world, "a")
        m, lay = build(kind, seed=r)  # ranks start apart: rank 0's parameters are taken
        lay.join(r, world)
        lay.start_from_rank0(ops)
        for step in (1, 2):
            train_step(m, lay, ops, step, r, world)
        saved = snapshot(lay)
        full2 = {k: v.clone() for k, v in lay.full_state(ops).items()}
        train_step(m, lay, ops, 3, r, world)  # change
        full3 = {k: v.clone() for k, v in lay.full_state(ops).items()}
        assert any(not torch.equal(full2[k], full3[k]) for k in full2)
        lay.load_unique(*saved)  # restore
        lay.gather_params(ops, "restore")
        same(lay.full_state(ops), full2)
        train_step(m, lay, ops, 3, r, world)  # the same step again: the same result
        same(lay.full_state(ops), full3)
        return saved, full2

    results = ranks(first_run, world)
    old = [saved for saved, _ in results]
    full2 = results[0][1]
    same(results[1][1], full2)  # world-size free: every rank sees one state

    for new_world in (1, 3):  # reshard onto another world size, on fresh models
        prefix = f"re{next(_prefixes)}"

        def resharded(r, new_world=new_world, prefix=prefix):
            ops = group(r, new_world, prefix)
            m, lay = build(kind, seed=100 + r)
            lay.join(r, new_world)
            lay.reshard(old)
            full = lay.full_state(ops)
            params = {n: p.detach().clone() for n, p in m.named_parameters()}
            return full, params

        for full, params in ranks(resharded, new_world):
            same(full, full2)
            same({f"model.{n}": p for n, p in params.items()},
                 {k: v for k, v in full2.items() if k.startswith("model.")})


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_unique_state_is_this_ranks_share_only(kind, group):
    """Each of 2 ranks holds half of the optimizer state, not a copy of all of it."""
    def rank(r):
        ops = group(r, 2, "u")
        m, lay = build(kind, seed=0)
        lay.join(r, 2)
        lay.start_from_rank0(ops)
        train_step(m, lay, ops, 1, r, 2)
        return sum(t.numel() for k, t in lay.unique_tensors().items() if t.dim()), lay.numel

    (a, n), (b, _) = ranks(rank, 2)
    state_per_param = 3  # master weights, exp_avg, exp_avg_sq (AdamW)
    assert a + b <= state_per_param * (n + 2) and a == b  # (padding to the world size)

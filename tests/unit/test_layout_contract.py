"""The parallelism seam's one shared test body (train/layout.py): every layout the registry
builds (flat, FSDP2, FSDP2 + tensor parallel, HSDP, a 2-stage pipeline) trains, saves its
unique state, changes, restores it, and reshards it onto other world sizes, and must come back to the
same world-size-free state bit for bit. Layouts are built by `layouts.build` from
`setup`'s arguments and used only through their roles. Real gloo groups over a real
TCPStore (the layout's mesh groups too); ranks are threads where the layout allows it,
and processes where it makes torch.distributed's default group its own (FSDP2).

A new layout is added to LAYOUTS and passes the same body (a pipeline's steps run through
its executor, the schedule)."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from phoenixft.checkpoint.record import Snapshot, SnapshotHeader
from phoenixft.cluster import store as kv
from phoenixft.comm.collectives import GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from phoenixft.train.layouts import LayoutArgs, build
from phoenixft.train.pipeline_schedule import Pipeline
from phoenixft.train.step import Step
from tests.support.procs import ranks_in_processes
from tests.support.threads import ranks


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _fully_shard(m: nn.Module, mesh) -> None:
    """FSDP2 per linear layer and the root; with a "tp" dimension, colwise / rowwise
    tensor parallelism over it first (every rank built the same weights)."""
    from torch.distributed.fsdp import fully_shard
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()},
                           src_data_rank=None)
        mesh = mesh["dp_shard"]
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)


def _stage(m: nn.Module, pp_mesh) -> nn.Module:
    """Stage 0: the first linear layer and the tanh; stage 1: the second linear layer;
    each keeps the model's names ("0.weight", "2.bias"), as a pipeline stage must."""
    from collections import OrderedDict
    names = [("0", "1"), ("2",)][pp_mesh.get_local_rank()]
    return nn.Sequential(OrderedDict((n, m.get_submodule(n)) for n in names))


def _square(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


_PIPELINE = Pipeline(pp=2, split=_stage, loss_fn=_square, schedule="1f1b")


@dataclass(frozen=True)
class Kind:
    setup: dict  # Session.setup's layout arguments besides the model and the optimizer
    processes: bool  # one process per rank (the layout owns the default group)
    # ranks start from different parameters and `start_from_rank0` takes rank 0's (flat), or
    # every rank must build the same ones and a difference is refused (FSDP2: no rank
    # holds another's shard of the initial parameters)
    same_init: bool
    # how 2 ranks share the unique state: "even" (flat: padded to the world), "uneven"
    # (FSDP2 cuts each tensor's rows: 7 rows over 2 ranks are 4 and 3), "first group"
    # (HSDP: the groups hold the same shards; group 0's are the unique ones)
    share: str
    worlds: tuple[int, ...] = (1, 3)  # the world sizes resharded onto (from 2)
    hidden: int = 7  # the model's hidden width (tensor parallelism cuts it evenly)


LAYOUTS = {
    "flat-zero1": Kind({}, processes=False, same_init=False, share="even"),
    "fsdp2": Kind({"parallelize": _fully_shard}, processes=True, same_init=True,
                  share="uneven"),
    # one tensor-parallel group of 2 (its ranks hold copies of what tp replicates);
    # resharded onto 2 x 2
    "fsdp2-tp2": Kind({"parallelize": _fully_shard, "tp": 2}, processes=True, same_init=True,
                      share="uneven", worlds=(4,), hidden=8),
    # replica groups of one rank: 2 groups, resharded onto 1 and 3 groups
    "hsdp": Kind({"parallelize": _fully_shard, "dp_shard": 1}, processes=True, same_init=True,
                 share="first group"),
    # one pipeline of 2 stages (each rank holds its stage's state: uneven shares);
    # resharded onto 2 replicas of it
    "pp": Kind({"pipeline": _PIPELINE}, processes=True, same_init=True, share="uneven",
               worlds=(4,)),
}


def _group(addr: str, rank: int, size: int, prefix: str) -> GroupOps:
    interrupt = Interrupt()
    interrupt.enter(0)
    pg = new_group(kv.connect(addr), f"{prefix}/", rank, size, device=torch.device("cpu"))
    return GroupOps(pg, interrupt, 30)


def _model(seed: int, hidden: int = 7) -> nn.Module:
    torch.manual_seed(seed)  # (threads share torch's generator: seed and build under a lock)
    return nn.Sequential(nn.Linear(5, hidden), nn.Tanh(), nn.Linear(hidden, 3))


_build = threading.Lock()


def _joined(kind: str, seed: int, addr: str, rank: int, world: int, prefix: str):
    """A rank's model and layout, joined to generation 0 over a fresh group (and the
    mesh groups the layout asks for)."""
    ops = _group(addr, rank, world, prefix)
    with _build:
        m = _model(seed, LAYOUTS[kind].hidden)
        lay = build(LayoutArgs(model=m, optimizer=_adamw, **LAYOUTS[kind].setup))
    lay.members.join(rank, world)
    groups = {name: _group(addr, place, size, f"{prefix}/{name}")
              for name, (place, size) in lay.members.mesh_groups(rank, world).items()}
    lay.members.bind(ops, 0, world, groups)
    return m, lay, ops


def _batch(step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step * 100 + j))
    return x, torch.zeros(4, 3)


def _train_step(m: nn.Module, lay, ops: GroupOps, step: int, rank: int, world: int) -> None:
    """One data-parallel step of `world` microbatches: this rank's (the user's loop, or
    the layout's executor: a pipeline schedule), the gradient region all-reduced and
    averaged (empty where the layout reduces in backward), the layout's update."""
    m.zero_grad(set_to_none=True)
    if lay.executor.user_loop:
        x, _ = _batch(step, rank)
        m(x).pow(2).mean().backward()
    else:
        ids = lay.work.plan(world, world)[rank]
        lay.executor.run(Step(step, ids, world, executor=lay.executor), lambda j: _batch(step, j))
    lay.math.reduce(world, f"cross-unit grads {step}")
    grads = torch.zeros(lay.math.grad_numel(), dtype=lay.math.master_dtype)
    lay.math.write_grads(grads)
    ops.allreduce(grads, f"grads {step}")
    grads.div_(world)
    lay.math.update(grads, ops, f"update {step}")


def _snapshot(lay) -> Snapshot:
    """What a snapshot keeps: copies of the unique tensors, the header through JSON."""
    header = SnapshotHeader(opt=lay.state.unique_meta(), entries=())
    return Snapshot(SnapshotHeader.from_json(header.to_json(), "test"),
                    {k: v.detach().clone() for k, v in lay.state.unique_tensors().items()})


def _full(lay, ops) -> dict:
    return {k: v.detach().clone() for k, v in lay.state.full_state(ops).items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _first_run(rank: int, kind: str, addr: str, world: int) -> tuple[tuple, dict]:
    seed = 0 if LAYOUTS[kind].same_init else rank  # apart: rank 0's parameters are taken
    m, lay, ops = _joined(kind, seed, addr, rank, world, "a")
    lay.state.start_from_rank0(ops)
    for step in (1, 2):
        _train_step(m, lay, ops, step, rank, world)
    saved = _snapshot(lay)
    json.dumps(lay.state.export_meta())  # (what persisted manifests carry)
    full2 = _full(lay, ops)
    _train_step(m, lay, ops, 3, rank, world)  # change
    full3 = _full(lay, ops)
    assert any(not torch.equal(full2[k], full3[k]) for k in full2)
    lay.state.load_unique(saved.tensors, saved.header.opt)  # restore
    lay.state.gather_params(ops, "restore")
    _same(_full(lay, ops), full2)
    _train_step(m, lay, ops, 3, rank, world)  # the same step again: the same result
    _same(_full(lay, ops), full3)
    return (saved.tensors, saved.header.to_json().decode()), full2  # (across processes)


def _resharded(rank: int, kind: str, addr: str, world: int, prefix: str, old: list) -> tuple:
    """A fresh model of another world size takes every old rank's snapshot."""
    m, lay, ops = _joined(kind, 100 + rank, addr, rank, world, prefix)
    lay.state.reshard([Snapshot(SnapshotHeader.from_json(h.encode(), "test"), t) for t, h in old])
    full = _full(lay, ops)
    # the parameters this rank's model trains: a sharded one's are DTensors (a pipeline
    # stage's only; the rest of the model on that rank is never trained there)
    sharded = {n for n, p in m.named_parameters() if hasattr(p, "full_tensor")}
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in m.named_parameters() if not sharded or n in sharded}
    return full, params


def _unique_share(rank: int, kind: str, addr: str, world: int) -> tuple[int, int]:
    m, lay, ops = _joined(kind, 0, addr, rank, world, "u")
    lay.state.start_from_rank0(ops)
    _train_step(m, lay, ops, 1, rank, world)
    return sum(t.numel() for t in lay.state.unique_tensors().values() if t.dim()), lay.state.numel


def _on_ranks(kind: str, fn, world: int, *args) -> list:
    if LAYOUTS[kind].processes:
        return ranks_in_processes(fn, world, kind, *args)
    return ranks(lambda r: fn(r, kind, *args), world)


@pytest.fixture()
def addr():
    server, port = kv.host_store("127.0.0.1")
    yield f"127.0.0.1:{port}"
    del server


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_save_change_restore_reshard_compare(kind, addr):
    world = 2
    results = _on_ranks(kind, _first_run, world, addr, world)
    old = [saved for saved, _ in results]
    full2 = results[0][1]
    _same(results[1][1], full2)  # world-size free: every rank sees one state

    for new_world in LAYOUTS[kind].worlds:  # reshard onto another world size, on fresh models
        for full, params in _on_ranks(kind, _resharded, new_world, addr, new_world,
                                      f"re{new_world}", old):
            _same(full, full2)
            _same({f"model.{n}": p for n, p in params.items()},
                  {k: v for k, v in full2.items()
                   if k.startswith("model.") and k[len("model."):] in params})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_unique_state_is_this_ranks_share_only(kind, addr):
    """Each of 2 ranks holds its share of the optimizer state, not a copy of all of it
    (HSDP: the first group holds it once, the other group's copies are not unique)."""
    (a, n), (b, _) = _on_ranks(kind, _unique_share, 2, addr, 2)
    state_per_param = 3  # master weights (or the parameters' shards), exp_avg, exp_avg_sq
    assert a + b <= state_per_param * (n + 2)  # (padding to the world size)
    share = LAYOUTS[kind].share
    if share == "even":
        assert a == b
    elif share == "uneven":
        assert 0 < min(a, b) <= max(a, b) < state_per_param * n
    else:
        assert (a, b) == (state_per_param * n, 0)


@pytest.mark.timeout(120)
def test_fsdp2_refuses_ranks_that_built_different_initial_parameters(addr):
    """FSDP2 cannot take rank 0's initial parameters (no rank holds another's shard of
    them): ranks built apart are refused with the fix, not trained apart."""
    with pytest.raises(RuntimeError, match="built different initial parameters"):
        ranks_in_processes(_apart, 2, addr)


def _apart(rank: int, addr: str) -> None:
    _, lay, ops = _joined("fsdp2", rank, addr, rank, 2, "apart")
    lay.state.start_from_rank0(ops)

"""ZeRO-1: flat parameters and the sharded optimizer."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from phoenixft.train.zero import FlatParams, ShardedOptimizer


@pytest.mark.parametrize("world", [1, 3])
def test_sharded_optimizer_matches_plain_adamw(world):
    """The shards of `world` ranks, stepped separately and gathered, equal one AdamW."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)) for _ in range(world)]
    for m in models:
        m.load_state_dict(ref.state_dict())
    flats = [FlatParams(m) for m in models]
    for f in flats:
        f.layout(world)
    opts = [ShardedOptimizer(f, lambda p: torch.optim.AdamW(p, lr=1e-2), r) for r, f in enumerate(flats)]
    for _ in range(3):
        x = torch.randn(4, 5)
        plain.zero_grad()
        ref(x).pow(2).sum().backward()
        plain.step()
        grads = []
        for m, f in zip(models, flats):
            m.zero_grad()
            m(x).pow(2).sum().backward()
            g = torch.zeros(f.buf.numel())
            f.gather_grads(g)
            grads.append(g)
        for o, g in zip(opts, grads):
            o.step(g)
        full = torch.cat([o.shard.detach() for o in opts])
        for f in flats:
            f.buf.copy_(full)
    for p, q in zip(ref.parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_sharded_optimizer_state_roundtrip():
    m = torch.nn.Linear(4, 4)
    f = FlatParams(m)
    f.layout(1)
    o = ShardedOptimizer(f, lambda p: torch.optim.AdamW(p, lr=1e-2), 0)
    m(torch.ones(2, 4)).sum().backward()
    g = torch.zeros(f.buf.numel())
    f.gather_grads(g)
    o.step(g)
    tensors = {k: v.clone() for k, v in o.state_tensors().items()}
    meta = json.loads(json.dumps(o.state_meta()))
    o.step(g)
    o.load_state(tensors, meta)
    assert torch.equal(o.shard, tensors["param_shard"])
    assert torch.equal(o.inner.state[o.shard]["exp_avg"], tensors["opt.exp_avg"])


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
])
def test_a_chunked_shard_steps_and_snapshots_exactly_as_one_tensor(monkeypatch, make):
    """On CPU the optimizer steps the shard in chunks (cache-sized; see chunk_bounds). The
    result must be bit for bit that of one tensor, the snapshot must hold each state key
    whole, and a snapshot taken in either layout must load into the other."""
    def run(chunk, steps, start=None, first=0):
        monkeypatch.setattr("phoenixft.train.zero.CPU_CHUNK", chunk)
        torch.manual_seed(0)
        flat = FlatParams(nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 7)))
        flat.layout(1)
        opt = ShardedOptimizer(flat, make, 0)
        if start is not None:
            opt.load_state(*start)
        for i in range(first, first + steps):
            g = torch.Generator().manual_seed(i)
            opt.step(torch.randn(flat.buf.numel(), generator=g))
        return opt, {k: v.clone() for k, v in opt.state_tensors().items()}, opt.state_meta()

    one, whole, meta = run(1 << 20, 3)
    chunked, parts, meta_c = run(100, 3)
    assert len(one.params) == 1 and len(chunked.params) == 15  # 1447 elements, 100 each
    assert whole.keys() == parts.keys() and len(whole) > 1
    for k in whole:
        assert torch.equal(whole[k], parts[k]), k
    assert meta == meta_c
    for chunk, other in ((100, (whole, meta)), (1 << 20, (parts, meta_c))):
        _, resumed, _ = run(chunk, 2, start=other, first=3)
        _, straight, _ = run(1 << 20, 5)
        for k in straight:
            assert torch.equal(resumed[k], straight[k]), (chunk, k)


def test_an_optimizer_with_per_tensor_norms_steps_the_shard_whole(monkeypatch):
    """Chunks would change the update of Adafactor (per-tensor RMS) or of any optimizer
    phoenixft does not know to be elementwise: those step the shard as one tensor."""
    class Custom(torch.optim.SGD):  # a subclass may change the update: not trusted either
        pass

    monkeypatch.setattr("phoenixft.train.zero.CPU_CHUNK", 100)
    flat = FlatParams(nn.Linear(40, 30))
    flat.layout(1)
    for make in (lambda p: torch.optim.Adafactor(p, lr=1e-2), lambda p: Custom(p, lr=0.1)):
        opt = ShardedOptimizer(flat, make, 0)
        assert opt.params == [opt.shard] and opt.inner.param_groups[0]["params"] == [opt.shard]
        opt.step(torch.ones(flat.buf.numel()))
        assert opt.state_tensors()["param_shard"] is not None
    assert len(ShardedOptimizer(flat, lambda p: torch.optim.SGD(p, lr=0.1), 0).params) > 1

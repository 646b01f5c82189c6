"""ZeRO-1: flat parameters and the sharded optimizer."""

from __future__ import annotations

import json

import pytest
import torch

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

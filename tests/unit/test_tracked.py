"""Tracked per-rank objects."""

from __future__ import annotations

import json

import pytest
import torch

from phoenixft.train.tracked import Tracked


def test_tracked_generator_and_stateful():
    class Pos:
        def __init__(self):
            self.i, self.t = 0, torch.zeros(2)

        def state_dict(self):
            return {"i": self.i, "t": self.t}

        def load_state_dict(self, s):
            self.i, self.t = s["i"], s["t"]

    g, p = torch.Generator().manual_seed(1), Pos()
    tr = Tracked()
    tr.add("gen", g)
    tr.add("pos", p)
    tensors, meta = tr.tensors(), json.loads(json.dumps(tr.meta()))
    first = torch.rand(3, generator=g)
    p.i, p.t = 5, torch.ones(2)
    tr.load(tensors, meta)
    assert torch.equal(torch.rand(3, generator=g), first) and p.i == 0 and not p.t.any()
    with pytest.raises(TypeError, match="cannot track"):
        tr.add("bad", object())

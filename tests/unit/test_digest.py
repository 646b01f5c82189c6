"""The final state digest."""

from __future__ import annotations

import torch

from phoenixft import state_digest


def test_state_digest_is_canonical_and_sensitive():
    a = {"w": torch.ones(3), "opt": {"step": torch.tensor(2.0)}}
    b = {"opt": {"step": torch.tensor(2.0)}, "w": torch.ones(3)}
    assert state_digest(a) == state_digest(b)
    c = {"w": torch.ones(3), "opt": {"step": torch.tensor(2.0)}}
    c["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert state_digest(a) != state_digest(c)
    assert state_digest({"w": torch.ones(3)}) != state_digest({"w": torch.ones(3, dtype=torch.float64)})

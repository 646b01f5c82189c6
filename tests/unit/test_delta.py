"""The delta codec: exact for every dtype a snapshot holds, small when little changed."""

from __future__ import annotations

import pytest
import torch

from phoenixft.checkpoint.delta import CHUNK, apply_delta, dirty_fraction, encode_delta


def as_bytes(*tensors: torch.Tensor) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_roundtrip_every_dtype(dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(200_000, generator=g) * 100).to(dtype)
    cur = base.clone()
    cur[5000:5100] += 3  # a sparse update
    cur[-1] -= 1  # the last, partial chunk too
    b, c = as_bytes(base), as_bytes(cur)
    d = encode_delta(b, c)
    assert bytes(apply_delta(b, d)) == c
    assert dirty_fraction(d) <= 3 / (len(c) // CHUNK)
    assert len(d) < len(c) / 50


def test_full_change_still_exact_and_refuses_the_wrong_base():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(100_000, generator=g)
    cur = base + 1e-3 * torch.randn(100_000, generator=g)  # every value moves a little
    b, c = as_bytes(base), as_bytes(cur)
    d = encode_delta(b, c)
    assert bytes(apply_delta(b, d)) == c and dirty_fraction(d) == 1.0
    assert len(d) < len(c)  # XOR of nearby floats compresses
    with pytest.raises(ValueError, match="bytes"):
        apply_delta(b[:-4], d)
    with pytest.raises(ValueError, match="magic"):
        apply_delta(b, b"x" * 64)
    with pytest.raises(ValueError, match="one length"):
        encode_delta(b, c[:-4])

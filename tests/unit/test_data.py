"""The example corpus and samplers."""

from __future__ import annotations

import pytest
import torch

from phoenixft.train.data import MicrobatchWindows, stdlib_corpus


def test_corpus_separates_files_with_the_given_eos():
    c = stdlib_corpus(300, max_bytes=200_000)
    assert c.dtype == torch.int16 and len(c) == 200_000
    assert (c == 300).sum() >= 1 and int(c[c != 300].max()) < 256
    with pytest.raises(ValueError, match="eos_id"):
        stdlib_corpus(1 << 16)


def test_microbatch_windows_are_a_function_of_the_id():
    w = MicrobatchWindows(stdlib_corpus(257, max_bytes=50_000), context=16, batch=2, seed=3)
    a, b = w.get(5, 1), w.get(5, 1)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], w.get(5, 2)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one

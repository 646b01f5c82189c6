"""Fingerprints (`train/consensus.py`): the digest sees any single flipped bit, and the
seal names the unique tensors that changed after a snapshot was sealed."""

from __future__ import annotations

import pytest
import torch

from phoenixft.train.consensus import Seal, digest, int_sum


@pytest.mark.parametrize("fn", [digest, int_sum])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fingerprint_changes_with_any_single_flipped_bit(fn, dtype):
    g = torch.randn(1000).to(dtype)
    d = fn(g)
    b = g.view(torch.uint8)
    for i in range(0, b.numel(), 97):
        for bit in (0, 3, 7):
            b[i] ^= 1 << bit
            assert fn(g) != d, (i, bit)
            b[i] ^= 1 << bit
    assert fn(g) == d
    assert 0 <= digest(g) < 2 ** 63  # fits the vote's int64 slots


def test_the_seal_names_what_changed_after_its_snapshot_and_nothing_before():
    state = {"param_shard": torch.randn(64), "opt.exp_avg": torch.randn(64),
             "opt.step": torch.tensor(3.0)}
    seal = Seal()
    assert seal.check(3, state) is None  # nothing sealed yet
    seal.arm(state)
    seal.record(3, {**state, "rng.torch": torch.zeros(4)})  # (the rank-local part is not sealed)
    assert seal.check(3, state) == []
    assert seal.check(4, state) is None  # another step's snapshot: no seal for it
    state["opt.exp_avg"].view(torch.uint8)[5] ^= 0x10
    assert seal.check(3, state) == ["opt.exp_avg"]
    seal.reset()  # a restore replaced the state
    assert seal.check(3, state) is None
    seal.record(3, state)  # a record after the reset (an old snapshot thread) seals nothing
    assert seal.check(3, state) is None
    seal.arm(state)
    seal.record(4, state)
    assert seal.check(4, state) == []
    seal.arm(())  # (a snapshot nobody checks: fingerprints off, a benchmark's off step)
    seal.record(5, state)
    assert seal.check(4, state) is None and seal.check(5, state) is None


def test_a_tally_names_the_minority_and_a_replay_decides_a_tie_or_stops():
    from phoenixft.train.consensus import NoMajority, outliers, replayed
    assert outliers([[7, 7, 7], [1, 1, 1]]) == {}
    assert outliers([[7, 7, 9, 7], [1, 2, 1, 1]]) == {0: [2], 1: [1]}
    with pytest.raises(NoMajority):
        outliers([[7, 9]])
    with pytest.raises(NoMajority):
        outliers([[7, 7, 9, 9]])
    assert replayed([[7, 9], [1, 1]], [[7, 7], [1, 1]]) == {0: [1]}
    assert replayed([[7, 7, 9, 9]], [[9, 9, 9, 9]]) == {0: [0, 1]}
    with pytest.raises(NoMajority, match="a replay of the step's collectives disagrees too"):
        replayed([[7, 9]], [[7, 9]])


def test_a_vote_in_classes_names_each_class_minority_and_one_digest_covers_a_list():
    from phoenixft.train.consensus import NoMajority, digest_all, outliers
    # HSDP, 3 groups of 2 places: classes {0, 2, 4} and {1, 3, 5}
    classes = [[0, 2, 4], [1, 3, 5]]
    assert outliers([[7, 8, 7, 8, 7, 8]], classes) == {}
    assert outliers([[7, 8, 7, 9, 7, 8]], classes) == {0: [3]}
    with pytest.raises(NoMajority):
        outliers([[7, 8, 9, 8]], [[0, 2], [1, 3]])  # two groups: no majority
    a, b = torch.randn(10), torch.randn(5)
    d = digest_all([a, b])
    assert d == digest_all([a.clone(), b.clone()]) != digest_all([b, a])
    b.view(torch.uint8)[3] ^= 1
    assert digest_all([a, b]) != d

"""A DataLoader's position survives a restore: a loader rebuilt from a saved state yields
exactly what the uninterrupted one yields next (across epochs, for every kind of order)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from phoenixft import IdBatches, ResumableLoader

DS = TensorDataset(torch.arange(40))


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(23))


MAKERS = {
    "distributed": lambda: DataLoader(DS, batch_size=3, drop_last=True,
                                      sampler=DistributedSampler(DS, 2, 1, seed=5)),
    "generator": lambda: DataLoader(DS, batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(3)),
    "global_rng": lambda: DataLoader(DS, batch_size=4, shuffle=True),
    "in_order": lambda: DataLoader(DS, batch_size=6),
    "iterable": lambda: DataLoader(Stream(), batch_size=5),
}


def _take(loader, n):
    return [tuple(t.tolist() for t in b) if isinstance(b, list) else b.tolist()
            for b in (next(loader) for _ in range(n))]


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("cut", [0, 3, 7, 16])
def test_resume_yields_what_the_uninterrupted_loader_yields(kind, cut):
    torch.manual_seed(0)
    whole = _take(ResumableLoader(MAKERS[kind]), 30)
    rng_after = torch.get_rng_state()

    torch.manual_seed(0)
    first = ResumableLoader(MAKERS[kind])
    head = _take(first, cut)
    state = copy.deepcopy(first.state_dict())
    rng = torch.get_rng_state()  # the session restores the global RNG with the rank

    torch.manual_seed(99)  # the replacement process starts elsewhere
    second = ResumableLoader(MAKERS[kind])
    second.load_state_dict(state)
    torch.set_rng_state(rng)
    assert head + _take(second, 30 - cut) == whole
    assert torch.equal(torch.get_rng_state(), rng_after)  # the global RNG moved on alike


def test_skipping_reads_no_sample_for_map_style_data():
    reads = []

    class Counting(TensorDataset):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    ds = Counting(torch.arange(40))
    first = ResumableLoader(lambda: DataLoader(ds, batch_size=4))
    _take(first, 5)
    second = ResumableLoader(lambda: DataLoader(ds, batch_size=4))
    second.load_state_dict(first.state_dict())
    reads.clear()
    assert _take(second, 1) == [([20, 21, 22, 23],)]
    assert reads == [20, 21, 22, 23]


def test_not_a_dataloader_and_an_empty_epoch_are_errors():
    with pytest.raises(TypeError, match="DataLoader"):
        next(ResumableLoader(lambda: [1, 2]))
    with pytest.raises(RuntimeError, match="no batch in a whole epoch"):
        next(ResumableLoader(lambda: DataLoader(DS, batch_size=64, drop_last=True)))


def test_id_batches_are_a_function_of_the_microbatch_id():
    a = IdBatches(DS, 4, microbatches=3, seed=7)
    b = IdBatches(DS, 4, microbatches=3, seed=7)
    seen = [a[s, j][0].tolist() for s in range(1, 5) for j in range(3)]
    assert [b[s, j][0].tolist() for s in range(4, 0, -1) for j in (2, 1, 0)] == \
        [seen[(s - 1) * 3 + j] for s in range(4, 0, -1) for j in (2, 1, 0)]
    first_epoch = sorted(x for batch in seen[:10] for x in batch)
    assert first_epoch == list(range(40))  # an epoch is a permutation
    with pytest.raises(IndexError):
        a[0, 0]

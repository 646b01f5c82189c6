"""`torch.utils.data.DataLoader`s whose position survives a recovery.

Per-rank data (the DDP way: each rank reads its part through a `DistributedSampler`):

    loader = phoenixft.ResumableLoader(lambda: DataLoader(
        ds, batch_size=8, sampler=DistributedSampler(ds, sess.world_size, sess.rank, seed=0)))
    sess.setup(model, opt_factory, track={"data": loader})
    ... x, y = next(loader)      # endless: epochs follow each other (set_epoch is called)

The factory runs at the first `next()`, once the rank is known (a spare builds its loader
before it knows which rank it takes over). The loader's state is (epoch, batches taken
in that epoch, the generator state the epoch's order was drawn from); a spare restoring
a dead rank's state rebuilds the same epoch and skips what was taken, at the sampler
(indices, not data, are skipped for map-style datasets). The order must be a function of
that state: a `DistributedSampler` (seed + epoch), or shuffling with the DataLoader's
`generator=`; a `RandomSampler` without a generator draws from torch's global RNG and
is accepted too (that state is kept as well).

Id-based data (ReCoVer: survivors compute a dead rank's microbatches, so the data of
microbatch (step, j) must not depend on who computes it): `IdBatches(ds, batch_size,
seed)[step.index, j]`. Per-rank loaders stay with their process when the world shrinks
or grows; jobs that change size should use id-based data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate


class _Skip:
    """A (batch) sampler without its first `n` items. Its order is drawn when `prime()`
    is called (or at the first item): a restore calls it right after the DataLoader's own
    draw (its base seed), the order in which an uninterrupted epoch draws them."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n = inner, n
        self._items: list | None = None

    def prime(self) -> None:
        if self._items is None:
            self._items = list(itertools.islice(iter(self.inner), self.n, None))

    def __iter__(self):
        return _Primed(self)

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.n)


class _Primed:
    def __init__(self, skip: _Skip) -> None:
        self.skip, self.pos = skip, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.skip.prime()
        if self.pos >= len(self.skip._items):
            raise StopIteration
        self.pos += 1
        return self.skip._items[self.pos - 1]


def _skipping(loader: DataLoader, n: int) -> tuple[DataLoader, _Skip]:
    """The same loader (workers, collate, pinning, generator) without its first n batches."""
    kw = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn,
              pin_memory=loader.pin_memory, timeout=loader.timeout,
              worker_init_fn=loader.worker_init_fn, generator=loader.generator,
              multiprocessing_context=loader.multiprocessing_context,
              persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    if loader.batch_sampler is not None:
        skip = _Skip(loader.batch_sampler, n)
        return DataLoader(loader.dataset, batch_sampler=skip, **kw), skip
    skip = _Skip(loader.sampler, n)
    return DataLoader(loader.dataset, sampler=skip, batch_size=None, **kw), skip


class ResumableLoader:
    """An endless iterator over a DataLoader's epochs with `state_dict`/`load_state_dict`
    (track it with `Session.setup(track={...})`)."""

    def __init__(self, make: Callable[[], DataLoader] | DataLoader) -> None:
        self._make = make if callable(make) and not isinstance(make, DataLoader) else (lambda: make)
        self.loader: DataLoader | None = None
        self.epoch = 0
        self.taken = 0  # batches of this epoch handed out
        self._rng: torch.Tensor | None = None  # the RNG state this epoch's order came from
        self._it: Iterator | None = None

    def _build(self) -> DataLoader:
        if self.loader is None:
            loader = self._make()
            if not isinstance(loader, DataLoader):
                raise TypeError("ResumableLoader needs a torch.utils.data.DataLoader (or a "
                                "function returning one)")
            self.loader = loader
        return self.loader

    def _start_epoch(self, resume: bool) -> None:
        loader = self._build()
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        gen = loader.generator
        if not resume:
            self._rng = (gen.get_state() if gen is not None else torch.get_rng_state())
            self._it = iter(loader)
            return
        # a restored position: replay the epoch's draws from the RNG state they came from,
        # without touching the global RNG (restored separately, already past those draws)
        with torch.random.fork_rng(devices=[]):
            if gen is not None:
                gen.set_state(self._rng)
            elif self._rng is not None:
                torch.set_rng_state(self._rng)
            if isinstance(loader.dataset, IterableDataset):
                it = iter(loader)
                for _ in range(self.taken):  # no index to skip: read and drop
                    next(it)
            else:
                replay, skip = _skipping(loader, self.taken)
                it = iter(replay)
                skip.prime()
        self._it = it

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self):
        if self._it is None:
            self._start_epoch(resume=self.taken > 0)
        for _ in range(2):
            try:
                batch = next(self._it)
            except StopIteration:
                self.epoch, self.taken = self.epoch + 1, 0
                self._start_epoch(resume=False)
                continue
            self.taken += 1
            return batch
        raise RuntimeError("the DataLoader yields no batch in a whole epoch (empty dataset, "
                           "or drop_last with fewer samples than a batch)")

    def state_dict(self) -> dict:
        out = {"epoch": self.epoch, "taken": self.taken}
        if self._rng is not None:
            out["rng"] = self._rng
        return out

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])
        self._rng = state.get("rng")
        self._it = None  # rebuilt at the next batch


class IdBatches:
    """Batches of a map-style dataset as a pure function of the microbatch id (step, j):
    epoch e is a permutation drawn from (seed, e); microbatch (step, j) of a job with M
    microbatches per step takes the (step-1)*M + j -th batch of the endless sequence."""

    def __init__(self, dataset: Dataset, batch_size: int, *, microbatches: int, seed: int = 0,
                 collate_fn: Callable = default_collate) -> None:
        self.ds, self.bs, self.m, self.seed = dataset, batch_size, microbatches, seed
        self.collate = collate_fn
        self.per_epoch = len(dataset) // batch_size
        if self.per_epoch < 1:
            raise ValueError(f"dataset of {len(dataset)} items has no full batch of {batch_size}")
        self._perm: tuple[int, torch.Tensor] | None = None

    def __getitem__(self, key: tuple[int, int]):
        step, j = key
        if not (step >= 1 and 0 <= j < self.m):
            raise IndexError(f"microbatch id {key}: step must be >= 1 and j in [0, {self.m})")
        k = (step - 1) * self.m + j
        epoch, b = divmod(k, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.ds), generator=g))
        idx = self._perm[1][b * self.bs:(b + 1) * self.bs].tolist()
        return self.collate([self.ds[i] for i in idx])

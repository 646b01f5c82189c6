"""Silent data corruption found by consensus (data parallel), and by a seal.

Between the step's all-reduce and the update every data-parallel rank holds the same
reduced gradients, bit for bit, and between updates the same parameters: a bit flipped in
one rank's copy (bad memory, a faulty core) shows as a digest that differs from the
others'. With ZeRO-1 rank r updates its own shard from the reduced gradients and
the all-gather carries the result into every rank's parameters, after which the ranks agree
again on wrong values: so the vote decides before that step counts (its all-reduce runs
through the optimizer step; a rejected update is undone from each rank's own snapshot of
the step before, `fingerprints.py`). Every `every` steps each rank
digests both (`digest`), the digests ride in one tiny all-reduce (each rank its own
slots, `exchange`), and a strict majority names the ranks that differ (`outliers`).
With no strict majority (two ranks, or a split vote) the step's collectives are
replayed from what they were computed from (each rank's own gradients, the master
shards) and digested again (`replayed`): a rank whose first copy differs from the value
all now agree on is named. A replay that disagrees too stops the job before the update,
its committed state intact.

What a rank alone holds (with ZeRO-1 its master shard and optimizer moments) has no
replica to vote with. The snapshot thread hashes it right after copying snapshot T
(`Seal.record`); before step T+1's all-reduce the rank hashes it again (`Seal.check`):
a difference is memory that changed at rest, and the rank names itself. The snapshot,
taken before the change, is what its replacement restores.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import Counter

import torch
import xxhash

from phoenixft.cluster.keys import ReportKind
from phoenixft.comm.collectives import CommFailure, GroupOps


class Outvoted(CommFailure):
    """The step's fingerprint vote (or a rank's own seal) named ranks whose state differs
    from what it must be: the step is abandoned before its update (its finished
    microbatches are kept by the others) and the leader replaces those ranks."""


def name_ranks(member, events, event: str, step: int, named: dict[int, str], reports: bool,
               field: str = "named") -> None:
    """Abandon step `step` over the ranks `named` (rank -> why): the reporting rank
    (`reports`) emits `event` (the ranks under `field`, their workers, why) and reports each
    to the leader as CORRUPT (it fences and replaces them); every rank raises Outvoted."""
    if reports:
        members, ranks = member.plan.members, sorted(named)
        events.emit(event, rank=member.rank, gen=member.generation, step=step,
                    **{field: ranks}, wids=[members[r] for r in ranks],
                    found=[named[r] for r in ranks])
        for r in ranks:
            member.report(ReportKind.CORRUPT, named[r], wid=members[r])
    raise Outvoted(f"step {step}: {'; '.join(named.values())}")


class RolledBack(CommFailure):
    """The step's vote found copies that differ where nobody can be outvoted (two ranks,
    a tp pair, or copies a snapshot may hold already): the job goes back to the last step
    a vote vouched for, with the same members."""


class NoMajority(RuntimeError):
    """The ranks' fingerprints disagree and no strict majority says which are right."""


NONE = -1  # a digest slot of a rank that has no such digest (digests are >= 0)
_CHUNK = 1 << 20  # integers < 2**31 each: a chunk's sum < 2**51, exact in a double


def digest(t: torch.Tensor) -> int:
    """A 63-bit digest of the tensor's bytes. On the host: xxh3-64 (about 4x faster here
    than summing the elements as integers; a flipped bit goes unseen with probability
    2**-64). On a device, where hashing would need a copy to the host: the sum of the
    elements read as integers of their own width (int32 for fp32, int16 for bf16), in
    doubles per chunk of 2**20 (exact): any single flipped bit changes it by a power of
    two."""
    if t.device.type == "cpu":
        try:  # (the usual tensor: contiguous, no grad, a dtype numpy has; one call)
            return xxhash.xxh3_64_intdigest(t.numpy()) >> 1
        except (TypeError, RuntimeError, ValueError):  # (bf16, a leaf with grad, a view)
            x = t.detach().contiguous().view(-1)
            return xxhash.xxh3_64_intdigest(x.view(torch.uint8).numpy()) >> 1
    return int_sum(t.detach().contiguous().view(-1))


def digest_all(ts: list[torch.Tensor]) -> int:
    """One digest of several tensors (`digest` of each, hashed together)."""
    if len(ts) == 1:
        return digest(ts[0])
    return xxhash.xxh3_64_intdigest(b"".join(digest(t).to_bytes(8, "little") for t in ts)) >> 1


def int_sum(x: torch.Tensor) -> int:
    """`digest` on a device: the exact sum of the elements read as integers."""
    ints = x.view({4: torch.int32, 2: torch.int16}.get(x.element_size(), torch.uint8))
    return sum(int(c.double().sum()) for c in ints.split(_CHUNK))


class Tally:
    """Every rank's digests, by one all-reduce of `len(mine)` x world_size integers (each
    rank its own column), started at once and awaited by `result` (the caller may work
    in between): for each digest, the ranks' values in rank order."""

    def __init__(self, ops: GroupOps, rank: int, world_size: int, mine: list[int],
                 what: str) -> None:
        self.slots = torch.zeros(len(mine), world_size, dtype=torch.int64)
        self.slots[:, rank] = torch.tensor(mine, dtype=torch.int64)
        self._wait = ops.allreduce_start(self.slots, what)

    def result(self) -> list[list[int]]:
        self._wait()
        return self.slots.tolist()


def exchange(ops: GroupOps, rank: int, world_size: int, mine: list[int],
             what: str) -> list[list[int]]:
    """`Tally(...).result()`: the digests of every rank, now."""
    return Tally(ops, rank, world_size, mine, what).result()


def outliers(tally: list[list[int]], classes: list[list[int]] | None = None,
             names: list[str] | None = None, skip: int | None = None) -> dict[int, list[int]]:
    """For each digest i whose ranks disagree within a class (`classes`: the sets of ranks
    that must agree; None: all of them), the ranks outside their class's strict majority,
    or NoMajority when a class has none. A rank whose value is `skip` has none (it took
    no part in what the digest covers: a spare that joined since) and is left out."""
    out: dict[int, list[int]] = {}
    for i, values in enumerate(tally):
        for cls in classes or [list(range(len(values)))]:
            cls = [r for r in cls if skip is None or values[r] != skip]
            if len(cls) < 2:
                continue
            mine = [values[r] for r in cls]
            value, n = Counter(mine).most_common(1)[0]
            if n == len(mine):
                continue
            if 2 * n <= len(mine):
                what = names[i] if names else f"digest {i}"
                raise NoMajority(f"no strict majority says which {what} are right "
                                 f"({_each(values, cls)})")
            out.setdefault(i, []).extend(r for r in cls if values[r] != value)
    return {i: sorted(rs) for i, rs in out.items()}


def encode(values: list[int], dtype: torch.dtype) -> list[float]:
    """Digests (63-bit integers >= 0, or -1: none) as floats that a sum with zeros leaves
    exact in `dtype`: `chunks(dtype)` of `bits(dtype)` bits each (a rank's own slots in an
    all-reduce where every other rank adds 0)."""
    b, n = bits(dtype), chunks(dtype)
    out = []
    for v in values:
        out += [float(NONE)] + [0.0] * (n - 1) if v < 0 else \
            [float((v >> (b * i)) & ((1 << b) - 1)) for i in range(n)]
    return out


def encode_into(values: list[int], out: torch.Tensor) -> None:
    """`encode` written into `out` (a host tensor of fp32 or fp64 through numpy: one call
    where a new tensor and a copy take two)."""
    floats = encode(values, out.dtype)
    try:
        out.numpy()[:] = floats
    except (TypeError, RuntimeError):  # (bf16, a device)
        out.copy_(torch.tensor(floats, dtype=out.dtype))


def alike(slots: torch.Tensor, world_size: int, zero_tail: int) -> bool:
    """Every rank's row of `slots` (rank-major) holds the same bits, and the last
    `zero_tail` elements of each are 0 (+0.0): the usual carried vote, with nothing to
    decode or judge. Compared as bytes (a few us; torch's compare of views took 20)."""
    try:
        raw = slots.numpy().tobytes()
    except (TypeError, RuntimeError):  # (bf16, a device)
        raw = slots.detach().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    row = len(raw) // world_size
    tail = zero_tail * slots.element_size()
    return raw == raw[:row] * world_size and raw[row - tail:row].count(0) == tail


def decode(t: torch.Tensor, count: int) -> list[int]:
    """`count` digests back from `encode`'s floats (-1: none)."""
    b, n = bits(t.dtype), chunks(t.dtype)
    xs = t.double().tolist()
    out = []
    for k in range(count):
        c = xs[k * n:(k + 1) * n]
        out.append(NONE if c[0] < 0 else sum(int(x) << (b * i) for i, x in enumerate(c)))
    return out


@functools.cache  # (asked a few times a step; torch.finfo is not free)
def bits(dtype: torch.dtype) -> int:
    """Bits a float of `dtype` holds exactly as an integer chunk (its mantissa's)."""
    return min(round(-math.log2(torch.finfo(dtype).eps)), 30)  # (fp32: 23, bf16: 7)


@functools.cache
def chunks(dtype: torch.dtype) -> int:
    return -(-63 // bits(dtype))


def replayed(first: list[list[int]], again: list[list[int]]) -> dict[int, list[int]]:
    """A replay (the step's collectives run again from the state they were computed from)
    gave `again`: for each digest i, the ranks whose first value differs from the one
    value every rank now agrees on; NoMajority when the replay disagrees too."""
    out: dict[int, list[int]] = {}
    for i, (values, now) in enumerate(zip(first, again)):
        if len(set(now)) != 1:
            raise NoMajority(
                f"the ranks' fingerprints disagree ({_each(values)}), no strict majority says "
                f"which are right, and a replay of the step's collectives disagrees too "
                f"({_each(now)}); the job stops before the update, its last committed step "
                "intact")
        bad = [r for r, v in enumerate(values) if v != now[0]]
        if bad:
            out[i] = bad
    return out


def _each(values: list[int], ranks: list[int] | None = None) -> str:
    return ", ".join(f"rank {r}: {values[r]:#x}" for r in ranks or range(len(values)))


class Seal:
    """Per-tensor hashes of a rank's unique state (a layout's `unique_tensors`) taken by
    the snapshot thread once snapshot `step` is copied (`record`), checked by the
    training thread before that state is used again (`check`). Host tensors only: a
    device tensor would have to be copied to be hashed (`record` skips them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = -1
        self._names: tuple[str, ...] = ()
        self._hashes: dict[str, int] = {}

    def arm(self, names) -> None:
        """The training thread: which of the next snapshot's tensors to hash."""
        with self._lock:
            self._names = tuple(names)

    def reset(self) -> None:
        """The state was restored or replaced: nothing is sealed until the next snapshot."""
        with self._lock:
            self._step, self._hashes, self._names = -1, {}, ()

    def record(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """(Snapshot thread) snapshot `step` of `tensors` is copied: hash its unique part."""
        with self._lock:
            names = self._names
            if not names:  # (not armed for this snapshot: nothing will check it)
                self._step, self._hashes = -1, {}
                return
        if any(tensors[n].device.type != "cpu" for n in names if n in tensors):
            return
        hashes = {n: digest(tensors[n]) for n in names if n in tensors}
        with self._lock:
            self._step, self._hashes = step, hashes

    def check(self, step: int, tensors: dict[str, torch.Tensor]) -> list[str] | None:
        """The names of the tensors that changed since snapshot `step` was sealed ([] when
        none did), or None when snapshot `step` has no seal (no snapshot taken, a device,
        a restore since)."""
        with self._lock:
            if self._step != step:
                return None
            hashes = self._hashes  # (`record` and `reset` replace it, never change it)
        return [n for n, h in hashes.items() if n not in tensors or digest(tensors[n]) != h]

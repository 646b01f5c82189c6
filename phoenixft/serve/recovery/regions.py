"""The engine's state as registered regions, each with a handler specialised when it is
registered: what to capture for the log, and how to apply a record back at recovery.

- `KVRegion`: the K and V caches ``[layers, blocks, block_size, kv_heads, head_dim]``.
  A task names the slots written since their last record (block, lo, hi); capture is one
  vectorised gather of those slots across every layer (`kv_slots.HostKV` when the
  executor is a process reading the cache from shared memory; `KVRegion.capture` when it
  is a thread, any device), apply one scatter. No Python loop over blocks touches tensor
  data.
- `StateRegion`: the requests: for each sequence only what changed since its last record
  (new token ids, with the emitted text length after each, progress, a grown block table),
  new sequences whole, finished ones as gone, and the scheduler's queue order. Encoded by
  the decode loop (it is small and must be a consistent view), written by the executor.

Only the slots a request owns up to its computed length are ever read back, so capturing a
partly written block later than the step that wrote it is harmless; a freed block is not
reused until the log has processed it (the block manager's quarantine).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from phoenixft.serve.engine.sequence import Sequence, SequenceStatus

from .kv_slots import KV_HEAD, ranges_header, slots


class KVRegion:
    region_id = 1

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        layers, blocks, bs, heads, dim = k_cache.shape
        self.k = k_cache.view(layers, blocks * bs, heads, dim)
        self.v = v_cache.view(layers, blocks * bs, heads, dim)
        self.block_size, self.dtype = bs, k_cache.dtype
        self.slot_shape = (layers, heads, dim)

    def slots(self, ranges: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(slots(ranges, self.block_size))

    def capture(self, ranges: np.ndarray) -> list:
        """Record payload as parts (see `kv_slots.HostKV`): a cache on any device, read by
        the executor when it is a thread of the engine."""
        idx = self.slots(ranges).to(self.k.device)
        k = self.k.index_select(1, idx).cpu()
        v = self.v.index_select(1, idx).cpu()
        return [ranges_header(ranges), _raw(k), _raw(v)]

    def apply(self, payload: bytes) -> None:
        (n,) = KV_HEAD.unpack_from(payload, 0)
        off = KV_HEAD.size
        ranges = np.frombuffer(payload, dtype="<u4", count=3 * n, offset=off).reshape(n, 3)
        off += ranges.nbytes
        idx = self.slots(ranges)
        layers, heads, dim = self.slot_shape
        shape = (layers, len(idx), heads, dim)
        size = layers * len(idx) * heads * dim * self.k.element_size()
        k = torch.frombuffer(bytearray(payload[off:off + size]), dtype=self.dtype).view(shape)
        v = torch.frombuffer(bytearray(payload[off + size:off + 2 * size]),
                             dtype=self.dtype).view(shape)
        idx = idx.to(self.k.device)
        self.k.index_copy_(1, idx, k.to(self.k.device))
        self.v.index_copy_(1, idx, v.to(self.v.device))


def _raw(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def dirty_ranges(dirty: dict[int, list[int]]) -> np.ndarray:
    """The block manager's dirty map as ranges [n, 3] = (block, lo, hi)."""
    if not dirty:
        return np.zeros((0, 3), dtype=np.int64)
    return np.array([(b, lo, hi) for b, (lo, hi) in dirty.items()], dtype=np.int64)


class StateRegion:
    """Request state, as deltas against what was last recorded (see the module doc)."""

    region_id = 2

    def __init__(self) -> None:
        self._logged: dict[str, tuple[int, int]] = {}  # seq id -> (tokens, table length)

    def delta(self, seqs: dict[str, Sequence], waiting: list[str], running: list[str]) -> dict:
        entries = []
        for sid, s in seqs.items():
            prev = self._logged.get(sid)
            if prev is None:
                entries.append({"new": _whole(s)})
                continue
            n_tokens, n_table = prev
            e: dict = {"id": sid}
            if len(s.token_ids) > n_tokens:
                e["tokens"] = s.token_ids[n_tokens:]
                e["emitted"] = s.emitted[n_tokens - s.num_prompt_tokens:]
            if len(s.block_table) != n_table:
                e["table"] = s.block_table
            e["nc"], e["st"] = s.num_computed_tokens, s.status.value
            entries.append(e)
        gone = [sid for sid in self._logged if sid not in seqs]
        return {"entries": entries, "gone": gone, "waiting": waiting, "running": running}

    def full(self, seqs: dict[str, Sequence], waiting: list[str], running: list[str]) -> dict:
        return {"entries": [{"new": _whole(s)} for s in seqs.values()], "gone": [],
                "waiting": waiting, "running": running}

    def recorded(self, seqs: dict[str, Sequence], *, full: bool = False) -> None:
        """The delta was enqueued: the next one starts from here."""
        if full:
            self._logged = {}
        for sid in [sid for sid in self._logged if sid not in seqs]:
            del self._logged[sid]
        for sid, s in seqs.items():
            self._logged[sid] = (len(s.token_ids), len(s.block_table))

    @staticmethod
    def encode(d: dict) -> bytes:
        return json.dumps(d, separators=(",", ":")).encode()


def _whole(s: Sequence) -> dict:
    d = s.to_dict()
    d.pop("output_text", None)
    d["emitted"] = list(s.emitted)
    return d


class StateTable:
    """Recovery's side of `StateRegion`: apply records in order, then the live sequences."""

    def __init__(self) -> None:
        self.seqs: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []

    def apply(self, payload: bytes, full: bool) -> None:
        d = json.loads(payload)
        if full:
            self.seqs = {}
        for e in d["entries"]:
            if "new" in e:
                self.seqs[e["new"]["seq_id"]] = dict(e["new"])
                continue
            s = self.seqs[e["id"]]
            if "tokens" in e:
                s["token_ids"] = s["token_ids"] + e["tokens"]
                s["emitted"] = s["emitted"] + e["emitted"]
            if "table" in e:
                s["block_table"] = e["table"]
            s["num_computed_tokens"], s["status"] = e["nc"], e["st"]
        for sid in d["gone"]:
            self.seqs.pop(sid, None)
        self.waiting, self.running = d["waiting"], d["running"]

    def sequences(self) -> tuple[list[Sequence], list[Sequence]]:
        """(waiting, running) as Sequences, in the scheduler's order."""
        def build(sid: str) -> Sequence:
            d = dict(self.seqs[sid])
            emitted = d.pop("emitted")
            seq = Sequence.from_dict({**d, "output_text": ""})
            seq.emitted = emitted
            seq.num_emitted_chars = emitted[-1] if emitted else 0
            return seq
        waiting = [build(s) for s in self.waiting if s in self.seqs]
        running = [build(s) for s in self.running if s in self.seqs]
        for seq in waiting:
            seq.status = SequenceStatus.WAITING
        return waiting, running

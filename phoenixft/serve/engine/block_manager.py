"""Paged KV cache bookkeeping: fixed-size blocks, ref counts, prefix sharing, dirty set.

The KV tensors themselves live in the runner ([layers, num_blocks, block_size, kv_heads,
head_dim]); this class only decides which block holds which tokens.

Guarantees:
- A block with ``ref_count > 0`` is never handed to another sequence unless both hold the
  same prefix (same chained hash *and* same token ids, so a hash collision cannot alias).
- Only full blocks whose K/V were computed are registered for sharing, and a sequence
  never takes its *last* token from the shared cache, so every prefill computes at least
  one token (it needs that token's logits).
- Freed blocks keep their contents and hash until reused (LRU order), so a preempted or
  repeated prompt can find them again.
- ``dirty`` maps each block written since the last ``take_dirty()`` to the slot range
  [lo, hi) written: the crash-recovery log copies only those slots.
- With ``hold(epoch)`` set (the recovery log is on), a freed block is *quarantined* until
  the log has processed that epoch (``release(processed)``): the log copies a block's KV
  after the step that wrote it, so the block must not be rewritten by a new owner before
  then. A quarantined block still serves prefix-cache hits (they only read it).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from .sequence import Sequence


def chain_root(seq: Sequence) -> int | None:
    """What a sequence's first block hash chains from: a request with an adapter computes
    different K/V for the same tokens, so its cached prefixes are its adapter version's."""
    if seq.adapter is None:
        return None
    return xxhash.xxh64_intdigest(f"{seq.adapter}\0{seq.adapter_version}".encode())


def block_hash(prev: int | None, tokens: list[int] | tuple[int, ...]) -> int:
    """Chained hash of a full block: it identifies the whole prefix, not just the block."""
    data = array("q", [-1 if prev is None else prev - (1 << 63), *tokens]).tobytes()
    return xxhash.xxh64_intdigest(data)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got "
                             f"{num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.dirty: dict[int, list[int]] = {}
        self.num_cache_hits = 0
        self.quarantine: dict[int, int] = {}  # block -> epoch it was freed in
        self.hold_epoch: int | None = None  # set while the recovery log runs

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks  # quarantined blocks count as used

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_needed(len(seq)) <= len(self.free)

    def can_append(self, seq: Sequence) -> bool:
        """True if the slot for the token a decode step computes is (or can be) held."""
        return self.blocks_needed(len(seq)) <= len(seq.block_table) or len(self.free) > 0

    # -- mutations -----------------------------------------------------------------------
    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hashes[block]
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.hashes[block], self.block_tokens[block] = None, None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached full prefix blocks."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError("allocate called without can_allocate")
        bs, table, prev, hit = self.block_size, [], chain_root(seq), self.enable_prefix_caching
        for i in range(self.blocks_needed(len(seq))):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block = None
            if hit and (i + 1) * bs < len(seq):  # full, and not holding the last token
                h = block_hash(prev, tokens)
                cand = self.hash_to_block.get(h)
                if cand is not None and self.block_tokens[cand] == tokens:
                    block, prev = cand, h
                    if self.ref_counts[cand] == 0:
                        if cand in self.quarantine:
                            del self.quarantine[cand]
                        else:
                            del self.free[cand]
                    self.ref_counts[cand] += 1
            if block is None:
                hit = False
                block = self._take_free()
            table.append(block)
        num_hits = 0
        for b in table:
            if self.hashes[b] is None:
                break
            num_hits += 1
        seq.block_table = table
        seq.num_computed_tokens = num_hits * bs
        self.num_cache_hits += num_hits

    def append(self, seq: Sequence) -> None:
        """Make sure ``seq`` holds a slot for each of its tokens (one new block at most)."""
        while self.blocks_needed(len(seq)) > len(seq.block_table):
            if not self.free:
                raise RuntimeError("append called without can_append")
            seq.block_table.append(self._take_free())

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks first so shared prefixes are evicted last."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.hold_epoch is None:
                    self.free[block] = None
                else:
                    self.quarantine[block] = self.hold_epoch
        seq.block_table = []
        seq.num_computed_tokens = 0

    def release(self, processed_epoch: int) -> None:
        """The log has processed every epoch up to `processed_epoch`: quarantined blocks
        freed by then may be reused."""
        if self.quarantine:
            for b in [b for b, e in self.quarantine.items() if e <= processed_epoch]:
                del self.quarantine[b]
                self.free[b] = None

    def mark_computed(self, seq: Sequence, start: int, end: int) -> None:
        """Record that tokens [start, end) of ``seq`` were written: dirty + register full."""
        bs = self.block_size
        for i in range(start // bs, -(-end // bs)):
            block = seq.block_table[i]
            lo, hi = max(start - i * bs, 0), min(end - i * bs, bs)
            rng = self.dirty.get(block)
            if rng is None:
                self.dirty[block] = [lo, hi]
            else:
                rng[0], rng[1] = min(rng[0], lo), max(rng[1], hi)
            if (self.enable_prefix_caching and (i + 1) * bs <= end
                    and self.hashes[block] is None):
                prev = self.hashes[seq.block_table[i - 1]] if i else chain_root(seq)
                if i and prev is None:
                    continue
                tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                h = block_hash(prev, tokens)
                self.hashes[block], self.block_tokens[block] = h, tokens
                self.hash_to_block.setdefault(h, block)

    def take_dirty(self) -> dict[int, list[int]]:
        """Blocks written since the previous call, each with its written slots [lo, hi)."""
        dirty, self.dirty = self.dirty, {}
        return dirty

    def rebuild(self, tables: list[list[int]]) -> None:
        """State from the block tables of the live sequences alone (a recovery: the log
        holds those, not the allocator's bookkeeping). Every other block is free; cached
        prefixes are forgotten."""
        self.ref_counts = [0] * self.num_blocks
        for table in tables:
            for b in table:
                self.ref_counts[b] += 1
        self.hashes = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.hash_to_block = {}
        self.free = OrderedDict((b, None) for b in range(self.num_blocks) if not self.ref_counts[b])
        self.dirty, self.quarantine = {}, {}

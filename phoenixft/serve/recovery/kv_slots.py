"""KV slots as index arrays, and their capture from a host cache, in numpy only: the log
executor's process uses it without importing torch.

A cache is viewed as ``[layers, blocks * block_size, kv_heads * head_dim]`` elements of any
width (bfloat16 is captured as raw 16-bit words); a task names slot ranges
``[n, 3] = (block, lo, hi)``.
"""

from __future__ import annotations

import struct

import numpy as np

KV_HEAD = struct.Struct("<I")  # number of ranges, then the ranges as u32 triples


def slots(ranges: np.ndarray, block_size: int) -> np.ndarray:
    """Flat slot indices of ranges [n, 3] = (block, lo, hi), vectorised (numpy: small arrays
    keep the GIL, so no hand-off to the decode loop per operation)."""
    r = ranges.astype(np.int64, copy=False)
    lens = r[:, 2] - r[:, 1]
    starts = r[:, 0] * block_size + r[:, 1]
    within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(lens.cumsum() - lens, lens)
    return np.repeat(starts, lens) + within


def ranges_header(ranges: np.ndarray) -> bytes:
    return KV_HEAD.pack(len(ranges)) + ranges.astype("<u4").tobytes()


class HostKV:
    """Capture from host K and V arrays ``[layers, slots, ...]`` (shared memory)."""

    def __init__(self, k: np.ndarray, v: np.ndarray, block_size: int) -> None:
        self.k, self.v, self.block_size = k, v, block_size

    def capture(self, ranges: np.ndarray) -> list:
        """Record payload as parts: the ranges, then K and V of those slots in every layer
        (one gather each; the parts are written, not joined)."""
        idx = slots(ranges, self.block_size)
        return [ranges_header(ranges), np.take(self.k, idx, axis=1),
                np.take(self.v, idx, axis=1)]

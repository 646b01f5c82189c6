"""Differential records: a blob (a snapshot's bytes) as the chunks that changed since a
base blob, each XORed against the base's chunk and compressed.

Works on bytes, so every dtype a snapshot holds (fp32, bf16, int64 counters, RNG state)
is handled alike. Unchanged chunks (found by comparing xxh3 hashes of base and current
chunks) cost nothing; a chunk whose values moved a little XORs to bytes that are mostly
zero in their high bits, which zstd compresses.

Layout of an encoded delta::

    magic b"PHXDLT1\\0" | u64 blob length | u64 chunk size | u64 dirty count
    | dirty chunk indices (u64 each) | zstd( XOR of each dirty chunk, concatenated )

`apply_delta(base, delta)` needs the exact base it was made against: callers keep the
base's checksum beside the delta and verify the result's checksum (records.py).
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash
import zstandard

MAGIC = b"PHXDLT1\0"
CHUNK = 4 * 1024  # small enough that sparse updates (embedding rows) stay sparse
_HEAD = struct.Struct("<8sQQQ")


def chunk_hashes(buf, chunk: int = CHUNK) -> np.ndarray:
    """xxh3-64 of each `chunk`-byte piece of `buf` (the last one may be shorter). A base's
    hashes are computed once and kept beside it; each new blob's are compared to them."""
    a = np.frombuffer(buf, dtype=np.uint8)
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(a[i:i + chunk]) for i in range(0, len(a), chunk)),
                       dtype=np.uint64, count=-(-len(a) // chunk))


def encode_delta(base, cur, *, chunk: int = CHUNK, level: int = 1,
                 base_hashes: np.ndarray | None = None) -> bytes:
    """The delta that turns `base` into `cur` (bytes-like, the same length). Chunks are
    found changed by their xxh3 hashes (`base_hashes`: the base's, if already known)."""
    b = np.frombuffer(base, dtype=np.uint8)
    c = np.frombuffer(cur, dtype=np.uint8)
    if len(b) != len(c):
        raise ValueError(f"a delta needs blobs of one length, got {len(b)} and {len(c)}")
    if base_hashes is None or len(base_hashes) != -(-len(b) // chunk):
        base_hashes = chunk_hashes(b, chunk)
    dirty = np.flatnonzero(chunk_hashes(c, chunk) != base_hashes)
    body = zstandard.ZstdCompressor(level=level).compress(_xor_chunks(b, c, dirty, chunk))
    index = dirty.astype("<u8").tobytes()
    return _HEAD.pack(MAGIC, len(c), chunk, len(dirty)) + index + body


def _xor_chunks(b: np.ndarray, c: np.ndarray, dirty: np.ndarray, chunk: int) -> bytes:
    """The XOR of base and current over the dirty chunks, concatenated in order: whole
    chunks in one vectorised gather (a Python loop over 5,000 chunks of a 20 MB blob was
    half of a delta's cost), the short last chunk, if dirty, after them."""
    whole = len(c) // chunk
    full = dirty[dirty < whole]
    out = np.bitwise_xor(b[:whole * chunk].reshape(whole, chunk)[full],
                         c[:whole * chunk].reshape(whole, chunk)[full]).tobytes()
    if len(full) < len(dirty):  # the last, shorter chunk changed too
        out += np.bitwise_xor(b[whole * chunk:], c[whole * chunk:]).tobytes()
    return out


def apply_delta(base, delta) -> bytearray:
    """`base` with `delta` applied (a new buffer)."""
    view = memoryview(delta)
    magic, length, chunk, count = _HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise ValueError("not a phoenixft delta (bad magic)")
    if len(base) != length:
        raise ValueError(f"delta made for a blob of {length} bytes, base has {len(base)}")
    off = _HEAD.size
    dirty = np.frombuffer(view[off:off + 8 * count], dtype="<u8")
    xored = np.frombuffer(zstandard.ZstdDecompressor().decompress(view[off + 8 * count:]),
                          dtype=np.uint8)
    out = bytearray(base)
    arr = np.frombuffer(out, dtype=np.uint8)
    pos = 0
    for i in dirty.tolist():
        sl = slice(i * chunk, min((i + 1) * chunk, length))
        n = sl.stop - sl.start
        np.bitwise_xor(arr[sl], xored[pos:pos + n], out=arr[sl])
        pos += n
    if pos != len(xored):
        raise ValueError("delta payload does not match its chunk index")
    return out


def dirty_fraction(delta) -> float:
    """Share of the blob's chunks this delta carries."""
    _, length, chunk, count = _HEAD.unpack_from(memoryview(delta), 0)
    return count / max(1, -(-length // chunk))

"""Checksums for every record on every tier (xxh3-128: ~20 GB/s, so verifying a
snapshot costs far less than copying it)."""

from __future__ import annotations

import xxhash


class IntegrityError(RuntimeError):
    """A snapshot or record failed verification; it must never be loaded."""


def checksum(buf) -> str:
    """Checksum of a buffer (bytes, memoryview, numpy array, mmap slice)."""
    return xxhash.xxh3_128_hexdigest(buf)


def hasher():
    """An incremental `checksum`: `update()` with consecutive pieces of a buffer, then
    `hexdigest()` equals `checksum` of the whole (so a buffer can be hashed piece by piece
    while each piece is still in cache)."""
    return xxhash.xxh3_128()

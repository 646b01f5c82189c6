"""A small real disk for tests of a full or read-only file system: a tmpfs of a few MiB
that the test mounts (CI runs as root) and fills itself, as another tenant would."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size: str, deselect: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `where/disk`, unmounted after. Without root the test
    fails naming why (and the `-k 'not DESELECT'` to run the rest unprivileged): a skip
    would let CI pass without checking anything."""
    if os.geteuid() != 0:
        pytest.fail(f"needs root to mount a small tmpfs (CI runs as root); deselect with "
                    f"-k 'not {deselect}' to run the rest unprivileged")
    mnt = where / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_up(disk: Path) -> Path:
    """Write a file until the disk has no room left (ENOSPC); returns it. Unbuffered: a
    buffered file would retry its last partial write on close and raise."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(64 << 10))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler

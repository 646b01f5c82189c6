"""What a node's workers each say, gathered on the node and told the store once.

A worker offers its line (its snapshot's acknowledgement count, its restore source) to a
tally file in the node's shared memory, under an exclusive lock; the offer that brings the
tally to the node's number of members gets every line back and makes the one store
request for the node (`snapshot.acknowledge`, `protocol.joined`). So committing a step or
recording a recovery costs the store a request a node, not a request a worker.

A worker that dies before its offer leaves the tally short: the node's request is never
made, as the worker's own would never have been (its step does not commit). Tallies are
per generation and step; the one that completes removes the file.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class NodeTally:
    """The tallies of one node (`directory` in its shared memory)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def offer(self, name: str, line: str, expected: int) -> list[str] | None:
        """Add `line` (no newline in it) to tally `name`; every line once this offer is
        the `expected`-th, else None."""
        if "\n" in line or expected < 1:
            raise ValueError(f"a tally line is one line and expects >= 1 offer: {line!r}")
        if expected == 1:
            return [line]
        path = self.dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, (line + "\n").encode())
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            lines = b"".join(chunks).decode().splitlines()
            if len(lines) < expected:
                return None
            if len(lines) > expected:
                raise RuntimeError(f"node tally {path}: {len(lines)} offers, {expected} "
                                   "expected (two workers offered for one place)")
            path.unlink()  # (under the lock: nobody else offers to a complete tally)
            return lines
        finally:
            os.close(fd)


class NodeShare:
    """One member's part in its node's tallies: the tally directory, its node, and how
    many members of its generation the node holds (each offer is one of those)."""

    def __init__(self, tally: NodeTally, node: int, members: int) -> None:
        self.tally, self.node, self.members = tally, node, members

    @classmethod
    def of(cls, shm_dir: str | Path, nodes: dict[int, int], rank: int) -> NodeShare:
        """For `rank` of a generation laid out as `nodes` (rank -> node), tallying in
        the node's shared memory `shm_dir`."""
        me = nodes.get(rank, -1)
        return cls(NodeTally(Path(shm_dir) / "tally"), me,
                   max(1, sum(1 for k in nodes.values() if k == me)))

    def offer(self, name: str, line: str) -> list[str] | None:
        return self.tally.offer(f"{name}-n{self.node}", line, self.members)

"""What a node's workers each say, gathered on the node and told the store once.

A worker offers its line (its snapshot's acknowledgement count, its restore source) to a
tally file in the node's shared memory, under an exclusive lock; the offer that brings the
tally to the node's number of members gets every line back and makes the one store
request for the node (`snapshot.acknowledge`, `protocol.joined`). So committing a step or
recording a recovery costs the store a request a node, not a request a worker.

Snapshot acknowledgements go to one tally file a generation that each member opens once,
as its snapshot thread starts, and keeps open: a step's lines are all in it before anyone
offers the next step (a member offers step s + 1 only after s committed), so the offer
that completes a step empties the file, and a node's shared memory deleted mid-run (an
over-eager clean-up) leaves the members appending to the same file still.

A step's commit is waited for on the store once a node too: the member whose offer
completed the node's acknowledgement waits there and marks the commit in shared memory
(`NodeShare.mark`); the others wait for the mark, and look at the store now and then in
case it never comes.

A worker that dies before its offer leaves the tally short: the node's request is never
made, as the worker's own would never have been (its step does not commit).
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path


class NodeTally:
    """The tallies of one node (`directory` in its shared memory)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def offer(self, name: str, line: str, expected: int) -> list[str] | None:
        """Add `line` (no newline in it) to tally `name`; every line once this offer is
        the `expected`-th, else None. The completing offer removes the tally."""
        _check(line, expected)
        if expected == 1:
            return [line]
        path = self.dir / name
        fd = self.open(name)  # (it recreates the directory: shared memory may be deleted)
        try:
            lines = _append(fd, line, expected, path)
            if lines is not None:
                path.unlink(missing_ok=True)  # (under the lock: the tally is complete)
            return lines
        finally:
            os.close(fd)

    def open(self, name: str) -> int:
        """A tally file to offer to again and again (`offer_to`); the caller closes it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        return os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)

    @staticmethod
    def offer_to(fd: int, line: str, expected: int) -> list[str] | None:
        """`offer` to an open tally (`open`), whose every round of `expected` offers is
        complete before the next round's first: the completing offer empties it."""
        _check(line, expected)
        if expected == 1:
            return [line]
        return _append(fd, line, expected, f"fd {fd}", empty=True)


def _check(line: str, expected: int) -> None:
    if "\n" in line or expected < 1:
        raise ValueError(f"a tally line is one line and expects >= 1 offer: {line!r}")


def _append(fd: int, line: str, expected: int, where, empty: bool = False) -> list[str] | None:
    """Under the file's lock: append `line`, and return every line once there are
    `expected` (then, with `empty`, truncate the file)."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        os.write(fd, (line + "\n").encode())
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        lines = b"".join(chunks).decode().splitlines()
        if len(lines) < expected:
            return None
        if len(lines) > expected:
            raise RuntimeError(f"node tally {where}: {len(lines)} offers, {expected} "
                               "expected (two workers offered for one place)")
        if empty:
            os.ftruncate(fd, 0)
        return lines
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


class NodeShare:
    """One member's part in its node's tallies: the tally directory, its node, and how
    many members of its generation the node holds (each offer is one of those)."""

    def __init__(self, tally: NodeTally, node: int, members: int) -> None:
        self.tally, self.node, self.members = tally, node, members
        self.completed: str | None = None  # the tally this member's last offer completed
        self._acks: dict[int, int] = {}  # generation -> its open acknowledgement tally

    @classmethod
    def of(cls, shm_dir: str | Path, nodes: dict[int, int], rank: int) -> NodeShare:
        """For `rank` of a generation laid out as `nodes` (rank -> node), tallying in
        the node's shared memory `shm_dir`."""
        me = nodes.get(rank, -1)
        return cls(NodeTally(Path(shm_dir) / "tally"), me,
                   max(1, sum(1 for k in nodes.values() if k == me)))

    def offer(self, name: str, line: str) -> list[str] | None:
        lines = self.tally.offer(f"{name}-n{self.node}", line, self.members)
        self.completed = name if lines is not None else None
        return lines

    def open_acks(self, generation: int) -> None:
        """Open generation's acknowledgement tally now (a snapshot thread's start), so the
        node's members share it however its directory fares later."""
        if generation not in self._acks and self.members > 1:
            self._acks[generation] = self.tally.open(f"ack-{generation}-n{self.node}")

    def offer_ack(self, generation: int, step: int, count: int) -> list[int] | None:
        """This member's acknowledgement count of `step`; every member's once this offer
        completes the node's (then `completed` names the step)."""
        self.open_acks(generation)
        name = f"ack-{generation}-{step}"
        if self.members == 1:
            lines = [f"{step} {count}"]
        else:
            lines = NodeTally.offer_to(self._acks[generation], f"{step} {count}", self.members)
        self.completed = name if lines is not None else None
        if lines is None:
            return None
        pairs = [line.split() for line in lines]
        if any(int(s) != step for s, _ in pairs):
            raise RuntimeError(f"node {self.node}'s acknowledgements of step {step} hold "
                               f"another step's: {lines}")
        return [int(c) for _, c in pairs]

    def close(self) -> None:
        for fd in self._acks.values():
            os.close(fd)
        self._acks.clear()

    def mark(self, name: str, step: int) -> None:
        """Tell the node's members that `name` reached `step` (a step's commit, once one
        member saw it in the store). Steps alternate between two files, written aside and
        renamed in place: a member that waits for step s has passed s - 2, so a mark is
        only overwritten once nobody waits for it. Best effort: a member that finds no
        mark looks at the store."""
        path = self._mark_path(name, step)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            self.tally.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(str(step))
            os.replace(tmp, path)
        except OSError:
            pass

    def marked(self, name: str, step: int) -> bool:
        try:
            return int(self._mark_path(name, step).read_text() or -1) == step
        except (FileNotFoundError, ValueError):
            return False

    def _mark_path(self, name: str, step: int) -> Path:
        return self.tally.dir / f"{name}-{step % 2}-n{self.node}"

"""Real text on every machine: the Python standard library's own .py files, as bytes.

`stdlib_corpus(eos_id)` concatenates them in a fixed order (sorted paths) with the
tokenizer's end-of-sequence id between files, so every worker of every run sees the same token stream.
`RandomWindows` samples training windows with its own `torch.Generator`: its position
and generator state are per-rank state that the session snapshots (`track=`).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch


def stdlib_corpus(eos_id: int, max_bytes: int | None = None) -> torch.Tensor:
    """Byte token ids (0-255) with `eos_id` between files, as int16 (int64 would be
    wasteful); `eos_id` must fit int16."""
    if not 0 <= eos_id < 2**15:
        raise ValueError(f"eos_id must be in [0, 32768), got {eos_id}")
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for p in _sorted_sources(root):
        try:
            b = p.read_bytes()
        except OSError:
            continue
        if not b:
            continue
        chunks.append(b)
        total += len(b) + 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no .py files under {root}: cannot build the example corpus")
    out = torch.empty(total, dtype=torch.int16)
    pos = 0
    for b in chunks:
        out[pos:pos + len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8).to(torch.int16)
        out[pos + len(b)] = eos_id
        pos += len(b) + 1
    return out[:max_bytes] if max_bytes else out


def _sorted_sources(root: Path):
    """The .py files under `root` in sorted-path order (parts compared one by one, as
    `sorted(root.rglob("*.py"))` orders them), skipping `test` and `site-packages`
    directories; lazily, so a corpus capped at a few MB reads only the first files."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name not in ("test", "site-packages"):
                yield from _sorted_sources(Path(e.path))
        elif e.name.endswith(".py") and e.is_file():
            yield Path(e.path)


class RandomWindows:
    """Random (input, target) windows of `context` tokens, from a per-rank generator.

    `seed` may be a callable: it is called at the first draw, when the rank is known
    (a spare builds its sampler before it knows which rank it will take over)."""

    def __init__(self, tokens: torch.Tensor, *, context: int, batch: int,
                 seed: int | Callable[[], int]) -> None:
        if len(tokens) <= context + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than context {context}")
        self.tokens, self.context, self.batch = tokens, context, batch
        self.seed = seed
        self.gen = torch.Generator()
        self.seeded = False
        self.position = 0  # batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.seeded:
            self.gen.manual_seed(self.seed() if callable(self.seed) else self.seed)
            self.seeded = True
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (self.batch,),
                               generator=self.gen)
        idx = starts[:, None] + torch.arange(self.context + 1)[None, :]
        w = self.tokens[idx].long()
        self.position += 1
        return w[:, :-1], w[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position, "seeded": self.seeded, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.seeded = bool(state["seeded"])
        self.gen.set_state(state["gen"])


class MicrobatchWindows:
    """Windows as a pure function of the microbatch id (step, j): any rank can compute
    any microbatch, which is what lets ReCoVer hand a dead rank's share to survivors."""

    def __init__(self, tokens: torch.Tensor, *, context: int, batch: int, seed: int) -> None:
        if len(tokens) <= context + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than context {context}")
        self.tokens, self.context, self.batch, self.seed = tokens, context, batch, seed

    def get(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_000_003 + j)
        starts = torch.randint(0, len(self.tokens) - self.context - 1, (self.batch,), generator=gen)
        w = self.tokens[starts[:, None] + torch.arange(self.context + 1)[None, :]].long()
        return w[:, :-1], w[:, 1:]

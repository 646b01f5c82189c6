"""The options every benchmark runs with, built once from its command line.

`phoenixft bench NAME` parses its own flags; `BenchOptions.from_args` turns them into one
object whose common settings (quick or full sizes, where the JSON goes, torch threads,
the model preset) are checked in one place, and carries the benchmark's own flags beside
them (`own`), so `measure(opts)` has a single argument whatever the benchmark.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

PRESETS = ("tiny", "small", "ref")


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """`out`: the JSON result (None: not written); `quick`: the smallest sizes that still
    measure something; `threads`: torch threads per process where the benchmark sets them
    (None: each worker runs 1); `preset`: the model preset where there is one; `own`: the
    benchmark's own flags, as parsed (quick defaults applied)."""

    out: Path | None
    quick: bool = False
    threads: int | None = None
    preset: str | None = None
    own: argparse.Namespace = field(default_factory=argparse.Namespace)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise SystemExit(f"phoenixft bench: --threads must be >= 1, got {self.threads}")
        if self.preset is not None and self.preset not in PRESETS:
            raise SystemExit(f"phoenixft bench: unknown preset {self.preset!r}; "
                             f"choose from {', '.join(PRESETS)}")
        if self.out is not None and self.out.is_dir():
            raise SystemExit(f"phoenixft bench: --out {self.out} is a directory; name a file")

    @classmethod
    def from_args(cls, args: argparse.Namespace, quick: dict | None = None) -> BenchOptions:
        """From a benchmark's parsed flags; with `--quick`, `quick`'s settings replace
        theirs first (the benchmark's own quick sizes)."""
        if getattr(args, "quick", False) and quick:
            for k, v in quick.items():
                setattr(args, k, v)
        out = getattr(args, "out", None)
        return cls(out=Path(out) if out else None, quick=bool(getattr(args, "quick", False)),
                   threads=getattr(args, "threads", None), preset=getattr(args, "preset", None),
                   own=args)

    def runs_dir(self, name: str) -> Path:
        """Where the benchmark's jobs keep their run directories: beside the JSON."""
        return Path(self.out or "runs/bench/x.json").parent / f"{name}-runs"

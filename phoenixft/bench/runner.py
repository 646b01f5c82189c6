"""`phoenixft bench NAME`, the same for every benchmark: options from the flags, measure,
write the JSON, show the tables. A benchmark module supplies `measure(opts) -> dict` and
`show(result, opts)`; its `goals(result)` and `headline(result)` are what `bench all`
reads back from that JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from phoenixft.bench.options import BenchOptions


def command(measure: Callable[[BenchOptions], dict],
            show: Callable[[dict, BenchOptions], None], *, quick: dict | None = None,
            exit_code: Callable[[dict], int] = lambda result: 0,
            ) -> Callable[[argparse.Namespace], int]:
    """The `func` of a benchmark's parser."""
    def run(args: argparse.Namespace) -> int:
        opts = BenchOptions.from_args(args, quick)
        result = measure(opts)
        if opts.out is not None:
            opts.out.parent.mkdir(parents=True, exist_ok=True)
            opts.out.write_text(json.dumps(result, indent=2))
        show(result, opts)
        if opts.out is not None:
            print(f"wrote {opts.out}")
        return exit_code(result)
    return run

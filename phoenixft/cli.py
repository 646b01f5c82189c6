"""`phoenixft` command line: one entry point, subcommands registered by the parts that own them.

Each part exposes ``register(subparsers)`` that adds its subcommands and sets
``func=callable(args) -> int`` on them; this module only wires them together, so a new
feature comes with its own parser next to its code instead of growing this file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# c10d logs a lost store connection as a warning with a 20-frame C++ stack, before our own
# one-line account of it (an agent that finds the job's store gone): warnings off unless
# asked for. Set before torch is imported, which reads it once.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from phoenixft import extras  # noqa: E402

# (module, attribute) pairs whose register(subparsers) adds top-level subcommands.
_COMMANDS = [
    "phoenixft.launch.cli",      # run, demo, status
    "phoenixft.launch.store_cli",  # store
    "phoenixft.launch.chaos_cli",  # chaos
    "phoenixft.checkpoint.cli",    # ckpt
    "phoenixft.serve.server.cli",  # serve, generate
    "phoenixft.simulate.cli",      # simulate
    "phoenixft.observe.plot",    # plot
]
# modules whose register(subparsers) adds `phoenixft bench <name>`.
_BENCHES = [
    "phoenixft.bench.overhead",
    "phoenixft.bench.recovery",
    "phoenixft.bench.goodput",
    "phoenixft.bench.serve",
    "phoenixft.bench.checkpoint",
    "phoenixft.bench.serve_ft",
    "phoenixft.bench.torchft_side",
    "phoenixft.bench.sharded",
    "phoenixft.bench.pipeline",
    "phoenixft.bench.regroup",
    "phoenixft.bench.consensus",
    "phoenixft.bench.control_plane",
    "phoenixft.bench.all",
]


def _optional_register(module: str, sub: argparse._SubParsersAction) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:  # that part is not written yet
            return
        raise
    mod.register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phoenixft", description="Fault-tolerant LLM training and serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        _optional_register(module, sub)
    bench = sub.add_parser("bench", help="side-by-side benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for module in _BENCHES:
        _optional_register(module, bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `phoenixft ckpt inspect ... | head`: the reader had enough
        # (stdout to /dev/null, so the interpreter's final flush does not raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a command killed by SIGPIPE
    except ModuleNotFoundError as exc:  # an optional dependency: one line naming its extra
        line = extras.hint(exc, _command_name(args))
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def _command_name(args: argparse.Namespace) -> str:
    words = [getattr(args, "command", None), getattr(args, "bench", None)]
    return "phoenixft " + " ".join(w for w in words if w)


if __name__ == "__main__":
    sys.exit(main())

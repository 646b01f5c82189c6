"""`phoenixft bench all [--quick] [--out FILE]`: every benchmark, one report.

Runs each benchmark in its own process, one after another (they would disturb each other's
timings side by side on a small machine), then `phoenixft simulate` fed with the measured
figures. Writes FILE (JSON: each benchmark's result with a `goals` list of
{"name", "goal", "measured", "met"}) and BENCHMARKS.md beside it (a table per benchmark,
the command, the machine, processes and threads). `--quick` uses the smallest sizes that
still measure something (about 30 minutes on 2 cores, 31 at the last full run).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phoenixft.bench.markdown import machine, render
from phoenixft.observe.goals import as_dicts

if TYPE_CHECKING:
    from phoenixft.bench.suite import Entry


def _plan(args: argparse.Namespace) -> list[tuple[Entry, list[str]]]:
    """The entries to run, in order, each with its arguments: `--with` replaces them,
    else `--quick` chooses the quick ones."""
    # (the suite names every benchmark's module, some of which import torch: imported
    # here, not when the command line is built, so `phoenixft --help` and a refused
    # `phoenixft run` answer at once)
    from phoenixft.bench.suite import SUITE

    known = {e.name for e in SUITE}
    overrides = {}
    for spec in args.with_args:
        name, _, rest = spec.partition(":")
        if name not in known:
            raise SystemExit(f"phoenixft bench all: --with {spec!r}: unknown benchmark {name!r}")
        overrides[name] = shlex.split(rest)
    only = args.only.split(",") if args.only else None
    return [(e, overrides.get(e.name, list(e.quick if args.quick else e.full)))
            for e in SUITE if only is None or e.name in only or e.always]


def _headline(entry: Entry, data: dict, rc: int, log: Path) -> str:
    """The entry's headline; a result missing a figure it names shows as such."""
    if not data:
        return f"failed (exit {rc}): see {log}"
    try:
        return entry.headline(data)
    except (KeyError, ValueError, ZeroDivisionError, IndexError, TypeError):
        return "(see the JSON)"


def _run(entry: Entry, extra: list[str], work: Path) -> dict:
    """Run one entry in its own process (side by side they would disturb each other's
    timings) and report it from the JSON it wrote."""
    path, log = work / f"{entry.name}.json", work / f"{entry.name}.log"
    path.unlink(missing_ok=True)  # a failed run must not be reported with an older result
    inputs = entry.inputs(work) if entry.inputs else []
    argv = [sys.executable, "-m", "phoenixft.cli", *entry.command, *extra, *inputs,
            "--out", str(path)]
    shown = entry.shown or "phoenixft " + " ".join([*entry.command, *extra])
    print(f"[all] {shown}", flush=True)
    t = time.time()
    with log.open("w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    out = {"command": shown, "processes": entry.processes, "rc": rc, "wall_s": time.time() - t,
           "log": str(log)}
    data = json.loads(path.read_text()) if path.exists() else {}
    out.update(result=data, goals=as_dicts(entry.goals(data)) if data else [],
               headline=_headline(entry, data, rc, log))
    if entry.markdown and data:
        out["table"] = entry.markdown(data)
    return out


def cmd_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    work = out.parent / "all"
    work.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "all", "quick": args.quick, "machine": machine(),
              "benchmarks": {}}
    if args.only and out.exists():  # refresh some benchmarks of an existing report
        report["benchmarks"] = json.loads(out.read_text()).get("benchmarks", {})
    for entry, extra in _plan(args):
        b = report["benchmarks"][entry.name] = _run(entry, extra, work)
        print(f"[all] {entry.name}: {b['headline']} ({b['wall_s']:.0f} s)", flush=True)
    report["wall_s"] = sum(b["wall_s"] for b in report["benchmarks"].values())
    out.write_text(json.dumps(report, indent=2))
    md = Path(args.markdown)
    md.write_text(render(report))
    print(f"wrote {out} and {md} ({report['wall_s'] / 60:.1f} min)")
    return 0 if all(b["rc"] == 0 for b in report["benchmarks"].values()) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("all", help="every benchmark and the simulator: one JSON report and "
                                   "BENCHMARKS.md", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest sizes (~30 min on 2 cores)")
    p.add_argument("--out", default="runs/bench/all.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="the report (default ./BENCHMARKS.md)")
    p.add_argument("--with", dest="with_args", action="append", default=[],
                   metavar="NAME:ARGS", help="run benchmark NAME with these arguments instead, "
                   "e.g. --with 'overhead:--pairs 1 --preset tiny'")
    p.add_argument("--only", default=None, help="comma-separated benchmarks to run; the "
                                                "others keep their figures from --out")
    p.set_defaults(func=cmd_all)

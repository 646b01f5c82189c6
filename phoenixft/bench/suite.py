"""The benchmarks `phoenixft bench all` runs, in order: one list, each entry saying how to
run it (quick and full arguments), what it runs on, and how its result is reported (its
module's `goals`, `headline` and, where it has one, `markdown`). A new benchmark is one
entry here; nothing else in `bench all` names a benchmark or one of its goals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from phoenixft.bench import (
    checkpoint,
    consensus,
    control_plane,
    goodput,
    overhead,
    pipeline,
    recovery,
    regroup,
    serve,
    serve_ft,
    serve_open,
    sharded,
    torchft_side,
)
from phoenixft.observe.goals import Goal
from phoenixft.simulate import report as simulate_report


@dataclass(frozen=True, kw_only=True)
class Entry:
    """`name`: its section of BENCHMARKS.md and its JSON's name; `command`: after
    `phoenixft`; `quick` / `full`: its arguments under `--quick` / without (empty: its own
    defaults); `processes`: processes and threads, in words; `shown`: the command as the
    report shows it, when not the command line; `inputs`: flags naming the results of the
    entries before it (the simulator is fed with them); `always`: runs whatever `--only`
    names, since it reads the others' results."""

    name: str
    command: tuple[str, ...]
    processes: str
    goals: Callable[[dict], list[Goal]]
    headline: Callable[[dict], str]
    markdown: Callable[[dict], list[str]] | None = None
    quick: tuple[str, ...] = ()
    full: tuple[str, ...] = ()
    shown: str | None = None
    inputs: Callable[[Path], list[str]] | None = None
    always: bool = False


def _bench(name: str, module: ModuleType, processes: str, quick: list[str],
           full: list[str] | None = None, bench: str | None = None, **report) -> Entry:
    """An entry for `phoenixft bench BENCH` reported by `module` (or the given functions)."""
    return Entry(name=name, command=("bench", bench or name), processes=processes,
                 goals=report.get("goals", module.goals),
                 headline=report.get("headline", module.headline),
                 markdown=getattr(module, "markdown", None),
                 quick=tuple(quick), full=tuple(full or ()))


def _simulator_inputs(work: Path) -> list[str]:
    return ["--validate", str(work / "goodput.json"), "--recovery-json",
            str(work / "recovery.json"), "--overhead-json", str(work / "overhead.json"),
            "--control-plane-json", str(work / "control-plane.json"),
            "--plot", str(work / "simulate.png")]


SUITE: list[Entry] = [
    _bench("overhead", overhead, "2 workers x 1 torch thread, snapshots on and off in turn",
           ["--pairs", "2", "--steps", "30", "--blocks", "80"]),
    _bench("recovery", recovery, "2 or 4 workers + 1 spare, 1 torch thread each",
           ["--steps", "20", "--preset", "tiny"]),
    # the 4-worker kill at the small preset, against issue 12's goals for it
    _bench("recovery-small", recovery,
           "2 or 4 workers + 1 spare, 1 torch thread each, small preset",
           ["--steps", "20", "--preset", "small", "--trials", "0,2", "--repeat", "2"],
           ["--preset", "small", "--trials", "0,2", "--repeat", "3"], bench="recovery",
           goals=recovery.goals_with_four_workers, headline=recovery.headline_four_workers),
    _bench("goodput", goodput, "4 workers x 1 torch thread per mode; torchrun DDP for restart",
           ["--quick"]),
    _bench("checkpoint", checkpoint, "1 process x 2 torch threads",
           ["--steps", "24", "--every", "4"]),
    _bench("serve", serve, "1 process x 2 torch threads, engine and transformers in turn",
           ["--concurrency", "1", "8", "--rounds", "2", "--repeats", "1"]),
    _bench("serve-medium", serve, "1 process x 2 torch threads, a 54M-parameter model",
           ["--size", "medium", "--concurrency", "8", "32", "--rounds", "2", "--repeats", "1"],
           ["--size", "medium"], bench="serve"),
    _bench("serve-open", serve_open, "phoenixft serve (front + engine, + standby and log "
           "executor with recovery) x 2 torch threads, transformers in the bench process "
           "x 2 threads, one at a time",
           ["--open-loop", "--size", "medium", "--requests", "8", "--rates", "1"],
           ["--open-loop", "--size", "medium"], bench="serve"),
    _bench("serve-ft", serve_ft, "engine 1 torch thread + log executor process; front + 2 "
           "engines end to end", ["--contexts", "256,1024", "--blocks", "110"]),
    _bench("torchft", torchft_side, "2 members x 1 torch thread each (+1 spare / +1 "
           "lighthouse); plain DDP beside",
           ["--steps", "34", "--kill-step", "20", "--no-free-runs"]),
    _bench("sharded", sharded, "4 FSDP2 workers x 1 torch thread (+1 spare for the kill)",
           ["--preset", "tiny", "--blocks", "20", "--kill-steps", "24"]),
    _bench("pipeline", pipeline, "4 workers (2 stages x 2 replicas) x 1 torch thread (+1 spare "
           "for the kill); torchrun pipelining beside", ["--preset", "tiny", "--blocks", "20",
                                                         "--kill-steps", "24"]),
    _bench("regroup", regroup, "8 workers (4 replica groups x 2 FSDP2) x 1 torch thread + 1 "
           "spare, with --rebuild-groups and without, one after the other", []),
    _bench("consensus", consensus, "3 workers x 1 torch thread per mode (+1 spare for swap; "
           "+1 busy process for the false alarms)", ["--steps", "80", "--noisy-steps", "300"]),
    _bench("control-plane", control_plane, "1 store + 1 leader + 2 hollow-member processes "
           "(8 members a simulated node), no torch compute",
           ["--members", "64", "256", "1024", "--failures", "2", "--steady", "2"]),
    Entry(name="simulate", command=("simulate",), processes="1 process",
          goals=simulate_report.goals, headline=simulate_report.headline,
          markdown=simulate_report.markdown,
          shown="phoenixft simulate (fed with the figures above)",
          inputs=_simulator_inputs, always=True),
]

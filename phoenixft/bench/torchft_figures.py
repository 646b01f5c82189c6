"""What both torchft benchmarks (`bench torchft`, and its `--hsdp` case) share: the pair
of runs per system (failure-free, then the same kill), torchft's committed step times and
what a kill cost it, and the median step of a failure-free torchrun reference."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from phoenixft.bench.goodput_jobs import TorchrunJob
from phoenixft.bench.harness import median
from phoenixft.observe.steps import from_events, step_times


def torchft_step_times(events: list[dict], replica: int = 0, skip: int = 5) -> list[float]:
    """Step times (`observe.steps`) of one replica group's committed steps, after warm-up
    (a step torchft did not commit is redone under the same number)."""
    mine = [e for e in events if e["event"] == "step" and e["replica"] == replica and e["committed"]]
    return step_times(from_events(mine, epoch="attempt"), skip=skip)


def torchft_fault(events: list[dict], restarts: list[dict], microbatches: int) -> dict:
    inject = next(e for e in events if e["event"] == "inject")
    steps = [e for e in events if e["event"] == "step"]
    # the steps from the one the killed group never finished on (the survivor may still log
    # the step before it after the kill)
    after = [e for e in steps if e["step"] >= inject["step"] and e["t"] > inject["t"]]
    survivor = [e for e in after if e["replica"] == 0]
    nxt = next(e for e in survivor if e["committed"])
    back = next((e for e in after if e["committed"]
                 and e["participants"] == len({x["replica"] for x in steps})), None)
    ready = next(e for e in events if e["event"] == "ready" and e["attempt"] == 1)
    short = sum(microbatches - e["microbatches"] for e in survivor if e["committed"])
    return {"kill_to_survivor_step_s": round(nxt["t"] - inject["t"], 4),
            # None: the job ended before the restarted group rejoined (its restart takes
            # seconds; raise --steps to see it)
            "kill_to_full_strength_s": round(back["t"] - inject["t"], 4) if back else None,
            "restart_to_ready_s": round(ready["t"] - restarts[0]["t"], 4),
            "lost_steps": sum(1 for e in survivor if not e["committed"]),
            "steps_short_of_data": sum(1 for e in survivor if e["committed"]
                                       and e["microbatches"] < microbatches),
            "microbatches_not_trained": short}


def plain_step_s(job: TorchrunJob, what: str) -> float:
    """Run a failure-free torchrun job to its end: its median step after warm-up."""
    from phoenixft.observe.events import read_events

    tree = job.start([])
    try:
        rc = tree.popen.wait(900)
    finally:
        tree.kill()
    if rc != 0:
        raise RuntimeError(f"{what} run failed ({rc}); see {job.run_dir / 'torchrun.log'}")
    return median(step_times(from_events(read_events(job.run_dir / "events.jsonl"),
                                         epoch="attempt"), skip=5))


def run_pair(args: argparse.Namespace, phoenix: Callable[[str, list[str]], dict],
             torchft: Callable[[str, int | None], object], *, kill_rank: int,
             label: str = "") -> tuple[float, float, dict, object]:
    """Both systems failure-free (or, with --no-free-runs, their steps before the kill),
    then both with rank `kill_rank` killed at --kill-step. `phoenix(name, inject)` runs
    phoenixft's job, `torchft(name, kill_step)` torchft's; returns (phoenixft's median
    step, torchft's, phoenixft's kill job, torchft's kill run)."""
    k, tag = args.kill_step, label.replace(" ", "-").lower()  # " HSDP": runs *-hsdp-*
    if args.free_runs:
        print(f"phoenixft{label} failure-free, torchft{label} failure-free", flush=True)
        px_free = phoenix(f"phoenixft{tag}-free", [])["events"]
        tf_free = torchft(f"torchft{tag}-free", None).events
    print(f"phoenixft{label} and torchft{label}, rank {kill_rank} killed at step {k}", flush=True)
    px_kill = phoenix(f"phoenixft{tag}-kill", [f"kill:rank={kill_rank}:step={k}"])
    tf_kill = torchft(f"torchft{tag}-kill", k)
    if not args.free_runs:  # the steps before the kill
        px_free = [e for e in px_kill["events"] if e["event"] != "step" or e["step"] < k]
        tf_free = [e for e in tf_kill.events if e["event"] != "step" or e["step"] < k]
    # warm-up steps left out (the spare and the lighthouse start beside the first steps)
    skip = 5 if args.free_runs else min(5, max(1, k // 3))
    return (median(step_times(from_events(px_free), skip=skip)),
            median(torchft_step_times(tf_free, skip=skip)), px_kill, tf_kill)


"""Figures both torchft benchmarks (`bench torchft`, and its `--hsdp` case) read from
their runs: torchft's committed step times and what a kill cost it, and the median step
of a failure-free torchrun reference."""

from __future__ import annotations

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

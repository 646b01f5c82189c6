"""The step-gap rule: how long a training step took, read from the step events a job left.

A step's time is the gap between two completed steps only when the second directly
follows the first (step s, then s + 1) within one epoch (phoenixft's generation,
torchrun's restart attempt) at one world size: a gap across a recovery or a restart is
what the failure cost, not a step, and a step redone after a rollback is not a new one.
The first `skip` steps (warm-up: first calls at new shapes, first page faults) can be left
out, and `before` keeps only the gaps that end before a time (a run's own speed before its
first fault). Every benchmark, the simulator's validation against a goodput run and the
training metrics' step histogram time steps by this one rule, so their figures agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepEvent:
    """A completed optimizer step. `epoch` grows with every recovery: phoenixft's
    generation, torchrun's restart attempt."""

    t: float
    step: int
    epoch: int
    world_size: int


def from_events(events: Iterable[dict], epoch: str = "gen") -> list[StepEvent]:
    """The `step` records of an event log, in order; `epoch` names the field that counts
    recoveries (phoenixft's events: `gen`; the torchrun baseline's and torchft's: `attempt`)."""
    return [StepEvent(e["t"], e["step"], e.get(epoch, 0), e.get("world_size", 0))
            for e in events if e["event"] == "step"]


def follows(a: StepEvent, b: StepEvent) -> bool:
    """True if `b` is the step right after `a` in the same epoch and world size: the gap
    between them is one step's time."""
    return b.step == a.step + 1 and b.epoch == a.epoch and b.world_size == a.world_size


def step_pairs(steps: Sequence[StepEvent], *, skip: int = 0,
               before: float = math.inf) -> list[tuple[StepEvent, StepEvent]]:
    """Consecutive steps whose gap is one step's time (`follows`), the first from step
    `skip` on, the second completed before `before`."""
    return [(a, b) for a, b in zip(steps, steps[1:])
            if follows(a, b) and a.step >= skip and b.t < before]


def step_times(steps: Sequence[StepEvent], *, skip: int = 0,
               before: float = math.inf) -> list[float]:
    """The durations of `step_pairs`, in order."""
    return [b.t - a.t for a, b in step_pairs(steps, skip=skip, before=before)]

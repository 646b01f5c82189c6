"""Goals: what a measurement is held to, in one shape for every benchmark and the simulator.

Each benchmark (and `phoenixft simulate`) turns its result into `Goal`s; `bench all`
counts the ones met for BENCHMARKS.md and prints their table, so a goal is stated once,
where it is measured, and is never found again by its text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Goal:
    """`name` (what is measured), `target` (the goal, in words: "<= 1% of a step"),
    `measured` (the figure, as shown), `met`, and an optional `note` (context that is not
    part of the table)."""

    name: str
    target: str
    measured: Any
    met: bool
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "met", bool(self.met))  # numpy / comparison results

    def as_dict(self) -> dict:
        """The JSON shape every report has used: name, goal, measured, met (note if set)."""
        out = {"name": self.name, "goal": self.target, "measured": self.measured, "met": self.met}
        return {**out, "note": self.note} if self.note else out


def as_dicts(goals: list[Goal]) -> list[dict]:
    return [g.as_dict() for g in goals]


def print_goals(console, goals: list[Goal]) -> None:
    """The goals table every benchmark ends with: name, target, measured, met."""
    from rich.table import Table

    g = Table(title="goals")
    for col in ("goal", "target", "measured", "met"):
        g.add_column(col)
    for x in goals:
        g.add_row(x.name, x.target, str(x.measured), "yes" if x.met else "NO")
    console.print(g)

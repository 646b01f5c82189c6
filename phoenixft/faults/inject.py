"""Fault injection: real SIGKILL / SIGSTOP of a worker at a chosen point of training.

A protocol shared by the launcher (which parses and checks `--inject` and hands the specs
to its workers through the environment) and the worker (which fires them), so it lives
apart from both.

Spec grammar (``--inject``, repeatable)::

    kill:rank=R:step=T             SIGKILL the worker holding rank R when it starts step T
    stop:rank=R:step=T             SIGSTOP it instead (a hang: only deadlines catch it)
    kill:rank=R:gen=G              SIGKILL it while it recovers into generation G
    kill:rank=R:step=T:microbatch=J  SIGKILL it right after its J-th microbatch of step T

The worker signals itself, so the fault lands exactly at that point; each spec fires
once per job (claimed through the store under its own text, so agents on different
nodes may pass different lists), so the spare that takes rank R over does not
die again when it replays step T.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

KINDS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_INT_KEYS = ("rank", "step", "gen", "microbatch")


class InjectSpecError(ValueError):
    pass


@dataclass(frozen=True)
class InjectSpec:
    kind: str
    rank: int
    step: int | None = None
    gen: int | None = None
    microbatch: int | None = None

    def __str__(self) -> str:
        parts = [self.kind, f"rank={self.rank}"]
        for k in ("step", "gen", "microbatch"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k}={v}")
        return ":".join(parts)


def parse_spec(text: str) -> InjectSpec:
    fields = text.strip().split(":")
    kind = fields[0]
    usage = ("expected kill|stop:rank=R:step=T (or :gen=G, or :step=T:microbatch=J), "
             f"got {text!r}")
    if kind not in KINDS:
        raise InjectSpecError(f"unknown fault kind {kind!r} in --inject; {usage}")
    values: dict[str, int] = {}
    for f in fields[1:]:
        key, eq, val = f.partition("=")
        if not eq or key not in _INT_KEYS:
            raise InjectSpecError(f"bad field {f!r} in --inject; {usage}")
        try:
            values[key] = int(val)
        except ValueError:
            raise InjectSpecError(f"{key} must be an integer in --inject, got {val!r}") from None
        if values[key] < 0:
            raise InjectSpecError(f"{key} must be >= 0 in --inject, got {val!r}")
    if "rank" not in values:
        raise InjectSpecError(f"--inject needs rank=R; {usage}")
    if ("step" in values) == ("gen" in values):
        raise InjectSpecError(f"--inject needs exactly one of step=T or gen=G; {usage}")
    if "microbatch" in values and "step" not in values:
        raise InjectSpecError(f"microbatch=J needs step=T in --inject; {usage}")
    return InjectSpec(kind=kind, **values)


def parse_env(text: str) -> list[InjectSpec]:
    return [parse_spec(s) for s in text.split(";") if s.strip()]


def format_env(specs: list[InjectSpec]) -> str:
    return ";".join(str(s) for s in specs)


class Injector:
    """Fires matching specs in the worker. `claim(i)` must return True only once per
    spec across the job (the store's add counter gives that)."""

    def __init__(self, specs: list[InjectSpec], claim: Callable[[str], bool],
                 on_fire: Callable | None = None) -> None:
        self.specs = specs
        self._claim = claim
        self._on_fire = on_fire

    def _fire(self, point: dict, **match) -> None:
        for s in self.specs:
            if all(getattr(s, k) == v for k, v in match.items()) and all(
                    getattr(s, k) is None for k in ("step", "gen", "microbatch") if k not in match):
                if self._claim(str(s)):
                    if self._on_fire is not None:
                        self._on_fire(s, time.time(), point)
                    os.kill(os.getpid(), KINDS[s.kind])

    def at_step(self, rank: int, step: int) -> None:
        if self.specs:
            self._fire({"step": step}, rank=rank, step=step)

    def at_recovery(self, rank: int, gen: int) -> None:
        if self.specs:
            self._fire({"gen": gen}, rank=rank, gen=gen)

    def at_microbatch(self, rank: int, step: int, j: int) -> None:
        if self.specs:
            self._fire({"step": step, "microbatch": j}, rank=rank, step=step, microbatch=j)

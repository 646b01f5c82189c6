"""Fault injection: real faults at chosen points of a training job.

A protocol shared by the launcher (which parses and checks `--inject` and hands the specs
to its workers through the environment) and the worker (which fires them), so it lives
apart from both.

Spec grammar (``--inject``, repeatable): ``KIND:rank=R:WHEN``

KIND, what the worker holding rank R does when WHEN comes:
    kill      SIGKILL itself (a crash, an OOM kill)
    stop      SIGSTOP itself (a hang: only deadlines catch it)
    node      SIGKILL its agent: the whole node is lost (its workers die with their agent,
              its shared memory is removed)
    corrupt   flip a byte in each of its own snapshot slots, then SIGKILL itself (a spare
              must not load the damaged copy)
    shm       delete its node's shared memory, then SIGKILL itself
    raise     raise an exception, as a bug in the training script would
    garble    flip a byte in each replica of snapshot T it receives from another node or
              copies from a same-node peer (--replicas 1), as a bad link or bad memory
              would, and carry on (the step must commit without them, and no restore may
              load them); only with step=T, and only for a rank that holds a replica
    rot       flip a byte in its own snapshot T in shared memory as soon as it is written
              (before a same-node holder copies it), as bad memory would, and carry on:
              a holder that finds it damaged reports the rank, which is then replaced
              like a dead one (step T never commits); only with step=T
    flip      flip one bit of its state at step T and carry on (silent data corruption:
              bad memory, a faulty core); only with step=T, and :where=W says which state
              (default grad): grad, its reduced gradients of step T right after the
              step's all-reduce; param, its parameters right after step T's update (the
              full copy its forward passes use); optim, its optimizer state (the first
              per-element state tensor, e.g. Adam's exp_avg) once snapshot T is copied.
              The ranks' fingerprint vote must name grad and param flips, the rank's own
              seal an optim flip (`--fingerprint-every`, data parallel)
    slow      compute `factor` times slower from step T on (a slow GPU, a noisy
              neighbour): after its microbatches, before the step's all-reduce, it waits
              (factor - 1) x the time they took; it needs step=T:factor=F (F > 1), and
              only this worker is slow (a spare taking its rank is not); with :every=P
              it is slow on one step in P only (steps T, T+P, ...: an intermittent one)
    wrong     from step T on, its arithmetic is off: each backward pass computes a wrong
              gradient (a faulty core: its loss is scaled by 1.25 before backward, so a
              sharded model's reduce-scatter takes it in too), which every rank then sums
              alike and no vote sees (not with a pipeline: its schedule computes the loss);
              it carries on (`--recompute-every` must find it); only step=T
    freeze    from step T on, stopped (SIGSTOP, by a helper process it starts) for M ms of
              every P ms, until it exits (a host that keeps pausing: a throttled
              container, a VM losing its core); it needs step=T:ms=M:period=P (0 < M < P),
              and its stops fall in any part of the step, the all-reduce included

WHEN:
    step=T                  as it starts step T
    step=T:microbatch=J     right after its J-th microbatch (from 0) of step T, once
                            snapshot T-1 is committed: every rank finished step T-1 and
                            holds its copy (so the fault tests step T, not a race with the
                            end of T-1 or with that copy; phase=snapshot tests the copy)
    step=T:phase=P          at phase P of step T: forward (a pipeline: as it issues
                            a send or recv of activations, in the schedule), backward
                            (a sharded model: as it starts the step's first gradient
                            reduce-scatter, inside the backward pass; a pipeline: as it
                            issues a send or recv of gradients; forward and backward
                            wait, as microbatch=J does, for snapshot T-1's commit),
                            reduce (before the gradient all-reduce),
                            clip (in step.clip_grad_norm_, before its norm's all-reduce
                            of a sharded model), update (after the all-reduce and any
                            clip, before the optimizer step), snapshot (in the
                            middle of copying snapshot T), replicate (snapshot T copied,
                            its replicas not sent), commit (all its copies acknowledged)
    gen=G                   while it recovers into generation G, once that generation's
                            groups formed (every member is inside the recovery then); the
                            rank of a replaced worker is held by the spare activated for it

Each spec fires once per job (claimed through the store under its own text, so agents on
different nodes may pass different lists): the spare that takes rank R over does not die
again when it replays step T.
"""

from __future__ import annotations

import enum
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from phoenixft.faults import freezer


class FaultKind(str, enum.Enum):
    """What a spec does (the grammar above)."""

    KILL = "kill"
    STOP = "stop"
    NODE = "node"
    CORRUPT = "corrupt"
    SHM = "shm"
    RAISE = "raise"
    GARBLE = "garble"
    ROT = "rot"
    SLOW = "slow"
    FLIP = "flip"
    FREEZE = "freeze"
    WRONG = "wrong"

    __format__ = str.__format__  # f"{kind}" is the value on every Python

    def __str__(self) -> str:
        return self.value


KINDS = tuple(k.value for k in FaultKind)
# kinds that land inside the snapshot thread, at a point of their own (the caller does the
# damage: `garbles`, `rots`), instead of at a step's start or phase
LANDS_AT = {FaultKind.GARBLE: "received", FaultKind.ROT: "written", FaultKind.FLIP: "reduced"}
LAYOUT_PHASES = ("forward", "backward")  # reached only by some layouts (Membership.fault_phases)
PHASES = ("start", "forward", "backward", "reduce", "clip", "update", "snapshot", "replicate", "commit")
_INT_KEYS = ("rank", "step", "gen", "microbatch", "every", "ms", "period")
FLIP_WHERE = ("grad", "param", "optim")


class InjectSpecError(ValueError):
    pass


class InjectedFault(RuntimeError):
    """Raised by a `raise:` spec: stands for a bug in the training script."""


@dataclass(frozen=True)
class InjectSpec:
    kind: FaultKind
    rank: int
    step: int | None = None
    gen: int | None = None
    microbatch: int | None = None
    phase: str | None = None  # None: "start" (or the microbatch, or the recovery)
    factor: float | None = None  # slow: how many times slower its compute becomes
    every: int | None = None  # slow: on one step in `every` only (None: every step)
    where: str | None = None  # flip: which state (FLIP_WHERE)
    ms: int | None = None  # freeze: each stop's milliseconds
    period: int | None = None  # freeze: milliseconds from one stop's start to the next's

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))  # (a kind's value is taken)

    def __str__(self) -> str:
        parts = [self.kind, f"rank={self.rank}"]
        for k in ("step", "gen", "microbatch", "phase", "factor", "every", "where", "ms",
                  "period"):
            v = getattr(self, k)
            if v is not None:
                parts.append(f"{k}={v}")
        return ":".join(parts)


def parse_spec(text: str) -> InjectSpec:
    fields = text.strip().split(":")
    kind = fields[0]
    usage = (f"expected KIND:rank=R:step=T (or :gen=G, :step=T:microbatch=J, "
             f":step=T:phase=P) with KIND one of {', '.join(KINDS)}, got {text!r}")
    if kind not in KINDS:
        raise InjectSpecError(f"unknown fault kind {kind!r} in --inject; {usage}")
    kind = FaultKind(kind)
    values: dict[str, int | str] = {}
    for f in fields[1:]:
        key, eq, val = f.partition("=")
        if not eq or key not in (*_INT_KEYS, "phase", "factor", "where") or key in values:
            raise InjectSpecError(f"bad field {f!r} in --inject; {usage}")
        if key == "factor":
            try:
                values[key] = float(val)
            except ValueError:
                raise InjectSpecError(f"factor must be a number in --inject, got {val!r}") from None
            if not 1 < values[key] < float("inf"):
                raise InjectSpecError(f"factor must be a finite number > 1 in --inject (how "
                                      f"many times slower), got {val!r}")
            continue
        if key == "where":
            if kind is not FaultKind.FLIP or val not in FLIP_WHERE:
                raise InjectSpecError(f"where=W goes with flip only, W one of "
                                      f"{', '.join(FLIP_WHERE)}, in --inject, got {text!r}")
            values[key] = val
            continue
        if key == "phase":
            if val not in PHASES:
                raise InjectSpecError(f"phase must be one of {', '.join(PHASES)} in --inject, "
                                      f"got {val!r}")
            values[key] = val
            continue
        try:
            values[key] = int(val)
        except ValueError:
            raise InjectSpecError(f"{key} must be an integer in --inject, got {val!r}") from None
        # steps count from 1; gen 0 has no recovery; every=1 would be plain slow
        lowest = {"step": 1, "gen": 1, "every": 2, "ms": 1, "period": 2}.get(key, 0)
        if values[key] < lowest:
            raise InjectSpecError(f"{key} must be >= {lowest} in --inject, got {val!r}")
    if "rank" not in values:
        raise InjectSpecError(f"--inject needs rank=R; {usage}")
    if ("step" in values) == ("gen" in values):
        raise InjectSpecError(f"--inject needs exactly one of step=T or gen=G; {usage}")
    if ("microbatch" in values or "phase" in values) and "step" not in values:
        raise InjectSpecError(f"microbatch=J and phase=P need step=T in --inject; {usage}")
    if "microbatch" in values and "phase" in values:
        raise InjectSpecError(f"give microbatch=J or phase=P, not both, in --inject; {usage}")
    if kind in LANDS_AT and ("step" not in values or "microbatch" in values or "phase" in values):
        raise InjectSpecError(f"{kind} takes step=T only (it lands when snapshot T is "
                              f"{LANDS_AT[kind]}), got {text!r}")
    if "every" in values and kind is not FaultKind.SLOW:
        raise InjectSpecError(f"every=P goes with slow only, in --inject, got {text!r}")
    if ("factor" in values) != (kind is FaultKind.SLOW):
        raise InjectSpecError(f"factor=F goes with slow, and slow needs step=T:factor=F, in "
                              f"--inject, got {text!r}")
    if kind is FaultKind.SLOW and ("step" not in values or "microbatch" in values or "phase" in values):
        raise InjectSpecError(f"slow takes step=T:factor=F only (slower from step T on), "
                              f"got {text!r}")
    if ("ms" in values or "period" in values or kind is FaultKind.FREEZE) and not (
            kind is FaultKind.FREEZE and "ms" in values and "period" in values
            and "step" in values and "microbatch" not in values and "phase" not in values
            and values["ms"] < values["period"]):
        raise InjectSpecError(f"freeze takes step=T:ms=M:period=P with M < P (stopped M ms "
                              f"of every P from step T on), and ms=, period= go with freeze "
                              f"only, in --inject, got {text!r}")
    if kind is FaultKind.WRONG and ("step" not in values or "microbatch" in values
                                    or "phase" in values):
        raise InjectSpecError(f"wrong takes step=T only (wrong from step T on), got {text!r}")
    if values.get("phase") == "start":
        del values["phase"]
    if kind is FaultKind.FLIP:
        values.setdefault("where", "grad")
    return InjectSpec(kind=kind, **values)


def parse_env(text: str) -> list[InjectSpec]:
    return [parse_spec(s) for s in text.split(";") if s.strip()]


def format_env(specs: list[InjectSpec]) -> str:
    return ";".join(str(s) for s in specs)


@dataclass(kw_only=True)
class WorkerHooks:
    """What the worker lends the injector. `claim(spec)` must return True only once per
    spec across the job (the store's add counter gives that); `on_fire` records the fault
    before it lands; `settle` runs before a microbatch fault (see the grammar); `damage`
    does the shared-memory part of `corrupt` and `shm`; `agent_pid` is the node's agent."""

    claim: Callable[[str], bool]
    on_fire: Callable[[InjectSpec, float, dict], None] | None = None
    settle: Callable[[], None] | None = None
    damage: Callable[[str], None] | None = None
    agent_pid: int | None = None
    # `slow`: compute `factor` times slower from step T, on one step in `every` (or all)
    slow: Callable[[InjectSpec], None] | None = None
    # `wrong`: compute wrong gradients from step T on
    wrong: Callable[[InjectSpec], None] | None = None


class Injector:
    """Fires matching specs in the worker."""

    def __init__(self, specs: list[InjectSpec], hooks: WorkerHooks) -> None:
        self.specs = specs
        self.hooks = hooks

    def check_plan(self, per_rank: list[int], receivers: set[int] | None = None,
                   votes: frozenset[str] = frozenset({"grad", "param"}),
                   layout_phases: frozenset[str] | None = None,
                   user_loop: bool = True) -> None:
        """Refuse a spec that can never fire: rank R computes `per_rank[R]` microbatches
        per step, so its J-th (from 0) exists only when J < per_rank[R]; a garble needs
        rank R among `receivers`, the ranks that hold a replica (None: not checked). And a
        flip of gradients or parameters where no rank holds a copy to vote with (`votes`:
        the kinds of flip the job's vote finds): it would change the job's result with
        nothing to find it. A phase only
        some layouts reach (forward, backward) where the job's does not (`layout_phases`,
        None: not checked). A wrong gradient where no user's loop calls `step.backward`
        (`user_loop` False: a pipeline's schedule computes its losses itself)."""
        for s in self.specs:
            if s.kind is FaultKind.WRONG and not user_loop:
                raise InjectSpecError(
                    f"--inject {s} can never fire: it scales the loss the user's loop gives "
                    "step.backward, and a pipelined job's schedule computes its losses itself")
            if layout_phases is not None and s.phase in LAYOUT_PHASES \
                    and s.phase not in layout_phases:
                raise InjectSpecError(
                    f"--inject {s} can never fire: phase={s.phase} is "
                    + ("a pipeline's send or recv of activations (setup(pipeline=...))"
                       if s.phase == "forward" else "a sharded model's first gradient "
                       "reduce-scatter or a pipeline's send or recv of gradients")
                    + " and this job has neither; use microbatch=J or phase=reduce")
            if s.kind is FaultKind.FLIP and s.where in ("grad", "param") \
                    and s.where not in votes:
                tp = " (with tensor parallelism the tp copies of parameters are voted on: " \
                    "flip where=param)" if votes else ""
                raise InjectSpecError(
                    f"--inject {s} could never be found: no other rank holds this one's "
                    f"{'gradients' if s.where == 'grad' else 'parameters'} to vote with (a "
                    "sharded model without replica groups, one rank, or --fingerprint-every "
                    "0); give the job replicas (data parallel, or HSDP's dp_shard=), or flip "
                    f"where=optim, which the rank's own seal finds{tp}")
            if s.kind is FaultKind.GARBLE and receivers is not None and s.rank not in receivers:
                raise InjectSpecError(
                    f"--inject {s} can never fire: rank {s.rank} holds no replica (replicas "
                    f"go to another node in a job of several nodes, or to a peer on the "
                    f"same node with --replicas 1; snapshots on)")
            if s.microbatch is not None and s.rank < len(per_rank) and s.microbatch >= per_rank[s.rank]:
                raise InjectSpecError(
                    f"--inject {s} can never fire: rank {s.rank} computes {per_rank[s.rank]} "
                    f"microbatch(es) per step (microbatch counts from 0)")
        if self.hooks.agent_pid is None and any(s.kind is FaultKind.NODE for s in self.specs):
            raise InjectSpecError("--inject node:... needs an agent: run under `phoenixft run`")

    def _fire(self, point: dict) -> bool:
        """Land every spec matching `point`; True when one fired (and did not kill)."""
        fired = False
        for s in self.specs:
            if LANDS_AT.get(s.kind) != point.get("at") or any(
                    getattr(s, k) != point.get(k) for k in ("rank", "step", "gen", "microbatch",
                                                            "phase", "where")):
                continue
            if (s.microbatch is not None or s.phase in LAYOUT_PHASES) \
                    and self.hooks.settle is not None:
                self.hooks.settle()
            if self.hooks.claim(str(s)):
                if self.hooks.on_fire is not None:
                    self.hooks.on_fire(s, time.time(), {k: v for k, v in point.items()
                                                       if k not in ("rank", "at")
                                                       and v is not None})
                self._land(s)
                fired = True
        return fired

    def _land(self, s: InjectSpec) -> None:
        me = os.getpid()
        if s.kind in LANDS_AT:
            return  # the caller does the damage (`garbles`, `rots`)
        if s.kind is FaultKind.RAISE:
            raise InjectedFault(f"injected fault {s}")
        if s.kind is FaultKind.SLOW:
            if self.hooks.slow is None:
                raise InjectSpecError(f"--inject {s} needs a session to slow down")
            self.hooks.slow(s)
            return
        if s.kind is FaultKind.STOP:
            os.kill(me, signal.SIGSTOP)
            return
        if s.kind is FaultKind.FREEZE:
            freezer.start(me, s.ms, s.period)
            return
        if s.kind is FaultKind.WRONG:
            if self.hooks.wrong is None:
                raise InjectSpecError(f"--inject {s} needs a session to compute wrong")
            self.hooks.wrong(s)
            return
        if s.kind in (FaultKind.CORRUPT, FaultKind.SHM) and self.hooks.damage is not None:
            self.hooks.damage(s.kind)
        if s.kind is FaultKind.NODE and self.hooks.agent_pid is not None:
            os.kill(self.hooks.agent_pid, signal.SIGKILL)
        os.kill(me, signal.SIGKILL)

    def at_step(self, rank: int, step: int, phase: str | None = None) -> None:
        if self.specs:
            self._fire({"rank": rank, "step": step, "phase": phase})

    def garbles(self, rank: int, step: int) -> bool:
        """The snapshot thread, about to check the replicas of `step` it received or
        copied: True when a garble spec fires now (the caller then damages them)."""
        return self._lands(rank, step, FaultKind.GARBLE)

    def rots(self, rank: int, step: int) -> bool:
        """The snapshot thread, its own snapshot `step` written: True when a rot spec
        fires now (the caller then damages it)."""
        return self._lands(rank, step, FaultKind.ROT)

    def _lands(self, rank: int, step: int, kind: FaultKind, **point) -> bool:
        if not any(s.kind is kind for s in self.specs):
            return False
        return self._fire({"rank": rank, "step": step, "at": LANDS_AT[kind], **point})

    def flips(self, rank: int, step: int, where: str) -> bool:
        """The session at the point of step `step` where a flip of `where` lands
        (FLIP_WHERE): True when a flip spec fires now (the caller then flips the bit)."""
        return self._lands(rank, step, FaultKind.FLIP, where=where)

    def at_recovery(self, rank: int, gen: int) -> None:
        if self.specs:
            self._fire({"rank": rank, "gen": gen})

    def at_microbatch(self, rank: int, step: int, j: int) -> None:
        if self.specs:
            self._fire({"rank": rank, "step": step, "microbatch": j})

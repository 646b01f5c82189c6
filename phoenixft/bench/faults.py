"""Run a training job as its own process tree and SIGKILL its workers on a wall-clock schedule.

Used by `phoenixft bench goodput` to put phoenixft and a plain torchrun job through the
same failures. The faults are real: the benchmark process sends SIGKILL to a training
worker's PID, chosen among the workers that are training at that moment. Each job kind
says how to read its progress and find its workers (`Job`); `drive` does the rest.

Two schedules:
- by wall clock (the benchmark's default): fault k (k = 1..n) is due `k * interval_s` after
  the job's first completed step, and is sent only once the job has completed a step since
  the previous fault's recovery (a step of a newer generation or restart attempt). Every
  job gets n faults *while training*, none while it is still restarting. A fault that fell
  due during a recovery is therefore sent right after the first step back: a job whose
  recovery outlasts the interval (torchrun's restarts, at short intervals) loses each
  restart's work again.
- by step (`at_steps`): fault k fires when the job starts step `at_steps[k]`. The job is
  told its schedule at launch and the worker SIGKILLs itself at that point, so a fault can
  never miss the step it was meant for, however fast the job or slow the benchmark
  process: what tests use, since they must not race the clock.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from phoenixft.observe.steps import StepEvent

if TYPE_CHECKING:  # imported where used: a base install (no psutil) builds the CLI too
    import psutil


class ProcessTree:
    """A job started in its own session, with every descendant it ever had remembered.

    A benchmark that kills workers must also clean up whatever is left, including workers
    whose parent already died (they are re-parented and no longer show up as descendants):
    `refresh()` records descendants while the job runs, and `kill()` SIGKILLs every
    recorded process that is still the same process (PID and start time both match)."""

    def __init__(self, argv: list[str], *, log: Path, env: dict[str, str] | None = None) -> None:
        import psutil  # the bench extra

        self._ps = psutil
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("wb")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                      env={**os.environ, **(env or {})}, start_new_session=True)
        self.root = psutil.Process(self.popen.pid)
        self._seen: dict[int, psutil.Process] = {self.root.pid: self.root}

    def refresh(self) -> list[psutil.Process]:
        """The live descendants now (remembered for `kill`)."""
        try:
            kids = self.root.children(recursive=True)
        except self._ps.NoSuchProcess:
            kids = []
        for k in kids:
            self._seen.setdefault(k.pid, k)
        return kids

    def owns(self, pid: int) -> bool:
        """True if `pid` is a live process of this tree: nothing else is ever signalled."""
        p = self._seen.get(pid)
        try:
            return p is not None and p.is_running() and p.status() != self._ps.STATUS_ZOMBIE
        except self._ps.NoSuchProcess:
            return False

    def kill(self) -> None:
        """SIGKILL the whole tree (idempotent) and reap the root."""
        self.refresh()
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self._seen.values():
            try:
                if p.is_running():  # compares the start time too: a reused PID is left alone
                    p.kill()
            except self._ps.NoSuchProcess:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class JsonlTail:
    """The complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line is read on a later call
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


@dataclass(frozen=True, slots=True)
class StepFault:
    """SIGKILL the worker holding `rank` when it starts `step`, once per job (a restarted
    job that replays the step does not die again); `index` is its place in the schedule."""

    index: int
    rank: int
    step: int


class Job(Protocol):
    """One launched job. `start(step_faults)` launches it, telling it the faults it must
    inject itself; `new_steps()` returns steps completed since the last call (in order);
    `victims()` maps rank -> PID of the workers training now (PIDs of this job's own tree
    only); `injected()` lists the self-injected faults that fired, as `Outcome.kills`
    entries; `events` holds every record read so far."""

    tree: ProcessTree | None
    events: list[dict]

    def start(self, step_faults: list[StepFault]) -> ProcessTree: ...
    def new_steps(self) -> list[StepEvent]: ...
    def victims(self) -> dict[int, int]: ...
    def injected(self) -> list[dict]: ...


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """When to kill. `failures` faults, `interval_s` apart from the first step, or at the
    steps `at_steps` (then `failures` must equal their count); the job is killed outright
    after `timeout_s` of wall time."""

    failures: int = 3
    interval_s: float = 30.0
    at_steps: tuple[int, ...] = ()
    timeout_s: float = 600.0
    seed: int = 0  # which rank dies at each fault (a seeded choice among the live ones)
    poll_s: float = 0.05
    # wall-clock faults wait until the job trains on this many workers again (0: once it
    # recovered at all): an HSDP job of 2 replica groups that lost one has no group to
    # lose next until the lost one came back
    full_world: int = 0

    def __post_init__(self) -> None:
        if self.full_world < 0:
            raise ValueError(f"FaultConfig.full_world must be >= 0, got {self.full_world}")
        if self.failures < 0:
            raise ValueError(f"FaultConfig.failures must be >= 0, got {self.failures}")
        for name in ("interval_s", "timeout_s", "poll_s"):
            if not getattr(self, name) > 0 or getattr(self, name) == float("inf"):
                raise ValueError(f"FaultConfig.{name} must be a finite number > 0, "
                                 f"got {getattr(self, name)}")
        if self.at_steps:
            if len(self.at_steps) != self.failures:
                raise ValueError(f"FaultConfig.at_steps has {len(self.at_steps)} steps for "
                                 f"{self.failures} failures")
            if any(s < 1 for s in self.at_steps) or list(self.at_steps) != sorted(set(self.at_steps)):
                raise ValueError(f"FaultConfig.at_steps must be increasing steps >= 1, "
                                 f"got {list(self.at_steps)}")

    def step_faults(self, nproc: int, shrinking: bool) -> list[StepFault]:
        """The seeded rank of each step fault: among the ranks that will exist then (a job
        that shrinks has one rank fewer after each fault)."""
        rng = random.Random(self.seed)
        return [StepFault(k, rng.randrange(nproc - k if shrinking else nproc), s)
                for k, s in enumerate(self.at_steps)]


@dataclass(kw_only=True)
class Outcome:
    """What happened to one job: its steps as they completed, the faults sent, how it ended."""

    t_launch: float
    steps: list[StepEvent] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    rc: int | None = None
    timed_out: bool = False
    t_exit: float = 0.0


def drive(job: Job, cfg: FaultConfig, step_faults: list[StepFault] | None = None) -> Outcome:
    """Launch `job`, kill its workers on `cfg`'s schedule (or let it inject `step_faults`
    itself), wait for its end (or timeout), and always kill whatever is left of its
    process tree."""
    rng = random.Random(cfg.seed)
    out = Outcome(t_launch=time.time())
    tree = job.start(step_faults or [])
    try:
        while True:
            out.steps += job.new_steps()
            tree.refresh()
            out.rc = tree.popen.poll()
            now = time.time()
            if out.rc is not None:
                break
            if now - out.t_launch > cfg.timeout_s:
                out.timed_out = True
                break
            if not step_faults and out.steps and len(out.kills) < cfg.failures:
                _maybe_kill(job, cfg, out, rng, now)
            time.sleep(cfg.poll_s)  # polling a log file with a bounded deadline
    finally:
        out.t_exit = time.time()
        tree.kill()
        out.steps += job.new_steps()
    if step_faults:
        out.kills = job.injected()
    return out


def _maybe_kill(job: Job, cfg: FaultConfig, out: Outcome, rng: random.Random, now: float) -> None:
    latest = out.steps[-1]
    due = out.steps[0].t + (len(out.kills) + 1) * cfg.interval_s
    recovered = not out.kills or latest.epoch > out.kills[-1]["epoch"]
    if now < due or not recovered or latest.world_size < cfg.full_world:
        return
    victims = job.victims()
    if not victims:
        return
    rank = rng.choice(sorted(victims))
    pid = victims[rank]
    if not job.tree or not job.tree.owns(pid):
        return
    os.kill(pid, signal.SIGKILL)
    out.kills.append({"t": time.time(), "rank": rank, "pid": pid, "step": latest.step,
                      "epoch": latest.epoch, "world_size": len(victims)})

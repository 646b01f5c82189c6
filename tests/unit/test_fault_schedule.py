"""`bench`'s wall-clock fault rule (faults._maybe_kill): a fault is due `interval_s` after
the first step per fault already sent, waits for the job to recover from the last one
and, with `full_world`, for the job to train on that many workers again (an HSDP job of 2
replica groups has no group to lose while the lost one is away). Real processes are
killed: `sleep`s started here, one per rank."""

import random
import subprocess

import pytest

from phoenixft.bench.faults import FaultConfig, Outcome, _maybe_kill
from phoenixft.observe.steps import StepEvent


class Sleepers:
    """A stand-in job whose 'workers' are `sleep` processes (what `_maybe_kill` needs of a
    job: victims() and a tree that owns them)."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen(["sleep", "60"]) for _ in range(n)]
        self.tree = self

    def owns(self, pid: int) -> bool:
        return any(p.pid == pid for p in self.procs)

    def victims(self) -> dict[int, int]:
        return {r: p.pid for r, p in enumerate(self.procs) if p.poll() is None}

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def job():
    j = Sleepers(4)
    yield j
    j.close()


def _out(*steps: tuple[float, int, int, int]) -> Outcome:
    return Outcome(t_launch=0.0, steps=[StepEvent(*s) for s in steps])


def test_a_fault_waits_for_its_time_and_for_the_full_world(job):
    cfg = FaultConfig(failures=2, interval_s=10.0, full_world=4)
    out = _out((0.0, 1, 0, 4), (5.0, 2, 0, 4))
    _maybe_kill(job, cfg, out, random.Random(0), now=9.0)
    assert out.kills == []  # not due yet
    _maybe_kill(job, cfg, out, random.Random(0), now=10.0)
    [first] = out.kills
    assert job.procs[first["rank"]].wait(timeout=10) == -9
    # the job recovered on 2 workers (a group left): the second fault, due at 20 s, waits
    out.steps.append(StepEvent(21.0, 3, 1, 2))
    _maybe_kill(job, cfg, out, random.Random(0), now=25.0)
    assert len(out.kills) == 1
    out.steps.append(StepEvent(26.0, 4, 2, 4))  # the group is back
    _maybe_kill(job, cfg, out, random.Random(0), now=26.5)
    assert len(out.kills) == 2 and out.kills[1]["epoch"] == 2


def test_without_full_world_a_recovered_smaller_job_is_a_target(job):
    cfg = FaultConfig(failures=2, interval_s=10.0)
    out = _out((0.0, 1, 0, 4))
    _maybe_kill(job, cfg, out, random.Random(0), now=10.0)
    _maybe_kill(job, cfg, out, random.Random(0), now=21.0)
    assert len(out.kills) == 1  # no step of a later epoch yet: not recovered
    out.steps.append(StepEvent(21.0, 2, 1, 3))
    _maybe_kill(job, cfg, out, random.Random(0), now=21.5)
    assert len(out.kills) == 2


def test_a_negative_full_world_is_refused():
    with pytest.raises(ValueError, match="full_world"):
        FaultConfig(full_world=-1)

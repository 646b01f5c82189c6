"""Fault-injection specs and the injector's fire-once rule."""

from __future__ import annotations

import pytest

from phoenixft.faults.inject import (
    FaultKind,
    InjectedFault,
    Injector,
    InjectSpecError,
    WorkerHooks,
    parse_env,
    parse_spec,
)


def test_inject_specs():
    s = parse_spec("kill:rank=2:step=7")
    assert (s.kind, s.rank, s.step) == ("kill", 2, 7) and str(s) == "kill:rank=2:step=7"
    assert s.kind is FaultKind.KILL and f"{s.kind}" == "kill"  # a kind, not a string
    assert parse_spec("stop:rank=0:gen=1").gen == 1
    assert parse_spec("kill:rank=1:step=3:microbatch=2").microbatch == 2
    assert len(parse_env("kill:rank=1:step=3;stop:rank=0:step=4")) == 2
    assert parse_spec("node:rank=0:step=3:phase=replicate").phase == "replicate"
    assert str(parse_spec("kill:rank=0:step=3:phase=start")) == "kill:rank=0:step=3"
    for bad, msg in [("boom:rank=1:step=1", "unknown fault kind"), ("kill:rank=1", "exactly one"),
                     ("kill:rank=1:step=1:gen=1", "exactly one"), ("kill:rank=-1:step=1", ">= 0"),
                     ("kill:rank=1:gen=1:microbatch=0", "need step"), ("kill:rank=1:foo=1", "bad field"),
                     ("kill:rank=0:step=0", ">= 1"), ("kill:rank=0:gen=0", ">= 1"),
                     ("kill:rank=0:step=2:phase=lunch", "phase must be one of"),
                     ("kill:rank=0:step=2:phase=reduce:microbatch=0", "not both"),
                     ("kill:rank=0:step=2:step=3", "bad field"),
                     ("slow:rank=0:step=2", "slow needs step=T:factor=F"),
                     ("slow:rank=0:gen=2:factor=3", "slow takes step=T:factor=F only"),
                     ("slow:rank=0:step=2:factor=1", "finite number > 1"),
                     ("slow:rank=0:step=2:factor=nan", "finite number > 1"),
                     ("slow:rank=0:step=2:factor=x", "factor must be a number"),
                     ("kill:rank=0:step=2:factor=3", "factor=F goes with slow"),
                     ("slow:rank=0:step=2:factor=3:every=1", "every must be >= 2"),
                     ("kill:rank=0:step=2:every=3", "every=P goes with slow only"),
                     ("freeze:rank=0:step=2:ms=150", "freeze takes step=T:ms=M:period=P"),
                     ("freeze:rank=0:step=2:ms=250:period=250", "with M < P"),
                     ("freeze:rank=0:gen=2:ms=150:period=250", "freeze takes step=T"),
                     ("freeze:rank=0:step=2:phase=reduce:ms=1:period=2", "freeze takes step=T"),
                     ("kill:rank=0:step=2:ms=150:period=250", "go with freeze only"),
                     ("freeze:rank=0:step=2:ms=0:period=250", "ms must be >= 1"),
                     ("wrong:rank=0:gen=2", "wrong takes step=T only"),
                     ("wrong:rank=0:step=2:phase=reduce", "wrong takes step=T only")]:
        with pytest.raises(InjectSpecError, match=msg):
            parse_spec(bad)


def test_injector_fires_once_per_spec(monkeypatch):
    fired, claimed = [], set()

    def claim(key):
        if key in claimed:
            return False
        claimed.add(key)
        return True

    monkeypatch.setattr("os.kill", lambda pid, sig: fired.append((pid, sig)))
    damaged = []
    inj = Injector(parse_env("kill:rank=1:step=3;stop:rank=0:gen=2;node:rank=0:step=4:phase=update;"
                             "corrupt:rank=1:step=5:microbatch=1;raise:rank=0:step=6:phase=commit"),
                   WorkerHooks(claim=claim, damage=damaged.append, agent_pid=4242))
    inj.at_step(0, 3)
    inj.at_step(1, 2)
    inj.at_step(1, 3, "reduce")  # another phase of the same step
    assert fired == []
    inj.at_step(1, 3)
    inj.at_step(1, 3)  # the spare replaying step 3 is not killed again
    inj.at_recovery(0, 2)
    assert [sig for _, sig in fired] == [9, 19]
    inj.at_step(0, 4, "update")  # node: the agent first, then itself
    assert [(pid, sig) for pid, sig in fired[2:]] == [(4242, 9), (fired[0][0], 9)]
    inj.at_microbatch(1, 5, 1)
    assert damaged == ["corrupt"] and len(fired) == 5
    with pytest.raises(InjectedFault, match="raise:rank=0:step=6:phase=commit"):
        inj.at_step(0, 6, "commit")


def test_a_microbatch_that_no_rank_computes_is_refused():
    inj = Injector(parse_env("kill:rank=1:step=2:microbatch=1"), WorkerHooks(claim=lambda s: True))
    inj.check_plan([2, 2])
    with pytest.raises(InjectSpecError, match="can never fire: rank 1 computes 1"):
        inj.check_plan([1, 1])


@pytest.mark.parametrize("kind", ["garble", "rot"])
def test_a_snapshot_thread_fault_lands_only_at_its_own_point(monkeypatch, kind):
    """garble lands where a rank checks the replicas it holds, rot where its own snapshot
    has just been written: never at a step's start or phase, once per job, and the one
    does not take the other's claim."""
    for bad in (f"{kind}:rank=0:gen=2", f"{kind}:rank=0:step=3:phase=replicate",
                f"{kind}:rank=0:step=3:microbatch=0"):
        with pytest.raises(InjectSpecError, match=f"{kind} takes step=T only"):
            parse_spec(bad)
    claimed: set[str] = set()
    monkeypatch.setattr("os.kill", lambda pid, sig: pytest.fail(f"a {kind} killed a process"))
    other = "rot" if kind == "garble" else "garble"
    inj = Injector(parse_env(f"{kind}:rank=1:step=4;{other}:rank=1:step=4"),
                   WorkerHooks(claim=lambda s: not (s in claimed or claimed.add(s))))
    lands, other_lands = (inj.garbles, inj.rots) if kind == "garble" else (inj.rots, inj.garbles)
    inj.at_step(1, 4)
    inj.at_step(1, 4, "snapshot")
    assert not claimed
    assert not lands(0, 4) and not lands(1, 3)
    assert lands(1, 4) and not lands(1, 4)  # once per job
    assert claimed == {f"{kind}:rank=1:step=4"}
    assert other_lands(1, 4)


def test_a_garble_needs_a_rank_that_holds_a_replica():
    inj = Injector(parse_env("garble:rank=1:step=4"), WorkerHooks(claim=lambda s: True))
    inj.check_plan([1, 1], receivers={0, 1})
    inj.check_plan([1], receivers=None)  # a spare's later setup: not checked again
    with pytest.raises(InjectSpecError, match="can never fire: rank 1 holds no replica"):
        inj.check_plan([1, 1], receivers={0})


def test_a_slow_fault_slows_its_worker_and_it_carries_on():
    s = parse_spec("slow:rank=1:step=4:factor=3")
    assert (s.kind, s.step, s.factor) == ("slow", 4, 3.0) and parse_spec(str(s)) == s
    slowed = []
    inj = Injector([s], WorkerHooks(claim=lambda key: True, slow=slowed.append))
    inj.at_step(1, 3)
    inj.at_step(1, 4, "reduce")
    assert slowed == []
    inj.at_step(1, 4)  # no signal: the process goes on, slower
    assert slowed == [s]
    assert parse_spec("slow:rank=0:step=2:factor=4:every=3").every == 3


def test_a_wrong_fault_marks_its_worker_and_it_carries_on():
    s = parse_spec("wrong:rank=1:step=10")
    assert (s.kind, s.step) == ("wrong", 10) and parse_spec(str(s)) == s
    marked = []
    inj = Injector([s], WorkerHooks(claim=lambda key: True, wrong=marked.append))
    inj.at_step(1, 9)
    assert marked == []
    inj.at_step(1, 10)  # no signal: the process goes on, computing wrong
    assert marked == [s]


def test_a_freeze_spec_reads_back_as_written():
    s = parse_spec("freeze:rank=1:step=5:ms=150:period=250")
    assert (s.kind, s.step, s.ms, s.period) == ("freeze", 5, 150, 250)
    assert str(s) == "freeze:rank=1:step=5:ms=150:period=250" and parse_spec(str(s)) == s



def test_a_flip_lands_only_where_it_says():
    """flip:...:where=W (default grad) fires at its own state's point of step T only."""
    assert str(parse_spec("flip:rank=1:step=3")) == "flip:rank=1:step=3:where=grad"
    for bad, msg in [("flip:rank=1:step=3:where=disk", "where=W goes with flip only"),
                     ("kill:rank=1:step=3:where=grad", "where=W goes with flip only"),
                     ("flip:rank=1:step=3:phase=reduce", "flip takes step=T only")]:
        with pytest.raises(InjectSpecError, match=msg):
            parse_spec(bad)
    claimed: set[str] = set()
    inj = Injector(parse_env("flip:rank=1:step=4:where=optim;flip:rank=1:step=4"),
                   WorkerHooks(claim=lambda s: not (s in claimed or claimed.add(s))))
    inj.at_step(1, 4)
    assert not claimed
    assert not inj.flips(1, 4, "param") and not inj.flips(0, 4, "optim")
    assert inj.flips(1, 4, "optim") and not inj.flips(1, 4, "optim")
    assert inj.flips(1, 4, "grad")
    assert claimed == {"flip:rank=1:step=4:where=optim", "flip:rank=1:step=4:where=grad"}


@pytest.mark.parametrize("phase,reaches", [("forward", {"forward", "backward"}),
                                           ("backward", {"backward"})])
def test_a_phase_inside_the_passes_is_refused_where_the_layout_never_reaches_it(phase, reaches):
    inj = Injector(parse_env(f"kill:rank=1:step=4:phase={phase}"), WorkerHooks(claim=lambda s: True))
    inj.check_plan([1, 1], layout_phases=frozenset(reaches))  # a pipeline / a sharded model
    with pytest.raises(InjectSpecError, match=f"can never fire: phase={phase} is"):
        inj.check_plan([1, 1], layout_phases=frozenset())  # data parallel: no such point
    with pytest.raises(InjectSpecError, match="phase=forward is a pipeline's"):
        Injector(parse_env("kill:rank=1:step=4:phase=forward"),
                 WorkerHooks(claim=lambda s: True)).check_plan(
            [1, 1], layout_phases=frozenset({"backward"}))

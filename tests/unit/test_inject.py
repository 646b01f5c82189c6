"""Fault-injection specs and the injector's fire-once rule."""

from __future__ import annotations

import pytest

from phoenixft.faults.inject import (
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
                     ("kill:rank=0:step=2:step=3", "bad field")]:
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


def test_a_garble_lands_only_where_replicas_arrive(monkeypatch):
    for bad in ("garble:rank=0:gen=2", "garble:rank=0:step=3:phase=replicate",
                "garble:rank=0:step=3:microbatch=0"):
        with pytest.raises(InjectSpecError, match="garble takes step=T only"):
            parse_spec(bad)
    claimed: set[str] = set()
    monkeypatch.setattr("os.kill", lambda pid, sig: pytest.fail("a garble killed a process"))
    inj = Injector(parse_env("garble:rank=1:step=4"),
                   WorkerHooks(claim=lambda s: not (s in claimed or claimed.add(s))))
    inj.at_step(1, 4)  # the step's start is not where it lands
    assert not claimed
    assert not inj.garbles(0, 4) and not inj.garbles(1, 3)
    assert inj.garbles(1, 4) and not inj.garbles(1, 4)  # once per job
    inj.check_plan([1, 1], receivers={0, 1})
    inj.check_plan([1], receivers=None)  # a spare's later setup: not checked again
    with pytest.raises(InjectSpecError, match="can never fire: rank 1 holds no replica"):
        inj.check_plan([1, 1], receivers={0})


def test_a_rot_lands_where_its_own_snapshot_is_written(monkeypatch):
    for bad in ("rot:rank=0:gen=2", "rot:rank=0:step=3:phase=snapshot"):
        with pytest.raises(InjectSpecError, match="rot takes step=T only"):
            parse_spec(bad)
    claimed: set[str] = set()
    monkeypatch.setattr("os.kill", lambda pid, sig: pytest.fail("a rot killed a process"))
    inj = Injector(parse_env("rot:rank=1:step=4;garble:rank=1:step=4"),
                   WorkerHooks(claim=lambda s: not (s in claimed or claimed.add(s))))
    inj.at_step(1, 4)
    inj.at_step(1, 4, "snapshot")  # neither a step's start nor a phase is where they land
    assert not claimed
    assert not inj.rots(0, 4) and not inj.rots(1, 3)
    assert inj.rots(1, 4) and not inj.rots(1, 4)  # once per job
    assert claimed == {"rot:rank=1:step=4"}  # the garble of the same step is still to come
    assert inj.garbles(1, 4)

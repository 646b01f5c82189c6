"""Fault-injection specs and the injector's fire-once rule."""

from __future__ import annotations

import pytest

from phoenixft.faults.inject import Injector, InjectSpecError, parse_env, parse_spec


def test_inject_specs():
    s = parse_spec("kill:rank=2:step=7")
    assert (s.kind, s.rank, s.step) == ("kill", 2, 7) and str(s) == "kill:rank=2:step=7"
    assert parse_spec("stop:rank=0:gen=1").gen == 1
    assert parse_spec("kill:rank=1:step=3:microbatch=2").microbatch == 2
    assert len(parse_env("kill:rank=1:step=3;stop:rank=0:step=4")) == 2
    for bad, msg in [("boom:rank=1:step=1", "unknown fault kind"), ("kill:rank=1", "exactly one"),
                     ("kill:rank=1:step=1:gen=1", "exactly one"), ("kill:rank=-1:step=1", ">= 0"),
                     ("kill:rank=1:gen=1:microbatch=0", "needs step"), ("kill:rank=1:foo=1", "bad field")]:
        with pytest.raises(InjectSpecError, match=msg):
            parse_spec(bad)


def test_injector_fires_once_per_spec(monkeypatch):
    fired, claimed = [], set()

    def claim(key):
        if key in claimed:
            return False
        claimed.add(key)
        return True

    monkeypatch.setattr("os.kill", lambda pid, sig: fired.append(sig))
    inj = Injector(parse_env("kill:rank=1:step=3;stop:rank=0:gen=2"), claim)
    inj.at_step(0, 3)
    inj.at_step(1, 2)
    assert fired == []
    inj.at_step(1, 3)
    inj.at_step(1, 3)  # the spare replaying step 3 is not killed again
    inj.at_recovery(0, 2)
    assert len(fired) == 2

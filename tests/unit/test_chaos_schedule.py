"""Chaos schedules: seeded, spaced, within the run, of survivable kinds."""

from __future__ import annotations

import pytest

from phoenixft.faults.chaos import GAP, ChaosConfig, schedule, spares_needed
from phoenixft.faults.inject import parse_spec


def test_a_seed_gives_one_schedule_of_parseable_spaced_faults():
    cfg = ChaosConfig(seed=7, faults=10, steps=45, world_size=2)
    a, b = schedule(cfg), schedule(cfg)
    assert a == b and len(a) == 10
    assert schedule(ChaosConfig(seed=8, faults=10, steps=45, world_size=2)) != a
    assert all(parse_spec(str(s)) == s for s in a)
    steps = [s.step for s in a if s.step is not None]
    assert all(2 <= t < 45 for t in steps) and all(b - a >= GAP for a, b in zip(steps, steps[1:]))
    assert {s.kind for s in a} <= {"kill", "stop", "corrupt"}
    for k, s in enumerate(a, start=1):
        if s.gen is not None:  # a recovery fault strikes the recovery from the fault before
            assert s.gen == k - 1 >= 1 and s.kind == "kill"
    assert spares_needed(a, 2) == 10


def test_many_nodes_add_node_faults_but_keep_one_node():
    specs = schedule(ChaosConfig(seed=3, faults=12, steps=60, world_size=4, nnodes=2))
    assert sum(s.kind == "node" for s in specs) <= 1
    with pytest.raises(ValueError, match="no room"):
        ChaosConfig(seed=0, faults=10, steps=20, world_size=2)

"""Plans and replica placement."""

from __future__ import annotations

from phoenixft.cluster.membership import Plan, replica_holders


def test_replica_holders_prefer_other_nodes():
    assert replica_holders({0: 0, 1: 0, 2: 0}, 1) == {0: [1], 1: [2], 2: [0]}
    h = replica_holders({0: 0, 1: 0, 2: 1, 3: 1}, 1)
    assert all({0: 0, 1: 0, 2: 1, 3: 1}[r] != {0: 0, 1: 0, 2: 1, 3: 1}[hs[0]] for r, hs in h.items())
    assert replica_holders({0: 0}, 0) == {0: []}


def test_plan_roundtrip():
    p = Plan(generation=3, members={0: "n0w0", 1: "n1w2"}, nodes={0: 0, 1: 1}, replaced={1: "n1w0"})
    q = Plan.from_json(p.to_json())
    assert q == p and q.rank_of("n1w2") == 1 and q.world_size == 2

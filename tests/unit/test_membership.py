"""Plans and replica placement."""

from __future__ import annotations

from phoenixft.cluster.membership import Plan, replica_holders


def test_replica_holders_prefer_other_nodes():
    assert replica_holders({0: 0, 1: 0, 2: 0}, 1) == {0: [1], 1: [2], 2: [0]}
    h = replica_holders({0: 0, 1: 0, 2: 1, 3: 1}, 1)
    assert all({0: 0, 1: 0, 2: 1, 3: 1}[r] != {0: 0, 1: 0, 2: 1, 3: 1}[hs[0]] for r, hs in h.items())
    assert replica_holders({0: 0}, 0) == {0: []}


def test_replicas_by_default_only_cross_nodes():
    """The default (`--replicas` unset) keeps a copy on another node only: a same-node copy
    shares the node's fate, and a worker's death never takes its node's slots."""
    one_node = {0: 0, 1: 0, 2: 0}
    assert replica_holders(one_node, 1, same_node=False) == {0: [], 1: [], 2: []}
    two = {0: 0, 1: 0, 2: 1, 3: 1}
    h = replica_holders(two, 1, same_node=False)
    assert all(len(hs) == 1 and two[hs[0]] != two[r] for r, hs in h.items())
    # more than the other nodes can hold: no same-node copy fills the gap
    assert replica_holders(two, 3, same_node=False) == {0: [2, 3], 1: [2, 3], 2: [0, 1], 3: [0, 1]}


def test_plan_roundtrip():
    p = Plan(generation=3, members={0: "n0w0", 1: "n1w2"}, nodes={0: 0, 1: 1}, replaced={1: "n1w0"})
    q = Plan.from_json(p.to_json())
    assert q == p and q.rank_of("n1w2") == 1 and q.world_size == 2

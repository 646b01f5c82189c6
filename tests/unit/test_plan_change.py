"""A plan read as a change to the one before (`Plan.change_from` / `Plan.changed`), and
`protocol.read_plan` choosing between the change and the whole plan."""

from __future__ import annotations

import json

import torch

from phoenixft.cluster import protocol
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan, PlanKind


def _plan(g: int, n: int, **kw) -> Plan:
    return Plan(generation=g, members={r: f"n{r // 4}w{r % 4}" for r in range(n)},
                nodes={r: r // 4 for r in range(n)}, **kw)


def test_a_replacement_is_one_entry():
    a = _plan(3, 1024)
    b = _plan(4, 1024, replaced={5: a.members[5]}, reason="exit", t_fail=1.0, t_detect=2.0,
              progress=7)
    b.members[5], b.nodes[5] = "spare0", 999
    change = b.change_from(a)
    rank_by_rank = len(json.dumps({"members": b.members, "nodes": b.nodes}))
    assert len(change) < rank_by_rank / 50
    got = a.changed(change)
    assert got == b
    assert got.rank_of("spare0") == 5 and got.rank_of(a.members[5]) is None


def test_a_shrink_renumbers_and_drops_the_tail():
    a = _plan(1, 8)
    b = Plan(generation=2, members={r: w for r, w in enumerate(
        [w for r, w in a.members.items() if r != 2])},
        nodes={r: n for r, n in enumerate([n for r, n in a.nodes.items() if r != 2])})
    assert a.changed(b.change_from(a)) == b


def test_an_end_of_job_plan_has_no_members():
    a = _plan(5, 8)
    done = Plan(generation=6, kind=PlanKind.DONE, reason="all ranks finished")
    got = a.changed(done.change_from(a))
    assert got.kind is PlanKind.DONE and got.members == {} and got.world_size == 0


def test_rank_of_follows_a_replaced_member_list():
    p = _plan(0, 4)
    assert p.rank_of("n0w3") == 3
    p.members = {0: "x"}
    assert p.rank_of("n0w3") is None and p.rank_of("x") == 0


def test_read_plan_takes_the_change_only_from_the_plan_before():
    store = torch.distributed.HashStore()
    a, b = _plan(0, 16), _plan(1, 16, reason="r")
    b.members[3] = "spare"
    store.set(Keys.plan(0), a.to_json())
    store.multi_set([Keys.plan_change(1), Keys.plan(1)], [b.change_from(a), b.to_json()])
    assert protocol.newest_plan(store, 0, known=a) == b
    assert protocol.newest_plan(store, 0) == b  # no plan held: the whole one
    assert protocol.newest_plan(store, 1, known=b) is b  # held already: not read again
    memo: dict = {}
    first = protocol.read_plan(store, 1, a, memo)
    assert protocol.read_plan(store, 1, a, memo) is first  # parsed once, shared


def test_a_plan_of_nodes_alike_is_a_few_bytes_however_many_ranks():
    sizes = {}
    for n in (64, 16384):
        p = _plan(0, n)
        sizes[n] = len(p.to_json())
        assert Plan.from_json(p.to_json()) == p
    assert sizes[16384] <= sizes[64] + 4  # (the node count's digits), and small
    assert sizes[16384] < 300


def test_runs_keep_every_membership_exactly():
    a = _plan(2, 64)
    b = _plan(3, 64, replaced={5: a.members[5], 40: a.members[40]})
    b.members[5] = "n1w4"  # the spare of node 1 takes rank 5
    b.members[40], b.nodes[40] = "n3w4", 3  # a spare on another node
    b.members[41] = "spare0"  # a worker id of another form
    b.members[42], b.nodes[42] = "n10w2", 9  # its name says another node than it is on
    for p in (a, b):
        got = Plan.from_json(p.to_json())
        assert got == p and got.members == p.members and got.nodes == p.nodes
    assert len(b.to_json()) < 500
    shrunk = Plan(generation=4, members={r: w for r, w in enumerate(
        w for r, w in a.members.items() if r != 2)},
        nodes={r: k for r, k in enumerate(k for r, k in a.nodes.items() if r != 2)})
    assert Plan.from_json(shrunk.to_json()) == shrunk
    mixed = Plan(generation=0, members={0: "n0w0", 1: "n0w1", 2: "n1w0", 3: "n2w0", 4: "n2w1"},
                 nodes={0: 0, 1: 0, 2: 1, 3: 2, 4: 2})
    assert Plan.from_json(mixed.to_json()) == mixed

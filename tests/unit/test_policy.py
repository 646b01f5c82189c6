"""The leader's failure policy (cluster/policy.py), from tables: plan + failures + spares
-> the next plan or a stop."""

import pytest

from phoenixft.cluster.membership import Plan
from phoenixft.cluster.policy import (
    Decision,
    Failed,
    Spare,
    StragglerReport,
    after_failures,
    grow,
    swap_straggler,
)


def plan(members: str, nodes: str = "", gen: int = 0, **kw) -> Plan:
    ws = members.split()
    ns = [int(n) for n in nodes.split()] if nodes else [0] * len(ws)
    return Plan(generation=gen, members=dict(enumerate(ws)), nodes=dict(enumerate(ns)), **kw)


def failed(*pairs) -> list[Failed]:
    return [Failed(w, r, "killed by SIGKILL", 10.0 + r, 11.0 + r) for w, r in pairs]


def spares(*pairs) -> list[Spare]:
    return [Spare(w, n) for w, n in pairs]


@pytest.mark.parametrize("members, nodes, dead, live, expect", [
    # one dead rank, one spare: it takes the rank
    ("a b", "0 0", [("b", 1)], [("s", 0)], {0: "a", 1: "s"}),
    # a spare on the dead rank's node is preferred (it maps the snapshot from shm)
    ("a b", "0 1", [("b", 1)], [("s0", 0), ("s1", 1)], {0: "a", 1: "s1"}),
    # else the lowest-named spare elsewhere
    ("a b", "0 0", [("a", 0)], [("z", 1), ("y", 1)], {0: "y", 1: "b"}),
    # two dead ranks, two spares: in failure order
    ("a b c", "0 0 0", [("c", 2), ("a", 0)], [("s", 0), ("t", 0)], {0: "t", 1: "b", 2: "s"}),
])
def test_spares_take_dead_ranks(members, nodes, dead, live, expect):
    nxt = after_failures(plan(members, nodes), failed(*dead), spares(*live), min_world=None,
                         progress=7, previous_recovered=True)
    assert nxt.decision is Decision.REPLACE
    assert nxt.plan.members == expect and nxt.plan.generation == 1 and nxt.plan.progress == 7
    assert nxt.plan.replaced == {r: w for w, r in dead}
    assert set(nxt.taken) == {expect[r] for _, r in dead}
    assert nxt.plan.t_fail == min(10.0 + r for _, r in dead)


@pytest.mark.parametrize("members, dead, min_world, expect, why", [
    ("a b c d", [("c", 2)], 1, {0: "a", 1: "b", 2: "d"}, None),
    ("a b c d", [("a", 0), ("d", 3)], 2, {0: "b", 1: "c"}, None),
    ("a b", [("b", 1)], None, None, "no spare is left; rerun with more --spares, or let the "
                                    "job shrink with --min-nproc"),
    ("a b", [("b", 1)], 2, None, "only 1 ranks would be left, below --min-nproc 2"),
])
def test_without_spares_the_job_shrinks_or_stops(members, dead, min_world, expect, why):
    nxt = after_failures(plan(members), failed(*dead), [], min_world=min_world, progress=3,
                         previous_recovered=True)
    if expect is None:
        assert nxt.decision is Decision.STOP and nxt.plan is None
        assert why in nxt.reason and nxt.reason.startswith(f"worker {dead[0][0]} (rank")
        return
    assert nxt.decision is Decision.SHRINK
    assert nxt.plan.members == expect and nxt.plan.replaced == {r: w for w, r in dead}
    assert nxt.plan.reason.startswith("shrink: ")


def test_spares_running_out_midway_shrink_with_every_failure():
    nxt = after_failures(plan("a b c d"), failed(("b", 1), ("c", 2)), spares(("s", 0)),
                         min_world=1, progress=3, previous_recovered=True)
    assert nxt.decision is Decision.SHRINK and nxt.plan.members == {0: "a", 1: "d"}


def test_an_unfinished_recovery_is_folded_into_the_next():
    prev = plan("a s c", gen=1, replaced={1: "b"}, t_fail=1.0, t_detect=2.0)
    nxt = after_failures(prev, failed(("c", 2)), spares(("t", 0)), min_world=None,
                         progress=5, previous_recovered=False)
    assert nxt.plan.replaced == {1: "b", 2: "c"} and (nxt.plan.t_fail, nxt.plan.t_detect) == (1.0, 2.0)
    done = after_failures(prev, failed(("c", 2)), spares(("t", 0)), min_world=None,
                          progress=5, previous_recovered=True)
    assert done.plan.replaced == {2: "c"}


@pytest.mark.parametrize("members, live, target, expect", [
    ("a b", [("s", 0)], 3, {0: "a", 1: "b", 2: "s"}),
    ("a", [("t", 0), ("s", 1), ("u", 0)], 3, {0: "a", 1: "s", 2: "t"}),
    ("a b c", [("s", 0)], 3, None),  # at full strength
    ("a b", [], 3, None),  # nobody to admit
])
def test_grow_admits_spares_up_to_the_starting_size(members, live, target, expect):
    nxt = grow(plan(members), spares(*live), target_world=target, progress=9)
    if expect is None:
        assert nxt is None
        return
    assert nxt.decision is Decision.GROW and nxt.plan.members == expect
    assert nxt.plan.reason == "grow" and nxt.plan.progress == 9


@pytest.mark.parametrize("dead, live, expect", [
    # replica groups of 2 (HSDP): a dead rank with no spare takes its live partner along
    ([("d", 3)], [], {0: "a", 1: "b", 2: "e", 3: "f"}),
    ([("a", 0)], [], {0: "c", 1: "d", 2: "e", 3: "f"}),
    ([("a", 0), ("b", 1)], [], {0: "c", 1: "d", 2: "e", 3: "f"}),
    ([("b", 1), ("e", 4)], [], {0: "c", 1: "d"}),
    # spares first: a dead rank is replaced inside its group
    ([("d", 3)], [("s", 0)], {0: "a", 1: "b", 2: "c", 3: "s", 4: "e", 5: "f"}),
    # too few spares for every dead rank: the groups leave, no spare is taken
    ([("c", 2), ("d", 3)], [("s", 0)], {0: "a", 1: "b", 2: "e", 3: "f"}),
])
def test_replica_groups_leave_whole_when_no_spare_is_left(dead, live, expect):
    nxt = after_failures(plan("a b c d e f"), failed(*dead), spares(*live), min_world=2,
                         progress=3, previous_recovered=True, unit=2)
    assert nxt.plan.members == expect
    if len(expect) < 6:
        assert nxt.decision is Decision.SHRINK and nxt.taken == ()
        assert "replica group" in nxt.plan.reason


@pytest.mark.parametrize("live, expect", [
    ([("s", 0)], None),  # one spare cannot make a group of 2
    ([("s", 0), ("t", 0)], {0: "a", 1: "b", 2: "s", 3: "t"}),
    ([("s", 0), ("t", 0), ("u", 0)], {0: "a", 1: "b", 2: "s", 3: "t"}),
])
def test_grow_admits_whole_replica_groups(live, expect):
    nxt = grow(plan("a b"), spares(*live), target_world=6, progress=9, unit=2)
    assert (nxt.plan.members if nxt else None) == expect


def slow(rank: int, wid: str, gen: int = 0) -> StragglerReport:
    return StragglerReport(rank=rank, wid=wid, gen=gen, step=30, ratio=2.6, window=20)


@pytest.mark.parametrize("members, nodes, report, live, expect", [
    # a spare on the straggler's node first, else the lowest-named one
    ("a b c", "0 1 1", slow(1, "b"), [("s0", 0), ("s1", 1)], {0: "a", 1: "s1", 2: "c"}),
    ("a b", "0 0", slow(0, "a"), [("z", 1), ("y", 1)], {0: "y", 1: "b"}),
])
def test_a_straggler_swaps_with_a_spare(members, nodes, report, live, expect):
    nxt = swap_straggler(plan(members, nodes), report, spares(*live), progress=30)
    assert nxt.decision is Decision.SWAP and nxt.plan.members == expect
    assert nxt.plan.generation == 1 and nxt.plan.progress == 30
    assert nxt.plan.replaced == {report.rank: report.wid}
    assert nxt.taken == (expect[report.rank],)
    assert nxt.plan.reason == (f"straggler: {report.wid} (rank {report.rank}) computed 2.6x "
                               "the other ranks' median over 20 steps")


def test_a_straggler_stays_without_a_spare_and_a_stale_report_is_passed_over():
    nxt = swap_straggler(plan("a b"), slow(1, "b"), [], progress=3)
    assert nxt.decision is Decision.KEEP and nxt.reason == "no spare to swap it for"
    assert swap_straggler(plan("a c"), slow(1, "b"), spares(("s", 0)), progress=3) is None
    assert swap_straggler(plan("a b", gen=2), slow(1, "b", gen=1), spares(("s", 0)),
                          progress=3) is None


def test_a_straggler_report_goes_through_the_store_typed_and_a_malformed_one_is_named():
    r = slow(1, "b")
    assert StragglerReport.from_dict(r.to_dict()) == r
    for bad, says in [([], "a JSON object"), ({**r.to_dict(), "extra": 1}, "the fields"),
                      ({k: v for k, v in r.to_dict().items() if k != "wid"}, "the fields"),
                      ({**r.to_dict(), "rank": "1"}, "wrong types")]:
        with pytest.raises(ValueError, match=says):
            StragglerReport.from_dict(bad)

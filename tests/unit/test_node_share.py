"""A node's share of the control plane: plans relayed once a node into its shared memory
(`cluster/node_plans.py`) and the node's members' acknowledgements and restore sources
told the store once a node (`cluster/node_tally.py`). Real processes, a real TCPStore."""

from __future__ import annotations

import multiprocessing as mp
import shutil

import pytest

from phoenixft.bench.hollow import CountingStore
from phoenixft.checkpoint.snapshot import acknowledge
from phoenixft.cluster import protocol
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan, PlanKind
from phoenixft.cluster.node_plans import NodePlans, PlanRelay
from phoenixft.cluster.node_tally import NodeShare, NodeTally

pytestmark = pytest.mark.timeout(60)


def _offer(args):
    directory, i, expected = args
    return NodeTally(directory).offer("t", f"{i} x", expected)


def test_the_last_of_a_nodes_offers_gets_every_line_and_only_it(tmp_path):
    with mp.get_context("spawn").Pool(4) as pool:
        got = pool.map(_offer, [(tmp_path, i, 8) for i in range(8)])
    complete = [g for g in got if g is not None]
    assert len(complete) == 1
    assert sorted(complete[0]) == sorted(f"{i} x" for i in range(8))
    assert not (tmp_path / "t").exists()  # the completing offer removed the tally
    with pytest.raises(ValueError, match="one line"):
        NodeTally(tmp_path).offer("t", "a\nb", 2)


def test_a_tally_with_more_offers_than_places_is_an_error(tmp_path):
    t = NodeTally(tmp_path)
    (tmp_path / "t").write_text("a\nb\n")
    with pytest.raises(RuntimeError, match="3 offers, 2 expected"):
        t.offer("t", "c", 2)


@pytest.fixture()
def store():
    server, port = kv.host_store("127.0.0.1")
    yield f"127.0.0.1:{port}"
    del server


def _plan(g: int, n: int = 16, **kw) -> Plan:
    return Plan(generation=g, members={r: f"n{r // 4}w{r % 4}" for r in range(n)},
                nodes={r: r // 4 for r in range(n)}, **kw)


def _publish(store, plan: Plan, before: Plan | None) -> None:
    if before is None:
        store.set(Keys.plan(plan.generation), plan.to_json())
    else:
        store.multi_set([Keys.plan_change(plan.generation), Keys.plan(plan.generation)],
                        [plan.change_from(before), plan.to_json()])


def test_the_relay_hands_every_plan_over_in_order_reading_one_change_each(store, tmp_path):
    leader = kv.connect(store)
    plans = NodePlans(tmp_path / "plans")
    counted: list[CountingStore] = []

    def connect():
        counted.append(CountingStore(kv.connect(store)))
        return counted[-1]

    relay = PlanRelay(connect, plans).start()
    try:
        p0 = _plan(0)
        _publish(leader, p0, None)
        assert plans.wait(0, 30)
        p1 = _plan(1, replaced={5: "n1w1"})
        p1.members[5] = "n1w4"
        p2 = _plan(2, reason="grow")
        _publish(leader, p1, p0)  # two plans at once: neither is skipped
        _publish(leader, p2, p1)
        assert plans.wait(2, 30)
        assert plans.read(0) == p0 and plans.read(1) == p1 and plans.read(2) == p2
        assert plans.newest(0) == p2 and plans.newest(1, known=p2) is p2
        # every plan after the first is read as its change: one get each
        assert counted[0].ops["get"] == 3 and counted[0].bytes < 3 * len(p0.to_json()) + 2000
        done = Plan(generation=3, kind=PlanKind.DONE, reason="all ranks finished")
        _publish(leader, done, p2)
        assert plans.wait(3, 30) and plans.read(3).kind is PlanKind.DONE
        relay._thread.join(10)
        assert not relay._thread.is_alive() and relay.latest.kind is PlanKind.DONE
    finally:
        relay.stop()
    assert not plans.wait(4, 0.05)  # nothing after the job's last plan


def test_a_nodes_members_acknowledge_and_record_sources_in_one_request(store, tmp_path):
    """Three nodes of two ranks: each step's six copies reach the store in three adds,
    and the step commits; the sources of the node holding the replaced rank and of rank
    0's node are one key each; the third node records none (nobody reads it)."""
    nodes = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    plan = Plan(generation=1, members={r: f"n{k}w{r % 2}" for r, k in nodes.items()},
                nodes=nodes, replaced={2: "n1w9"})
    share = {r: NodeShare.of(tmp_path / f"n{nodes[r]}", nodes, r) for r in nodes}
    s = CountingStore(kv.connect(store))
    done = [acknowledge(s, 1, 7, 1, 6, 6, share[r]) for r in range(6)]
    assert done == [False] * 5 + [True] and s.ops["add"] == 3
    assert s.check([Keys.commit(7)])
    for r in range(6):
        protocol.joined(s, plan, r, "peer" if r == 2 else "local", share[r])
    assert s.ops["set"] == 2  # one a node read
    assert protocol.restore_sources(s, 1, 1) == {2: "peer", 3: "local"}
    assert protocol.restore_sources(s, 1, 0) == {0: "local", 1: "local"}
    assert protocol.restore_sources(s, 1, 2) is None
    assert not list((tmp_path / "n2" / "tally").glob("src-*"))  # nor offered there
    for sh in share.values():
        sh.close()


def test_acknowledgements_survive_their_directory_being_deleted(tmp_path):
    """Two members of a node opened generation 3's tally; the node's shared memory is
    deleted between their offers of a step (a clean-up gone wrong): the second offer
    still completes the step, and the next step's round starts empty."""
    nodes = {0: 0, 1: 0}
    a, b = (NodeShare.of(tmp_path / "shm", nodes, r) for r in (0, 1))
    for sh in (a, b):
        sh.open_acks(3)
    assert a.offer_ack(3, 10, 2) is None
    shutil.rmtree(tmp_path / "shm")
    assert sorted(b.offer_ack(3, 10, 1)) == [1, 2] and b.completed == "ack-3-10"
    assert a.offer_ack(3, 11, 2) is None and a.completed is None
    assert sorted(b.offer_ack(3, 11, 2)) == [2, 2]
    with pytest.raises(RuntimeError, match="another step"):
        a.offer_ack(3, 12, 1)
        b.offer_ack(3, 13, 1)
    b.mark("commit-3", 11)  # (recreates the directory) a mark: best effort
    assert a.marked("commit-3", 11) and not a.marked("commit-3", 13)
    a.close()
    b.close()

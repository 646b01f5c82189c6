"""Snapshots, replicas, commit and the restore planner, with threads as ranks over real
gloo groups and a real TCPStore (the processes are not the point here)."""

from __future__ import annotations

import shutil
from datetime import timedelta

import pytest
import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.record import Snapshot, SnapshotHeader
from phoenixft.checkpoint.restore import RestorePlanner
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, slot_path
from phoenixft.checkpoint.snapshot import Snapshotter, acknowledge
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import replica_holders
from phoenixft.cluster.node_tally import NodeShare
from phoenixft.comm.collectives import CommFailure, GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from tests.support.threads import ranks


@pytest.fixture()
def store_addr():
    server, port = kv.host_store("127.0.0.1")
    yield f"127.0.0.1:{port}"
    del server


def state(rank, step):
    g = torch.Generator().manual_seed(rank * 100 + step)
    return {"param_shard": torch.randn(1000, generator=g), "opt.exp_avg": torch.randn(1000, generator=g)}


def snapshot_steps(addr, shm, steps, gen=0, nodes=None, garble=None, degraded=None):
    nodes = nodes or {0: 0, 1: 1}
    holders = replica_holders(nodes, 1)

    def rank(r):
        it = Interrupt()
        it.enter(gen)
        pg = new_group(kv.connect(addr), f"g{gen}/rep/", r, 2, device=torch.device("cpu"))
        snap = Snapshotter(shm_dir=shm[r], rank=r, generation=gen, connect=lambda: kv.connect(addr),
                           rep_pg=pg, holders=holders[r],
                           sources=[s for s, hs in holders.items() if r in hs], world_size=2,
                           nodes=nodes, interrupt=it, timeout_s=30,
                           garble=(lambda step: garble == (r, step)),
                           on_degraded=degraded.append if degraded is not None else None)
        for s in steps:
            snap.begin(s, Snapshot(SnapshotHeader(rank=r, world_size=2), state(r, s)))
            snap.wait_copied()
        store = kv.connect(addr)
        store.wait([Keys.commit(steps[-1])], timedelta(seconds=30))
        snap.stop()
        return int(store.get(Keys.COMMITTED))

    return ranks(rank)


def restore(addr, shm, step, prefix):
    def rank(r):
        it = Interrupt()
        it.enter(9)
        pg = new_group(kv.connect(addr), prefix, r, 2, device=torch.device("cpu"))
        snap, source = RestorePlanner.for_node(shm[r]).restore(
            GroupOps(pg, it, 30), rank=r, world_size=2, step=step)
        t = snap.tensors
        assert torch.equal(t["param_shard"], state(r, step)["param_shard"])
        return source

    return ranks(rank)


def test_commit_needs_every_copy_and_replica(tmp_path, store_addr):
    shm = [tmp_path / "node0", tmp_path / "node1"]
    assert snapshot_steps(store_addr, shm, [0, 1, 2]) == [2, 2]
    for r in range(2):  # own slot on its node, replica on the other node
        assert slot_path(shm[r], "snap", r, 2).exists()
        assert slot_path(shm[1 - r], "rep", r, 2).exists()
    # double buffering: step 1 is still intact next to step 2
    assert restore(store_addr, shm, 1, "a/") == ["local_snapshot", "local_snapshot"]


def test_snapshots_with_gaps_commit_and_keep_the_previous_one_intact(tmp_path, store_addr):
    """A benchmark switches snapshots off for blocks of an even number of steps: the next
    snapshot waits for the last one taken (not for step - 1, which never comes), lands in
    the other slot, and both stay restorable."""
    shm = [tmp_path / "node0", tmp_path / "node1"]
    assert snapshot_steps(store_addr, shm, [0, 1, 4, 7]) == [7, 7]
    assert restore(store_addr, shm, 4, "gap/") == ["local_snapshot", "local_snapshot"]


def test_a_snapshot_that_would_overwrite_the_newest_committed_one_is_refused(tmp_path, store_addr):
    snap = Snapshotter(shm_dir=tmp_path, rank=0, generation=0,
                       connect=lambda: kv.connect(store_addr), rep_pg=None, holders=[],
                       sources=[], world_size=1, nodes={0: 0}, interrupt=Interrupt(), timeout_s=30)
    try:
        snap.begin(3, Snapshot(SnapshotHeader(rank=0, world_size=1), state(0, 3)))
        with pytest.raises(ValueError, match="slot 1"):
            snap.begin(5, Snapshot(SnapshotHeader(rank=0, world_size=1), state(0, 5)))
    finally:
        snap.stop()


def test_same_node_replicas_are_copied_through_shared_memory(tmp_path, store_addr):
    shm = [tmp_path / "node0", tmp_path / "node0"]
    assert snapshot_steps(store_addr, shm, [0, 1, 2], nodes={0: 0, 1: 0}) == [2, 2]
    for r in range(2):
        assert slot_path(shm[0], "rep", r, 2).exists()
        slot_path(shm[0], "snap", r, 2).unlink()  # own copies gone: the replicas serve
    assert restore(store_addr, shm, 2, "s/") == ["local_replica", "local_replica"]


def test_a_same_node_copy_damaged_in_the_copy_is_rejected_and_the_step_still_commits(
        tmp_path, store_addr):
    """`--replicas 1` on one node: rank 0's copy of rank 1's snapshot 1 goes wrong (a
    damaged read) while rank 1's own slot is whole. The copy is rejected as a replica
    damaged in transit is: named, never loaded, and the step commits without it (before,
    it was not acknowledged and the commit waited out its deadline)."""
    shm = [tmp_path / "node0", tmp_path / "node0"]
    degraded: list[str] = []
    assert snapshot_steps(store_addr, shm, [0, 1, 2], nodes={0: 0, 1: 0}, garble=(0, 1),
                          degraded=degraded) == [2, 2]
    assert len(degraded) == 1 and "rank 1's snapshot 1 was damaged in the copy" in degraded[0]
    slot_path(shm[0], "snap", 1, 1).unlink()  # rank 1's own copy gone: only the rejected one
    seen: list[tuple[str, str]] = []
    planner = RestorePlanner.for_node(shm[0], report=lambda tier, error: seen.append((tier, error)))
    assert planner.local_copy(1, 1) is None and planner.local_copy(1, 2) is not None
    assert seen and seen[0][0] == "local_replica" and "marked rejected" in seen[0][1], seen


def test_a_same_node_peer_whose_own_snapshot_is_damaged_gets_no_acknowledgement(tmp_path,
                                                                                store_addr):
    """Rank 0's own snapshot 1 is damaged in shared memory after it was written, before its
    holder copies it (the `rot` fault): no intact copy of step 1 exists on the node, so the
    holder does not acknowledge its copy and reports rank 0 (for the leader to replace it),
    step 1 never commits (here, with no leader, the snapshot threads give up at their
    deadline) and step 0, in the other slot, stays the newest committed step."""
    nodes = {0: 0, 1: 0}
    holders = replica_holders(nodes, 1)
    degraded: list[str] = []
    reported: list[tuple[int, str]] = []

    def rank(r):
        it = Interrupt()
        it.enter(0)
        snap = Snapshotter(shm_dir=tmp_path, rank=r, generation=0,
                           connect=lambda: kv.connect(store_addr), rep_pg=None,
                           holders=holders[r], sources=[s for s, hs in holders.items() if r in hs],
                           world_size=2, nodes=nodes, interrupt=it, timeout_s=3,
                           on_degraded=degraded.append,
                           on_damaged_source=lambda src, why: reported.append((src, why)),
                           rot=lambda step: (r, step) == (0, 1))
        try:
            snap.begin(0, Snapshot(SnapshotHeader(rank=r, world_size=2), state(r, 0)))
            snap.wait_copied(committed=True)
            snap.begin(1, Snapshot(SnapshotHeader(rank=r, world_size=2), state(r, 1)))
            with pytest.raises(CommFailure, match="commit/1 not set within 3"):
                snap.wait_copied(committed=True)
        finally:
            snap.stop()

    ranks(rank)
    assert int(kv.connect(store_addr).get(Keys.COMMITTED)) == 0
    assert len(degraded) == 1 and "rank 0's own snapshot 1 is damaged in shared memory" in \
        degraded[0], degraded
    assert reported == [(0, degraded[0])]


def test_a_same_node_peer_slot_with_a_damaged_header_gets_no_acknowledgement(tmp_path,
                                                                             store_addr):
    """Damage in the slot's header (its length field) is the peer's snapshot damaged too,
    not a missing file: not acknowledged, reported (before, it counted as "no replica" and
    the step committed without any intact copy of rank 0's state)."""
    from phoenixft.checkpoint.slots import SlotFile

    nodes = {0: 0, 1: 0}
    holders = replica_holders(nodes, 1)
    reported: list[int] = []
    it = Interrupt()
    it.enter(0)
    own = SlotFile(slot_path(tmp_path, "snap", 0, 1))
    t = state(0, 1)
    lay = Layout.of(t)
    own.ensure(HEADER_BYTES + lay.data_nbytes)
    own.begin_write(1)
    own.finish_write(1, lay, SnapshotHeader(rank=0, generation=0), own.write_data(lay, t, lambda: None))
    own.np[24:32] = 0xFF  # the header's length: unreadable
    snap = Snapshotter(shm_dir=tmp_path, rank=1, generation=0,
                       connect=lambda: kv.connect(store_addr), rep_pg=None, holders=holders[1],
                       sources=[0], world_size=2, nodes=nodes, interrupt=it, timeout_s=3,
                       on_damaged_source=lambda src, why: reported.append(src))
    try:
        assert snap._copy_local_replica(0, 1) is False and reported == [0]
        slot_path(tmp_path, "snap", 0, 1).unlink()  # a file that is gone: no replica, ack
        assert snap._copy_local_replica(0, 1) is True and reported == [0]
    finally:
        snap.stop()


def test_restore_falls_back_to_replica_then_peer_then_fails_clearly(tmp_path, store_addr):
    shm = [tmp_path / "node0", tmp_path / "node1"]
    snapshot_steps(store_addr, shm, [0, 1])
    # node 1 lost whole; its rank restarts beside the replica holder on node 0
    shutil.rmtree(shm[1])
    assert restore(store_addr, [shm[0], shm[0]], 1, "b/") == ["local_snapshot", "local_replica"]
    # ... or on a fresh node: the holder sends the replica over the group
    fresh = tmp_path / "node2"
    assert restore(store_addr, [shm[0], fresh], 1, "c/") == ["local_snapshot", "peer_memory"]
    # corrupt the last copy: a clear error, never a silent load
    rep = slot_path(shm[0], "rep", 1, 1)
    data = bytearray(rep.read_bytes())
    data[-10] ^= 0xFF
    rep.write_bytes(bytes(data))
    shutil.rmtree(fresh)
    with pytest.raises(IntegrityError, match="no surviving copy of rank 1's snapshot for step 1"):
        restore(store_addr, [shm[0], fresh], 1, "d/")


def test_a_replica_that_arrives_damaged_is_rejected_and_the_step_still_commits(tmp_path,
                                                                              store_addr):
    """Rank 1's replica of snapshot 1 arrives damaged on node 0: the job does not stop
    (the commit goes on without that copy), the damage is named, and the copy is marked
    rejected so that a restore passes over it, saying why, and never loads it."""
    shm = [tmp_path / "node0", tmp_path / "node1"]
    degraded: list[str] = []
    assert snapshot_steps(store_addr, shm, [0, 1, 2], garble=(0, 1), degraded=degraded) == [2, 2]
    assert len(degraded) == 1 and "rank 1's snapshot 1 arrived damaged" in degraded[0], degraded
    shutil.rmtree(shm[1])  # node 1 lost: the rejected replica was rank 1's only other copy
    seen: list[tuple[str, str]] = []
    planner = RestorePlanner.for_node(shm[0], report=lambda tier, error: seen.append((tier, error)))
    assert planner.local_copy(1, 1) is None and planner.local_copy(1, 2) is not None
    assert seen and seen[0][0] == "local_replica" and "marked rejected" in seen[0][1], seen
    with pytest.raises(IntegrityError, match="no surviving copy of rank 1's snapshot for step 1"):
        restore(store_addr, [shm[0], shm[0]], 1, "e/")


def test_replicas_damaged_again_and_again_stop_the_job_naming_the_link(tmp_path, store_addr):
    """A damaged arrival now and then is passed over; three in a row from one rank are a
    faulty link or memory, and the job must not run on without its off-node copies."""
    from phoenixft.checkpoint.slots import Layout, SlotFile

    degraded: list[str] = []
    snap = Snapshotter(shm_dir=tmp_path, rank=0, generation=0,
                       connect=lambda: kv.connect(store_addr), rep_pg=None, holders=[],
                       sources=[], world_size=1, nodes={0: 0}, interrupt=Interrupt(),
                       timeout_s=30, on_degraded=degraded.append)

    def arrival(step, damaged):
        f = SlotFile(tmp_path / f"rep.{step}")
        t = state(1, step)
        lay = Layout.of(t)
        f.ensure(HEADER_BYTES + lay.data_nbytes)
        f.begin_write(step)
        f.finish_write(step, lay, SnapshotHeader(rank=1), f.write_data(lay, t, lambda: None))
        if damaged:
            f.np[HEADER_BYTES + 7] ^= 0xFF
        return f

    try:
        for step, damaged in enumerate([True, True, False, True, True]):
            assert snap._check_replica(1, arrival(step, damaged), step)
        assert len(degraded) == 4
        with pytest.raises(IntegrityError, match="rank 1's replicas arrived damaged 3 times in a "
                                                 "row on rank 0 .* network path or the memory"):
            snap._check_replica(1, arrival(5, True), 5)
    finally:
        snap.stop()


def test_a_begun_snapshot_is_kept_in_host_memory_when_the_generation_changes(tmp_path, store_addr):
    """Rank 0 of two (the other rank acks through the store by hand). Snapshot 2 is begun
    after the generation changed, as when the failure came before the thread got to it: it
    is still copied, without acks, because its slot held snapshot 0, older than the last
    commit (1). Snapshot 3, whose slot holds 1 while 2 never committed, is not: 1 must stay
    intact."""
    store = kv.connect(store_addr)
    it = Interrupt()
    it.enter(0)
    snap = Snapshotter(shm_dir=tmp_path, rank=0, generation=0,
                       connect=lambda: kv.connect(store_addr), rep_pg=None, holders=[],
                       sources=[], world_size=2, nodes={0: 0, 1: 0}, interrupt=it, timeout_s=30)
    hdr = SnapshotHeader(rank=0, world_size=2)
    try:
        for step in (0, 1):
            snap.begin(step, Snapshot(hdr, state(0, step)))
            snap.wait_copied()
            # the other rank of the node acknowledges its copy (through the node's tally)
            acknowledge(store, 0, step, 1, 2, 2, NodeShare.of(tmp_path, {0: 0, 1: 0}, 1))
            snap.wait_copied(committed=True)
        it.announce(1)  # a failure: generation 1 is published
        snap.begin(2, Snapshot(hdr, state(0, 2)))
        snap.begin(3, Snapshot(hdr, state(0, 3)))
    finally:
        snap.stop()
    planner = RestorePlanner.for_node(tmp_path)
    found = planner.local_copy(0, 2)
    assert found is not None and torch.equal(found[0].tensors(found[0].verify(2))["param_shard"],
                                             state(0, 2)["param_shard"])
    assert int(store.add(Keys.ack(0, 2), 0)) == 0  # nothing acknowledged for it
    assert not list((tmp_path / "tally").glob("ack-0-2-*"))  # nor offered on the node
    assert planner.local_copy(0, 1) is not None  # 3 was not written over it
    assert planner.local_copy(0, 3) is None


class _Waits:
    """A store connection that notes which commit keys it waited for (and for whom)."""

    def __init__(self, inner, rank: int, seen: list) -> None:
        self._s, self._rank, self._seen = inner, rank, seen

    def wait(self, keys, *timeout):
        self._seen.extend((self._rank, k) for k in keys if k.startswith("commit/"))
        return self._s.wait(keys, *timeout)

    def __getattr__(self, name):
        return getattr(self._s, name)


def test_a_node_waits_for_each_commit_on_the_store_once(tmp_path, store_addr):
    """Ranks 0, 1 and 2 on node 0, rank 3 on node 1, four steps: every step commits, and
    of node 0's three ranks at most one waits on the store for a step's commit (the one
    whose offer completed the node's acknowledgement); the others take the node's mark.
    (Each waiting for itself, at least two of them would: only one add commits.)"""
    nodes = {0: 0, 1: 0, 2: 0, 3: 1}
    seen: list[tuple[int, str]] = []

    def rank(r):
        it = Interrupt()
        it.enter(0)
        snap = Snapshotter(shm_dir=tmp_path / f"node{nodes[r]}", rank=r, generation=0,
                           connect=lambda: _Waits(kv.connect(store_addr), r, seen), rep_pg=None,
                           holders=[], sources=[], world_size=4, nodes=nodes, interrupt=it,
                           timeout_s=30)
        try:
            for s in range(4):
                snap.begin(s, Snapshot(SnapshotHeader(rank=r, world_size=4), state(r, s)))
                snap.wait_copied(committed=True)
        finally:
            snap.stop()

    ranks(rank, 4)
    store = kv.connect(store_addr)
    assert int(store.get(Keys.COMMITTED)) == 3
    for s in range(4):
        waiters = {r for r, k in seen if k == Keys.commit(s)}
        assert len(waiters & {0, 1, 2}) <= 1, (s, waiters)


def test_a_retracted_commit_is_never_made_again_by_a_late_acknowledgement(store_addr):
    """A rollback (`fingerprints._roll_back`) takes back snapshot 5's commit: `committed`
    returns to 4 and 5's marker is gone, whether 5 had committed already or its last
    acknowledgements were still on their way (then they never commit it: the count is
    poisoned, and nothing waits for them)."""
    from phoenixft.checkpoint.snapshot import mark_committed, retract_commit

    store = kv.connect(store_addr)
    mark_committed(store, 4, {"generation": 0, "world_size": 2})
    # 5 committed (2 of 2 acknowledged), then taken back
    assert not acknowledge(store, 0, 5, 1, 2, 2) and acknowledge(store, 0, 5, 1, 2, 2)
    assert kv.get_int(store, Keys.COMMITTED, -1) == 5
    retract_commit(store, 0, 5, 4, target=2, timeout_s=5)
    assert kv.get_int(store, Keys.COMMITTED, -1) == 4 and not store.check([Keys.commit(5)])
    assert store.check([Keys.commit(4)])
    # 6 half acknowledged, taken back: its last acknowledgement comes later and commits nothing
    assert not acknowledge(store, 0, 6, 1, 2, 2)
    retract_commit(store, 0, 6, 4, target=2, timeout_s=5)
    assert not acknowledge(store, 0, 6, 1, 2, 2)
    assert kv.get_int(store, Keys.COMMITTED, -1) == 4 and not store.check([Keys.commit(6)])

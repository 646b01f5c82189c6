"""The leader's side of the two-level heartbeats, on a real (in-memory) store: an agent's
hang report fences the worker and gives its rank to a spare; a node whose agent stops
beating loses every live worker it had; a hang before the job starts stops it, named."""

from __future__ import annotations

import time as _time

import torch

from phoenixft.cluster import protocol
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.cluster.leader import Leader, LeaderConfig
from phoenixft.cluster.membership import Plan, PlanKind
from phoenixft.config import Timeouts
from phoenixft.observe.events import EventLog


def _job(tmp_path):
    store = torch.distributed.HashStore()
    protocol.register_node(store, 0, nproc=2, spares=1, pid=1)
    for w in ("n0w0", "n0w1", "n0w2"):
        protocol.register_worker(store, w, 0, pid=2)
    leader = Leader(store, EventLog(tmp_path / "events.jsonl"), tmp_path,
                    LeaderConfig(timeouts=Timeouts(heartbeat_interval_s=0.2,
                                                   heartbeat_timeout_s=1.0)))
    return store, leader


def _plan(store, g: int) -> Plan:
    return Plan.from_json(store.get(Keys.plan(g)))


def test_a_hang_report_fences_the_worker_and_a_spare_takes_its_rank(tmp_path):
    store, leader = _job(tmp_path)
    assert leader.try_start()
    assert _plan(store, 0).members == {0: "n0w0", 1: "n0w1"}
    protocol.file_report(store, {"kind": ReportKind.HANG, "wid": "n0w1",
                                 "t": _time.time() - 1.0, "detail": "heartbeat silent (hung)"})
    leader.tick()
    p = _plan(store, 1)
    assert p.members == {0: "n0w0", 1: "n0w2"} and p.replaced == {1: "n0w1"}
    assert store.check([Keys.fence("n0w1")]) and store.add(Keys.fences(0), 0) == 1
    assert [f.kind for f in leader.failures] == ["hang"]
    assert leader.failures[0].t_detect - leader.failures[0].t_fail >= 1.0


def test_a_silent_node_loses_every_live_worker(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    store, leader = _job(tmp_path)
    assert leader.try_start()
    for _ in range(3):  # the node beats, then its agent falls silent
        store.add(Keys.node_beat(0), 1)
        leader.tick()
        clock[0] += 0.3
    assert not leader.failures
    for _ in range(6):
        leader.tick()
        clock[0] += 0.3
    assert sorted(f.wid for f in leader.failures) == ["n0w0", "n0w1", "n0w2"]
    assert all(f.kind == "hang" and "node 0" in f.detail for f in leader.failures)
    assert all(store.check([Keys.fence(w)]) for w in ("n0w0", "n0w1", "n0w2"))
    assert leader.plan.kind is PlanKind.ABORT  # no spare left, no --min-nproc


def test_a_hang_before_the_start_stops_the_job_by_name(tmp_path):
    store, leader = _job(tmp_path)
    protocol.file_report(store, {"kind": ReportKind.HANG, "wid": "n0w2",
                                 "detail": "heartbeat silent (hung)"})
    assert not leader.try_start()
    assert leader.plan.kind is PlanKind.ABORT
    assert "n0w2 hung during start-up" in leader.fatal


def test_detection_time_is_never_negative():
    """t_fail and t_detect come from two processes' clocks: an exit seen within a
    millisecond once printed "detected in -0 ms"."""
    from phoenixft.cluster.leader import Failure
    assert Failure("n0w1", 1, "exit", "killed", t_fail=10.0003, t_detect=10.0).detect_s == 0.0
    assert Failure("n0w1", 1, "exit", "killed", t_fail=10.0, t_detect=10.25).detect_s == 0.25

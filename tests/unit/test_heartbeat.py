"""The heartbeat monitor, the workers' counters in shared memory and the agents' in the store."""

from __future__ import annotations

import time as _time

import torch

from phoenixft.cluster.heartbeat import (
    HeartbeatMonitor,
    HeartbeatSender,
    NodeLiveness,
    beats_dir,
    file_counters,
    node_counters,
)
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.config import Timeouts


def test_heartbeat_monitor_does_not_count_its_own_stall(monkeypatch):
    store = torch.distributed.HashStore()
    clock = [100.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    mon = HeartbeatMonitor(node_counters(store), stall_s=1.0)
    store.add(Keys.node_beat(0), 1)
    store.add(Keys.node_beat(1), 1)
    mon.watch("0")
    mon.watch("1")
    mon.poll()
    clock[0] += 0.5
    store.add(Keys.node_beat(0), 1)  # node 0 beats, node 1 goes quiet
    mon.poll()
    clock[0] += 0.5
    mon.poll()
    clock[0] += 10.0  # the monitor itself was starved for 10 s
    mon.poll()
    assert mon.stale(3.0) == []
    for _ in range(8):  # then node 1 stays silent while the monitor runs normally
        clock[0] += 0.5
        store.add(Keys.node_beat(0), 1)
        mon.poll()
    assert mon.stale(3.0) == ["1"]


def test_monitor_reads_at_most_once_a_period(monkeypatch):
    reads = []
    clock = [100.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    mon = HeartbeatMonitor(lambda ids: reads.append(ids) or {}, every_s=0.2)
    mon.watch("a")
    for _ in range(10):  # a 20 ms tick for 0.2 s: one read, then the next period's
        mon.poll()
        clock[0] += 0.02
    assert len(reads) == 1
    clock[0] += 0.2
    mon.poll()
    assert len(reads) == 2


def test_workers_beat_in_files_their_agent_reads(tmp_path):
    hb = HeartbeatSender(beats_dir(tmp_path), ["w0", "w1"], interval_s=3600)
    read = file_counters(beats_dir(tmp_path))
    assert read(["w0", "w1", "w2"]) == {"w0": 1, "w1": 1}  # w2 has not started beating
    for c in hb._counters.values():  # what each pass of its thread does
        c.bump()
    assert read(["w0", "w1"]) == {"w0": 2, "w1": 2}


def test_an_agent_reports_a_silent_worker_once(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    store = torch.distributed.HashStore()
    live = NodeLiveness(3, tmp_path, Timeouts(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0))
    hb = HeartbeatSender(beats_dir(tmp_path), ["a", "b"], interval_s=3600)
    for _ in range(20):  # 2 s: a beats, b does not
        hb._counters["a"].bump()
        assert live.tick(store, ["a", "b", "c"]) in ([], ["b"])
        clock[0] += 0.1
    assert store.add(Keys.REPORTS, 0) == 1
    rep = store.get(Keys.report(1)).decode()
    assert ReportKind.HANG.value in rep and '"b"' in rep
    assert store.add(Keys.node_beat(3), 0) >= 6  # the node beat about once a period (0.2 s)
    for _ in range(20):
        hb._counters["a"].bump()
        live.tick(store, ["a", "b", "c"])
        clock[0] += 0.1
    assert store.add(Keys.REPORTS, 0) == 1  # reported once; c never beat: never watched

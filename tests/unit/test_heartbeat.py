"""The heartbeat monitor."""

from __future__ import annotations

import torch


def test_heartbeat_monitor_does_not_count_its_own_stall(monkeypatch):
    import time as _time

    from phoenixft.cluster.heartbeat import HeartbeatMonitor
    from phoenixft.cluster.keys import Keys

    store = torch.distributed.HashStore()
    clock = [100.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    mon = HeartbeatMonitor(store, stall_s=1.0)
    store.add(Keys.heartbeat("a"), 1)
    store.add(Keys.heartbeat("b"), 1)
    mon.watch("a")
    mon.watch("b")
    mon.poll()
    clock[0] += 0.5
    store.add(Keys.heartbeat("a"), 1)  # a beats, b goes quiet
    mon.poll()
    clock[0] += 0.5
    mon.poll()
    clock[0] += 10.0  # the monitor itself was starved for 10 s
    mon.poll()
    assert mon.stale(3.0) == []
    for _ in range(8):  # then b stays silent while the monitor runs normally
        clock[0] += 0.5
        store.add(Keys.heartbeat("a"), 1)
        mon.poll()
    assert mon.stale(3.0) == ["b"]

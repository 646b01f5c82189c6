"""The run directory's event log."""

from __future__ import annotations

import threading

from phoenixft.observe.events import EventLog, read_events


def test_event_log_lines_from_many_threads(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", who="t")
    threads = [threading.Thread(target=lambda i=i: [log.emit("x", i=i, j=j) for j in range(200)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"torn": ')  # a writer killed mid-line
    events = list(read_events(tmp_path / "events.jsonl"))
    assert len(events) == 800 and all(e["who"] == "t" for e in events)

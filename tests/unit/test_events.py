"""The run directory's event log and its atomically rewritten JSON files."""

from __future__ import annotations

import json
import threading

from phoenixft.observe.events import EventLog, read_events, write_json_atomic


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


def test_json_file_rewritten_by_many_threads_of_one_process(tmp_path):
    """The serving front rewrites status.json from two threads (failover, standby watcher):
    every rewrite must land whole, none may fail, the last one wins."""
    path, errors = tmp_path / "status.json", []

    def writer(i: int) -> None:
        try:
            for j in range(150):
                write_json_atomic(path, {"writer": i, "n": j, "pad": "x" * 4096})
        except OSError as exc:
            errors.append(exc)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["n"] == 149
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary left

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


def test_the_follower_reads_only_what_was_appended_and_waits_for_a_line_to_end(tmp_path):
    from phoenixft.observe.events import EventFollower

    p = tmp_path / "events.jsonl"
    f = EventFollower(p)
    assert f.poll() == []  # no log yet
    log = EventLog(p)
    log.emit("step", step=1)
    log.emit("step", step=2)
    assert [e["step"] for e in f.poll()] == [1, 2]
    assert f.poll() == []
    with p.open("a") as raw:
        raw.write('{"t": 1, "event": "step", "st')  # a line being written
    assert f.poll() == []
    with p.open("a") as raw:
        raw.write('ep": 3}\nnot json\n')  # its end, then a torn line from a killed writer
    assert [e["step"] for e in f.poll()] == [3]
    assert not f.restarted
    log.close()
    p.write_text("")  # a new job in the same directory: read from its start, say so
    EventLog(p).emit("step", step=1)
    assert [e["step"] for e in f.poll()] == [1] and f.restarted
    f.READ_BYTES = 7  # records that span reads
    log = EventLog(p)
    for i in range(2, 6):
        log.emit("step", step=i)
    assert [e["step"] for e in f.poll()] == [2, 3, 4, 5] and not f.restarted
    log.close()
    ino = p.stat().st_ino
    with p.open("w") as raw:  # rewritten in place (same inode), past the old position
        raw.writelines(json.dumps({"t": 2, "event": "step", "step": i}) + "\n" for i in range(9))
    assert p.stat().st_ino == ino
    assert [e["step"] for e in f.poll()] == list(range(9)) and f.restarted


def test_a_record_after_a_short_write_is_not_lost_with_it(tmp_path):
    """A write cut short by the file system (here RLIMIT_FSIZE, as a full disk would)
    leaves a torn line; the next record starts on a line of its own, so only the torn
    record is lost, not the one after it too. In a child process: the limit is its own."""
    import subprocess
    import sys

    path = tmp_path / "events.jsonl"
    code = f"""
import os, resource, signal
from phoenixft.observe.events import EventLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
log = EventLog({str(path)!r})
log.emit("a")
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize({str(path)!r}) + 10, resource.RLIM_INFINITY))
log.emit("b", pad="x" * 100)  # 10 bytes of it written
log.emit("c")  # nothing written
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
log.emit("d")
print(log.lost, log.failing)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "2" and "None" in r.stdout
    assert [e["event"] for e in read_events(path)] == ["a", "d"]

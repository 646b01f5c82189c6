"""`phoenixft status RUN_DIR --watch`: follow a running job from its run directory (its
status.json and event log), refreshed in place until the job ends."""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phoenixft.observe.events import EventFollower


class _Watched:
    """What the view shows of the event log, kept up to date from its new records."""

    def __init__(self, run_dir: Path) -> None:
        self.follower = EventFollower(run_dir / "events.jsonl")
        self._clear()

    def _clear(self) -> None:
        self.recent: collections.deque[float] = collections.deque()  # step times, last 10 s
        self.loss: float | None = None
        self.fails: collections.deque[dict] = collections.deque(maxlen=5)
        self.recs: collections.deque[dict] = collections.deque(maxlen=5)

    def update(self) -> None:
        new = self.follower.poll()
        if self.follower.restarted:  # a new job in this directory
            self._clear()
        for e in new:
            if e["event"] == "step":
                self.loss = e["loss"]
                self.recent.append(e["t"])
            elif e["event"] == "failure":
                self.fails.append(e)
            elif e["event"] == "recovered":
                self.recs.append(e)
        while self.recent and self.recent[0] < time.time() - 10:
            self.recent.popleft()


class NotAStatus(ValueError):
    """status.json holds JSON that is not a job's status."""


def _agents_alive(run_dir: Path) -> bool | None:
    """Whether a process still holds the run directory (an agent's `.lock.n<k>` names its
    PID, `rundir.py`); None when no lock file says (a job of an older phoenixft)."""
    locks = list(run_dir.glob(".lock.n*"))
    if not locks:
        return None
    for lock in locks:
        try:
            pid = int(lock.read_text().strip() or 0)
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError):
            continue
        # `phoenixft run ...` or `python -m phoenixft.cli run ...` (a reused PID is not)
        if pid and "run" in args and any(a.endswith("phoenixft") or a == "phoenixft.cli"
                                         for a in args):
            return True
    return False


def _view(run_dir: Path, seen: _Watched) -> tuple[Group, bool]:
    try:
        st = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return Group(Text(f"waiting for {run_dir / 'status.json'} ...")), False
    if not isinstance(st, dict) or not isinstance(st.get("members", []), list) or not all(
            isinstance(m, dict) for m in st.get("members", [])):
        raise NotAStatus(f"{run_dir / 'status.json'} is not a phoenixft job's status (a JSON "
                         "object with a list of members expected): is this a run directory?")
    seen.update()
    recent = seen.recent
    rate = ""
    if len(recent) >= 2:
        rate = f", {(len(recent) - 1) / (recent[-1] - recent[0]):.2f} steps/s"
    head = Text(f"generation {st.get('generation')} ({st.get('kind')}), world size "
                f"{st.get('world_size')}, step {st.get('step')} (committed "
                f"{st.get('committed_step')}){rate}, loss "
                f"{seen.loss:.4f}" if seen.loss is not None else "no step yet")
    members = Table("rank", "worker", "role", "state", "pid", "node")
    for m in st.get("members", []):
        members.add_row(str(m.get("rank")), m.get("wid", ""), m.get("role", ""),
                        m.get("state", ""), str(m.get("pid", "")), str(m.get("node", "")))
    last = Table("failures", "recoveries")
    last.add_row("\n".join(f"{f['wid']} rank {f.get('rank')}: {f.get('kind')} "
                           f"({f.get('detail', '')})" for f in seen.fails) or "-",
                 "\n".join(f"gen {r['gen']}: {r.get('recover_s', 0):.3f} s, from step "
                           f"{r.get('restore_step')}" for r in seen.recs) or "-")
    done = st.get("kind") in ("done", "abort")
    return Group(head, members, last), done


def _appeared(run_dir: Path, interval: float, wait_s: float) -> bool:
    """Wait up to `wait_s` for a job to write its status.json, saying so."""
    p = run_dir / "status.json"
    if p.exists():
        return True
    print(f"phoenixft status: no job in {run_dir} yet; waiting up to {wait_s:g} s for one to "
          "start there", file=sys.stderr, flush=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(min(interval, 0.5))  # polling a file another process writes
        if p.exists():
            return True
    print(f"phoenixft status: no job appeared in {run_dir} within {wait_s:g} s (no "
          "status.json); check the path, or pass --wait for longer", file=sys.stderr)
    return False


def watch(run_dir: Path, interval: float, wait_s: float = 60.0) -> int:
    if not _appeared(run_dir, interval, wait_s):
        return 2
    seen = _Watched(run_dir)
    try:
        view, done = _view(run_dir, seen)
        with Live(view, refresh_per_second=4) as live:
            while not done:
                time.sleep(interval)  # a display refresh, not synchronisation
                view, done = _view(run_dir, seen)
                live.update(view)
                if not done and _agents_alive(run_dir) is False:
                    view, done = _view(run_dir, seen)  # (it may have ended just now)
                    if not done:
                        live.update(view)
                        break
            else:
                return 0
    except NotAStatus as exc:
        print(f"phoenixft status: {exc}", file=sys.stderr)
        return 2
    print(f"phoenixft status: no agent holds {run_dir} any more (its .lock.n* names no "
          "running process) and the job never wrote its end: it died (killed, or its machine "
          "lost); the last state it wrote is shown above", file=sys.stderr)
    return 1

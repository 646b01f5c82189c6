"""A live terminal view of a run directory (rich): progress, members, failures.

It only reads what the run leaves behind (status.json, events.jsonl), so it can watch a
job started by anyone, and it never slows the job down.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from rich.console import Group
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from phoenixft.observe.events import EventFollower

_STATE_STYLE = {"running": "green", "waiting": "cyan", "dead": "red", "fenced": "red",
                "exited": "dim", "stopped": "dim", "starting": "yellow"}


class RunView:
    def __init__(self, run_dir: str | Path, total_steps: int, title: str) -> None:
        self.run_dir = Path(run_dir)
        self.total = total_steps
        self.title = title
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("step {task.completed}/{task.total}"),
                                 TextColumn("{task.fields[loss]}"), TimeElapsedColumn())
        self.task = self.progress.add_task(title, total=total_steps, loss="")
        self.follower = EventFollower(self.run_dir / "events.jsonl")
        self.loss = ""
        self.notable: collections.deque[str] = collections.deque(maxlen=8)

    def _status(self) -> dict:
        p = self.run_dir / "status.json"
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return {}

    def _read_new(self) -> None:
        """Take in the events logged since the last render (`EventFollower`)."""
        new = self.follower.poll()
        if self.follower.restarted:  # a new job in this directory
            self.loss = ""
            self.notable.clear()
        for e in new:
            ev = e["event"]
            if ev == "step":
                self.loss = f"loss {e['loss']:.4f}"
            elif ev == "inject":
                self.notable.append(f"[yellow]fault injected[/]: {e['spec']} (pid {e['pid']})")
            elif ev == "failure":
                self.notable.append(f"[red]failure detected[/]: {e['wid']} rank {e['rank']} "
                                    f"({e['detail']}) in {e['detect_s']:.3f}s")
            elif ev == "generation" and e["kind"] == "run" and e["gen"] > 0:
                self.notable.append(f"generation {e['gen']}: ranks {e['members']}")
            elif ev == "recovered":
                self.notable.append(f"[green]recovered[/] at step {e['restore_step']} in "
                                    f"{e['recover_s']:.3f}s (lost {e['lost_steps']} step)")
            elif ev == "abort":
                self.notable.append(f"[red]stopped[/]: {e['reason'].splitlines()[0]}")

    def render(self):
        st = self._status()
        step = st.get("step", 0)
        self._read_new()
        self.progress.update(self.task, completed=min(step, self.total), loss=self.loss)
        members = Table(box=None, show_header=True, header_style="bold")
        for col in ("rank", "role", "worker", "pid", "state"):
            members.add_column(col)
        for m in st.get("members", []):
            style = _STATE_STYLE.get(m["state"], "")
            members.add_row("-" if m["rank"] is None else str(m["rank"]), m["role"], m["wid"],
                            str(m["pid"]), f"[{style}]{m['state']}[/]")
        info = (f"generation {st.get('generation', '-')}   world size {st.get('world_size', '-')}"
                f"   committed snapshot: step {st.get('committed_step', '-')}")
        body = [self.progress, info, members]
        if self.notable:
            body.append(Panel("\n".join(self.notable), title="events", border_style="dim"))
        return Panel(Group(*body), title=self.title)

"""`phoenixft status RUN_DIR --watch`: follow a running job from its run directory (its
status.json and event log), refreshed in place until the job ends."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from phoenixft.observe.events import read_events


def _view(run_dir: Path) -> tuple[Group, bool]:
    try:
        st = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return Group(Text(f"waiting for {run_dir / 'status.json'} ...")), False
    events = list(read_events(run_dir / "events.jsonl"))
    steps = [e for e in events if e["event"] == "step"]
    fails = [e for e in events if e["event"] == "failure"]
    recs = [e for e in events if e["event"] == "recovered"]
    rate = ""
    recent = [e for e in steps if e["t"] >= time.time() - 10]
    if len(recent) >= 2:
        rate = f", {(len(recent) - 1) / (recent[-1]['t'] - recent[0]['t']):.2f} steps/s"
    head = Text(f"generation {st.get('generation')} ({st.get('kind')}), world size "
                f"{st.get('world_size')}, step {st.get('step')} (committed "
                f"{st.get('committed_step')}){rate}, loss "
                f"{steps[-1]['loss']:.4f}" if steps else "no step yet")
    members = Table("rank", "worker", "role", "state", "pid", "node")
    for m in st.get("members", []):
        members.add_row(str(m.get("rank")), m.get("wid", ""), m.get("role", ""),
                        m.get("state", ""), str(m.get("pid", "")), str(m.get("node", "")))
    last = Table("failures", "recoveries")
    last.add_row("\n".join(f"{f['wid']} rank {f.get('rank')}: {f.get('kind')} "
                           f"({f.get('detail', '')})" for f in fails[-5:]) or "-",
                 "\n".join(f"gen {r['gen']}: {r.get('recover_s', 0):.3f} s, from step "
                           f"{r.get('restore_step')}" for r in recs[-5:]) or "-")
    done = st.get("kind") in ("done", "abort")
    return Group(head, members, last), done


def watch(run_dir: Path, interval: float) -> int:
    view, done = _view(run_dir)
    with Live(view, refresh_per_second=4) as live:
        while not done:
            time.sleep(interval)  # a display refresh, not synchronisation
            view, done = _view(run_dir)
            live.update(view)
    return 0

"""Run real `phoenixft run` jobs for tests and clean up every process they started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from phoenixft.observe.events import read_events

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
PHOENIXFT = [sys.executable, "-m", "phoenixft.cli"]


@dataclass
class Job:
    rc: int
    out: str
    run_dir: Path
    summary: dict = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, by PID."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def kill_members(run_dir: Path) -> None:
    """SIGKILL any worker listed in status.json that is still alive (orphans of a
    killed agent), checking its command line so a reused PID is left alone."""
    status = run_dir / "status.json"
    if not status.exists():
        return
    for m in json.loads(status.read_text()).get("members", []):
        try:
            p = psutil.Process(m["pid"])
            if any("train_gpt" in part for part in p.cmdline()):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def load(run_dir: Path, rc: int, out: str) -> Job:
    job = Job(rc, out, run_dir)
    if (run_dir / "summary.json").exists():
        job.summary = json.loads((run_dir / "summary.json").read_text())
    job.events = list(read_events(run_dir / "events.jsonl"))
    return job


def start(run_dir: Path, *launch_args: str, steps: int = 16, script_args: tuple = ()) -> subprocess.Popen:
    cmd = [*PHOENIXFT, "run", "--run-dir", str(run_dir), *launch_args, str(EXAMPLE),
           "--steps", str(steps), *script_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run(run_dir: Path, *launch_args: str, steps: int = 16, timeout: float = 150,
        script_args: tuple = ()) -> Job:
    p = start(run_dir, *launch_args, steps=steps, script_args=script_args)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        kill_tree(p.pid)
        kill_members(run_dir)
    return load(run_dir, p.returncode, out)

"""Run real `phoenixft run` jobs for tests and clean up every process they started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from phoenixft.observe.events import read_events
from tests.support.waiting import wait_until as wait_until  # (the job tests' wait)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
# a tiny job that can hold at a step until a file appears (or a respawned worker registered)
GATED = ROOT / "tests" / "integration" / "scripts" / "gated.py"
PHOENIXFT = [sys.executable, "-m", "phoenixft.cli"]
# steps for a job that runs until its test stops it (one that could finish first would race it)
UNTIL_STOPPED = 100_000


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
    """SIGKILL a process and every descendant, by PID, except an agent's janitor: it is
    what cleans up after a SIGKILLed agent (its node's shared memory), so it is left to
    do that and waited for (killed too if it has not finished in 10 s)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    janitors = []
    for p in procs:
        try:
            if "phoenixft.launch.janitor" in " ".join(p.cmdline()):
                janitors.append(p)
                continue
            p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs([p for p in procs if p not in janitors], timeout=10)
    _, alive = psutil.wait_procs(janitors, timeout=10)
    for p in alive:
        p.kill()


def plain_torchrun(nproc: int, script: Path, *args: str, cwd: Path = ROOT,
                   timeout: float = 240) -> str:
    """`script` under plain torchrun (--standalone, no phoenixft environment), its process
    tree killed by PID whatever happens; its log. It must exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHOENIXFT_")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), str(script), *args], cwd=cwd,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=timeout)
    finally:
        kill_tree(p.pid)
    assert p.returncode == 0, log[-3000:]
    return log


def kill_members(run_dir: Path) -> None:
    """SIGKILL any worker listed in status.json that is still alive (orphans of a
    killed agent), checking its command line so a reused PID is left alone (a worker
    forked by the fork server shows the server's command line)."""
    status = run_dir / "status.json"
    if not status.exists():
        return
    for m in json.loads(status.read_text()).get("members", []):
        try:
            p = psutil.Process(m["pid"])
            cmd = " ".join(p.cmdline())  # forked workers carry their fork server's
            if "phoenixft.launch.worker" in cmd or "phoenixft.launch.forkserver" in cmd:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def reached_step(run_dir: Path, step: int) -> bool:
    return any(e["event"] == "step" and e["step"] >= step
               for e in read_events(run_dir / "events.jsonl"))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_REFERENCES: dict[tuple, dict] = {}


def failure_free(tmp_path_factory, nproc: int, steps: int, *script_args: str,
                 script: Path = EXAMPLE) -> dict:
    """The summary of the same job without failures (run once per shape in a session);
    `script` the same training script as the job's (GATED for a job that holds)."""
    key = (nproc, steps, script_args, script)
    if key not in _REFERENCES:
        job = run(tmp_path_factory.mktemp(f"ref{nproc}"), "--nproc", str(nproc), steps=steps,
                  script_args=script_args, script=script)
        assert job.rc == 0, job.out
        assert job.summary["final_step"] == steps
        assert len(job.summary["losses"]) == steps
        _REFERENCES[key] = job.summary
    return _REFERENCES[key]


def run_two_nodes(run_dir: Path, node0: tuple, node1: tuple, *common: str, steps: int,
                  timeout: float = 240, script: Path = EXAMPLE, script_args: tuple = (),
                  while_running: Callable[[list[subprocess.Popen]], None] | None = None
                  ) -> tuple[Job, int]:
    """Two agents on loopback (node 0 hosts the store); returns node 0's job (it leads and
    writes the summary) and node 1's exit status. `while_running(agents)` is called once
    both agents started, before their end is awaited (a test that acts on a held job)."""
    from phoenixft.platform import free_port

    both = ("--nnodes", "2", "--store", f"127.0.0.1:{free_port()}", *common)
    a0 = start(run_dir, *both, "--node-rank", "0", *node0, steps=steps, script=script,
               script_args=script_args)
    a1 = start(run_dir, *both, "--node-rank", "1", *node1, steps=steps, script=script,
               script_args=script_args)
    try:
        if while_running is not None:
            while_running([a0, a1])
        out0, _ = a0.communicate(timeout=timeout)
        a1.communicate(timeout=30)
    finally:
        kill_tree(a0.pid), kill_tree(a1.pid), kill_members(run_dir)
    return load(run_dir, a0.returncode, out0), a1.returncode


def load(run_dir: Path, rc: int, out: str) -> Job:
    job = Job(rc, out, run_dir)
    if (run_dir / "summary.json").exists():
        job.summary = json.loads((run_dir / "summary.json").read_text())
    job.events = list(read_events(run_dir / "events.jsonl"))
    return job


def start(run_dir: Path, *launch_args: str, steps: int | None = 16, script_args: tuple = (),
          script: Path = EXAMPLE) -> subprocess.Popen:
    steps_args = ("--steps", str(steps)) if steps is not None else ()
    cmd = [*PHOENIXFT, "run", "--run-dir", str(run_dir), *launch_args, str(script),
           *steps_args, *script_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def run_script(run_dir: Path, script: Path, *launch_args: str, timeout: float = 150,
               script_args: tuple = ()) -> Job:
    """`phoenixft run` of another script than the example (it parses its own arguments)."""
    return run(run_dir, *launch_args, steps=None, timeout=timeout, script_args=script_args,
               script=script)


def run(run_dir: Path, *launch_args: str, steps: int | None = 16, timeout: float = 150,
        script_args: tuple = (), script: Path = EXAMPLE) -> Job:
    p = start(run_dir, *launch_args, steps=steps, script_args=script_args, script=script)
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        kill_tree(p.pid)
        kill_members(run_dir)
    return load(run_dir, p.returncode, out)

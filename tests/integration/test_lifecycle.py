"""Lifecycles: a job never leaves orphans or shared memory behind, stops promptly and says
why when told to, and treats a rank that leaves early as that rank's failure. Real
processes, real signals."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from phoenixft.observe.events import read_events
from tests.support.jobs import (
    PHOENIXFT,
    ROOT,
    UNTIL_STOPPED,
    alive,
    failure_free,
    kill_members,
    kill_tree,
    load,
    reached_step,
    run,
    start,
    wait_until,
)

pytestmark = [pytest.mark.integration]


def shm_dirs(run_dir: Path) -> list[Path]:
    return [Path(e["shm_dir"]) for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "agent_start"]


def worker_pids(run_dir: Path) -> list[int]:
    status = json.loads((run_dir / "status.json").read_text())
    return [m["pid"] for m in status["members"]]


@pytest.mark.timeout(120)
def test_sigkill_of_the_agent_leaves_no_orphans_and_no_shared_memory(tmp_path):
    p = start(tmp_path, "--nproc", "2", "--spares", "1", steps=UNTIL_STOPPED)
    try:
        wait_until(lambda: reached_step(tmp_path, 3), 60, "step 3")
        pids, shm = worker_pids(tmp_path), shm_dirs(tmp_path)
        assert len(pids) == 3 and shm and all(d.exists() for d in shm)
        p.kill()
        p.wait(timeout=30)
        # states, bounded only by the test's timeout: the workers die with their agent and
        # its janitor removes the node's shared memory
        wait_until(lambda: not any(alive(pid) for pid in pids), 50, "every worker to die")
        wait_until(lambda: not any(d.parent.exists() for d in shm), 50, "shared memory removed")
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_job_with_its_reason(tmp_path, sig):
    p = start(tmp_path, "--nproc", "2", "--spares", "1", steps=UNTIL_STOPPED)
    try:
        wait_until(lambda: reached_step(tmp_path, 3), 60, "step 3")
        pids, shm = worker_pids(tmp_path), shm_dirs(tmp_path)
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)  # it exits (a hang fails here, loudly)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    assert p.returncode == 128 + sig, out
    assert f"{sig.name} received" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["aborted"] == f"interrupted by {sig.name}"
    # promptly: the leader published the abort plan and every worker read it and left on
    # its own within the grace period (one SIGKILLed at its end would not have said so)
    events = list(read_events(tmp_path / "events.jsonl"))
    assert [e["reason"] for e in events if e["event"] == "abort"] == [f"interrupted by {sig.name}"]
    for log in (tmp_path / "logs").iterdir():
        assert f"job stopped by the leader: interrupted by {sig.name}" in log.read_text(), log
    # what it did before the signal: its last completed step and every loss up to it
    assert summary["final_step"] >= 3 and summary["final_state_digest"] is None
    assert len(summary["losses"]) == summary["final_step"]
    assert 0 <= summary["committed_step"] <= summary["final_step"]
    assert not any(alive(pid) for pid in pids)
    assert not any(d.parent.exists() for d in shm)


EARLY_EXIT = """
    import os, sys, torch, phoenixft
    sess = phoenixft.Session()
    model = torch.nn.Linear(4, 4)
    sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
    for step in sess.steps(12):
        if step.index == 3 and os.environ["PHOENIXFT_WORKER_ID"] == "n0w1":
            sys.exit({code})
        for _ in step.microbatches():
            step.backward(model(torch.ones(2, 4)).sum())
"""


def run_script(tmp_path: Path, body: str, *launch: str, timeout: float = 90):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*PHOENIXFT, "run", "--run-dir", str(run_dir), *launch, str(script)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        kill_tree(p.pid)
        kill_members(run_dir)
    return load(run_dir, p.returncode, out + err)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_exits_early_is_a_failure_of_that_rank(tmp_path, code):
    job = run_script(tmp_path, EARLY_EXIT.format(code=code), "--nproc", "2")
    assert job.rc == 1, job.out
    assert f"worker n0w1 (rank 1) failed (exit code {code}" in job.out
    [f] = job.summary["failures"]
    assert (f["wid"], f["rank"], f["kind"]) == ("n0w1", 1, "exit")


@pytest.mark.timeout(120)
def test_a_spare_takes_over_from_a_rank_that_exited_early(tmp_path):
    job = run_script(tmp_path, EARLY_EXIT.format(code=3), "--nproc", "2", "--spares", "1")
    assert job.rc == 0, job.out
    [f] = job.summary["failures"]
    assert f["wid"] == "n0w1" and f["detail"] == "exit code 3"
    assert job.summary["recoveries"][0]["replacement"] == "n0w2"


@pytest.mark.timeout(60)
def test_a_script_without_a_session_stops_the_job_at_once(tmp_path):
    job = run_script(tmp_path, "print('I forgot phoenixft.Session()')\n", "--nproc", "2")
    assert job.rc == 1
    assert "exited during start-up" in job.out and "phoenixft.Session()" in job.out
    # at once: stopped by the worker's exit report, not by the start-up deadline
    [abort] = job.of("abort")
    assert "exited during start-up" in abort["reason"], abort
    assert "start-up did not complete" not in job.out


@pytest.mark.timeout(60)
def test_a_worker_that_fails_after_training_fails_the_job(tmp_path):
    job = run_script(tmp_path, """
        import sys, torch, phoenixft
        sess = phoenixft.Session()
        model = torch.nn.Linear(4, 4)
        sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
        for step in sess.steps(4):
            for _ in step.microbatches():
                step.backward(model(torch.ones(2, 4)).sum())
        sys.exit(5 if sess.rank == 1 else 0)  # saving the model failed, say
    """, "--nproc", "2")
    assert job.rc == 1
    assert "training finished, but worker n0w1 exited after training with exit code 5" in job.out
    assert job.summary["final_step"] == 4


@pytest.mark.timeout(180)
def test_deleting_shared_memory_mid_run_does_not_stop_a_healthy_job(tmp_path, tmp_path_factory):
    ref = failure_free(tmp_path_factory, 2, 40)
    p = start(tmp_path, "--nproc", "2", steps=40)
    try:
        wait_until(lambda: reached_step(tmp_path, 5), 60, "step 5")
        for d in shm_dirs(tmp_path):
            shutil.rmtree(d.parent)
        out, _ = p.communicate(timeout=120)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    job = load(tmp_path, p.returncode, out)
    assert job.rc == 0, out
    assert job.summary["final_state_digest"] == ref["final_state_digest"]


@pytest.mark.timeout(120)
def test_a_second_run_in_the_same_run_dir_is_refused(tmp_path):
    p = start(tmp_path, "--nproc", "1", steps=UNTIL_STOPPED)
    try:
        wait_until(lambda: reached_step(tmp_path, 1), 60, "step 1")
        second = subprocess.run([*PHOENIXFT, "run", "--run-dir", str(tmp_path), "--nproc", "1",
                                 "examples/train_gpt.py", "--steps", "2"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert f"is in use by a running job (pid {p.pid})" in second.stderr
        assert alive(p.pid) and p.poll() is None
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    # once it is gone the directory is free again (a killed job leaves no stale lock)
    job = run(tmp_path, "--nproc", "1", steps=2)
    assert job.rc == 0, job.out


@pytest.mark.timeout(120)
def test_a_single_host_job_listens_on_loopback_only(tmp_path):
    p = start(tmp_path, "--nproc", "2", steps=UNTIL_STOPPED)
    try:
        wait_until(lambda: reached_step(tmp_path, 1), 60, "step 1")
        root = psutil.Process(p.pid)
        pids = {root.pid} | {c.pid for c in root.children(recursive=True)}
        listening = [c for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert listening
        assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)


@pytest.mark.timeout(180)
def test_a_hung_spare_does_not_keep_a_finished_job_from_exiting(tmp_path):
    """A SIGSTOPped spare (never fenced here: the heartbeat deadline is far away) used to
    keep the agent waiting for it forever once training was done, SIGTERM ignored."""
    from tests.support.jobs import GATED

    p = start(tmp_path, "--nproc", "1", "--spares", "1", "--heartbeat-timeout", "600",
              script=GATED, steps=None,
              script_args=("--steps", "6", "--hold-at", "2", "--hold-until-file", "go"))
    try:
        wait_until(lambda: reached_step(tmp_path, 1) or p.poll() is not None, 60, "step 1")
        st = json.loads((tmp_path / "status.json").read_text())
        [spare] = [m["pid"] for m in st["members"] if m["role"] == "spare"]
        wait_until(lambda: psutil.Process(spare).status() in (psutil.STATUS_SLEEPING,
                                                              psutil.STATUS_DISK_SLEEP),
                   30, "the spare waiting")
        psutil.Process(spare).send_signal(signal.SIGSTOP)
        (tmp_path / "go").touch()
        out, _ = p.communicate(timeout=60)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    assert p.returncode == 0, out
    assert "phoenixft: done: 6 steps" in out
    assert not alive(spare)


@pytest.mark.timeout(120)
def test_sigterm_while_workers_start_stops_starting_them(tmp_path):
    """SIGTERM while the agent starts its workers: it starts no more and stops. The fork
    server is held (SIGSTOP) before it can answer the first request, so the signal
    arrives while the first start is in flight, whatever the machine's speed."""
    p = start(tmp_path, "--nproc", "24", steps=UNTIL_STOPPED)
    lines: list[str] = []
    try:
        server = wait_until(lambda: next(
            (c for c in psutil.Process(p.pid).children()
             if "phoenixft.launch.forkserver" in " ".join(c.cmdline())), None), 30,
            "the fork server", poll=0.005)
        server.send_signal(signal.SIGSTOP)
        logs = tmp_path / "logs"
        # the first start is in flight (its log opened) and none has been answered
        wait_until(lambda: logs.is_dir() and len(list(logs.iterdir())) == 1, 60,
                   "the agent asking for its first worker")
        p.send_signal(signal.SIGTERM)
        t = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")),
                             daemon=True)
        t.start()
        wait_until(lambda: any("SIGTERM received" in ln for ln in lines), 30, "the signal seen")
        server.send_signal(signal.SIGCONT)
        p.wait(timeout=60)
        t.join(timeout=10)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    assert p.returncode == 128 + signal.SIGTERM, "".join(lines)
    assert len(list((tmp_path / "logs").iterdir())) == 1  # no worker started after it

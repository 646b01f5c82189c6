"""A follower node's agent stopped (SIGSTOP) and continued (SIGCONT) in a two-agent job:
it says in one line why it leaves, never a c10d stack or a wrong sentence, and the job's
end on node 0 stays right."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from phoenixft.observe.events import read_events
from phoenixft.platform import free_port
from tests.support.jobs import GATED, kill_members, kill_tree, reached_step, start, wait_until

pytestmark = [pytest.mark.integration]
HB = ("--heartbeat-timeout", "3")


def two_agents(run_dir: Path, script_args: tuple) -> tuple:
    both = ("--nnodes", "2", "--store", f"127.0.0.1:{free_port()}", "--nproc", "1", *HB)
    args = ("--steps", "6", *script_args)
    a0 = start(run_dir, *both, "--node-rank", "0", "--spares", "1", script=GATED, steps=None,
               script_args=args)
    a1 = start(run_dir, *both, "--node-rank", "1", script=GATED, steps=None, script_args=args)
    return a0, a1


def logged(run_dir: Path, event: str, **fields) -> bool:
    return any(e["event"] == event and all(e.get(k) == v for k, v in fields.items())
               for e in read_events(run_dir / "events.jsonl"))


def no_stack(out: str) -> None:
    assert "frame #" not in out and "Traceback" not in out, out


@pytest.mark.timeout(180)
def test_a_follower_stopped_past_the_deadline_says_the_job_went_on_without_it(tmp_path):
    """Node 1's agent stopped mid-run until the leader fenced its worker and a spare took
    its rank, then continued: it used to exit 1 without a word."""
    a0, a1 = two_agents(tmp_path, ("--hold-at", "2", "--hold-until-file", "go"))
    try:
        wait_until(lambda: reached_step(tmp_path, 1), 90, "step 1")
        os.kill(a1.pid, signal.SIGSTOP)
        wait_until(lambda: logged(tmp_path, "generation", gen=1), 90, "the spare's generation")
        os.kill(a1.pid, signal.SIGCONT)
        out1, _ = a1.communicate(timeout=60)
        (tmp_path / "go").touch()
        out0, _ = a0.communicate(timeout=90)
    finally:
        kill_tree(a0.pid), kill_tree(a1.pid), kill_members(tmp_path)
    assert a0.returncode == 0 and "phoenixft: done: 6 steps, 1 failure" in out0, out0
    assert a1.returncode == 1
    no_stack(out1)
    assert "node 1 leaves the job: this agent stood still for" in out1, out1
    assert "the job goes on without this node" in out1, out1


@pytest.mark.timeout(180)
def test_a_follower_stopped_after_its_worker_finished_neither_fails_nor_hangs_the_job(
        tmp_path):
    """Both workers finished training; node 1's agent is stopped before it could report
    its worker's exit. The leader used to count the silent worker as hung and start a new
    generation after the last step that never formed (the job hung); now the finished
    worker is no failure, the job ends, and node 1's agent, continued once node 0 and its
    store are gone, says what happened instead of a c10d stack and "losing node 0 ends the
    job"."""
    a0, a1 = two_agents(tmp_path, ("--hold-after-file", "exit"))
    try:
        wait_until(lambda: logged(tmp_path, "done"), 90, "training finished")
        os.kill(a1.pid, signal.SIGSTOP)
        (tmp_path / "exit").touch()
        out0, _ = a0.communicate(timeout=90)
        os.kill(a1.pid, signal.SIGCONT)
        out1, _ = a1.communicate(timeout=60)
    finally:
        kill_tree(a0.pid), kill_tree(a1.pid), kill_members(tmp_path)
    assert a0.returncode == 0 and "phoenixft: done: 6 steps, 0 failures" in out0, out0
    assert a1.returncode == 1
    no_stack(out1)
    assert "losing node 0 ends the job" not in out1, out1
    assert "this agent stood still for" in out1 and "the job ended, or node 0 was lost" in out1, out1

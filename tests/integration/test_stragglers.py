"""Stragglers under `phoenixft run` (--straggler report): a rank made 4x slower from a
step on (`slow:` fault) is named within its window, once; a failure-free run of 300 steps
beside a noisy neighbour (a busy process the test starts and stops by PID, competing for
the 2 cores) names nobody."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import kill_tree, run

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(200)
def test_a_rank_made_four_times_slower_is_named_within_its_window(tmp_path):
    window = 6
    job = run(tmp_path, "--nproc", "3", "--straggler-window", str(window),
              "--inject", "slow:rank=1:step=5:factor=4", steps=30, script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [found] = job.of("straggler")
    assert (found["rank"], found["wid"]) == (1, "n0w1")
    # slow from step 5 on: its median turns once about half the window is slow steps
    # (a slow first step, the warm-up, can count among them)
    assert 5 <= found["step"] <= 5 + window, found
    assert found["ratio"] >= 2
    assert "rank 1 (n0w1) is a straggler" in job.out
    assert not job.summary["failures"]  # reported, nothing else done


@pytest.mark.timeout(300)
def test_no_straggler_is_named_in_300_failure_free_steps_beside_a_noisy_neighbour(tmp_path):
    noisy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        job = run(tmp_path, "--nproc", "3", steps=300, timeout=280,
                  script_args=("--data", "ids"))
    finally:
        kill_tree(noisy.pid)
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_step"] == 300
    assert job.of("straggler") == []

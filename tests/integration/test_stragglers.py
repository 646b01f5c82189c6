"""Stragglers under `phoenixft run`: a rank made 4x slower from a step on (`slow:` fault)
is named within its window, once (--straggler report); with --straggler swap and a spare
it is swapped at the next committed step and fenced, nothing rolled back (final state bit
for bit the failure-free run's); the failure-free references name nobody, one of them
beside a busy process (300 steps of it are `phoenixft bench consensus`'s `noisy` mode); a
rank stopped with SIGSTOP for part of every step (`freeze:` fault), mostly while the
others wait for it in the all-reduce, is named by its stalls."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from phoenixft.train.straggler import lower_quartile
from tests.support.jobs import run

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(200)
def test_a_rank_made_four_times_slower_is_named_within_its_window(tmp_path):
    window = 6
    job = run(tmp_path, "--nproc", "3", "--straggler-window", str(window),
              "--inject", "slow:rank=1:step=5:factor=4", steps=30, script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    named = job.of("straggler")
    # (named again in one CI run: the suite's load slowed the others long enough for rank
    # 1's median ratio to fall under the bar, and it came back; nobody else is ever named)
    assert {(e["rank"], e["wid"]) for e in named} == {(1, "n0w1")}, named
    found = named[0]
    # named at the first step whose window (the compute times every rank saw, in the step
    # events) had rank 1 twice the others' median on three steps in four: step 10 alone on
    # this machine; under the suite's load the others' slowed steps can put that later
    ratios = [e["compute_s"][1] / statistics.median([e["compute_s"][0], e["compute_s"][2]])
              for e in job.of("step")]
    due = next(i + 1 for i in range(window - 1, len(ratios))
               if lower_quartile(ratios[i + 1 - window:i + 1]) >= 2)
    assert found["step"] == due and 5 <= due <= 5 + 2 * window, (found, ratios)
    assert found["ratio"] >= 2
    assert "rank 1 (n0w1) is a straggler" in job.out
    assert not job.summary["failures"]  # reported, nothing else done


@pytest.mark.timeout(240)
def test_a_straggler_is_swapped_for_a_spare_with_nothing_rolled_back(tmp_path, tmp_path_factory):
    # (ratio 3: the swap is under test here, not the bar; an 8x rank clears 3 and a rank
    # the suite's load slowed, 2.07x at window 6 in one CI run, does not. A 4x rank did
    # not clear it in one CI run: its sleep scales its own compute time, and the suite's
    # load slows the others' by up to 1.5x, which leaves it on the bar)
    args = ("--nproc", "3", "--spares", "1", "--straggler", "swap", "--straggler-window", "6",
            "--straggler-ratio", "3")
    ref = run(tmp_path_factory.mktemp("straggler-ref"), *args, steps=24,
              script_args=("--data", "ids"))
    assert ref.rc == 0, ref.out[-3000:]
    assert ref.of("straggler") == []
    job = run(tmp_path, *args, "--inject", "slow:rank=1:step=5:factor=8", steps=24,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [swapped] = job.of("straggler_swapped")
    assert (swapped["wid"], swapped["rank"], swapped["spare"]) == ("n0w1", 1, "n0w3")
    assert job.summary["quarantined"] == ["n0w1"] and not job.summary["failures"]
    assert job.summary["world_sizes"] == [3, 3]
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    # at the next committed step, nothing recomputed, no failure counted
    [rec] = job.summary["recoveries"]
    assert (rec["kind"], rec["replacement"], rec["lost_steps"]) == ("straggler", "n0w3", 0)
    assert rec["restore_step"] >= swapped["step"]
    assert job.summary["microbatch_passes"] == ref.summary["microbatch_passes"]
    assert "straggler n0w1 (rank 1" in job.out and "swapped for spare n0w3" in job.out



@pytest.mark.timeout(200)
def test_a_straggler_with_no_spare_to_swap_it_for_is_kept_and_told(tmp_path):
    job = run(tmp_path, "--nproc", "2", "--straggler", "swap", "--straggler-window", "6",
              "--inject", "slow:rank=1:step=5:factor=4", steps=24, script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [kept] = job.of("straggler_kept")
    assert (kept["wid"], kept["reason"]) == ("n0w1", "no spare to swap it for")
    assert job.summary["world_sizes"] == [2] and job.summary["quarantined"] == []
    assert "straggler n0w1 (rank 1) kept: no spare to swap it for" in job.out


def _step_s(job, first: int) -> float:
    """Median seconds between consecutive steps from step `first` on."""
    steps = [e for e in job.of("step") if e["step"] >= first]
    return statistics.median(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))


@pytest.mark.timeout(300)
def test_rebalance_gives_a_straggler_fewer_microbatches_with_the_same_gradients(
        tmp_path, tmp_path_factory):
    """No spare, --straggler rebalance: once rank 1 (8x slower from step 5) is named, its
    share of each step's 12 microbatches shrinks to its speed; every step still consumes
    the failure-free run's 12 (audit), the losses stay within 1e-4, and its steps are
    faster than the same slow job's on the even plan (--straggler report; measured here:
    0.22 s against 0.40 s, 3 workers on 2 cores)."""
    common = ("--nproc", "3", "--straggler-window", "6")
    script = ("--data", "ids", "--microbatches", "12")
    ref = run(tmp_path_factory.mktemp("rebalance-ref"), *common, steps=30, script_args=script)
    even = run(tmp_path_factory.mktemp("rebalance-even"), *common,
               "--inject", "slow:rank=1:step=5:factor=8", steps=30, script_args=script)
    job = run(tmp_path, *common, "--straggler", "rebalance",
              "--inject", "slow:rank=1:step=5:factor=8", steps=30, script_args=script)
    for j in (ref, even, job):
        assert j.rc == 0, j.out[-3000:]
    assert ref.of("straggler") == []
    # (once rebalanced, it may be named again when noise lifts it over the ratio: the
    # weights, set once per generation, stay)
    found = job.of("straggler")[0]
    assert found["rank"] == 1 and found["action"] == "rebalance"
    audit = [json.loads(x) for x in (job.run_dir / "audit.jsonl").read_text().splitlines()]
    ref_audit = [json.loads(x) for x in (ref.run_dir / "audit.jsonl").read_text().splitlines()]
    assert audit == ref_audit
    for x, y in zip(job.summary["losses"], ref.summary["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)
    after = found["step"] + 2
    assert _step_s(job, after) < _step_s(even, after), (_step_s(job, after), _step_s(even, after))


@pytest.mark.timeout(200)
def test_a_rank_slow_on_one_step_in_ten_is_not_named(tmp_path):
    """An intermittent slow rank (4x on steps 5, 15, 25, ...): a median over the window
    looks past its bursts. (Here the two steps after a burst were up to 2x slow as well;
    at one burst in four the rank was slow on most steps and was rightly named.)"""
    # the default window (20): with 6, a CI run's neighbours once lifted rank 0 over 2
    job = run(tmp_path, "--nproc", "3",
              "--inject", "slow:rank=1:step=5:factor=4:every=10", steps=45,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    assert [e["spec"] for e in job.of("inject")] == ["slow:rank=1:step=5:factor=4.0:every=10"]
    # its bursts were slow indeed: against the mean of the other two ranks (their max was
    # lifted under 1.6x once when the suite's other worker ran 7 processes beside it)
    slow = [e["compute_s"][1] / ((e["compute_s"][0] + e["compute_s"][2]) / 2)
            for e in job.of("step") if e["step"] >= 5 and (e["step"] - 5) % 10 == 0]
    assert statistics.median(slow) > 2
    assert job.of("straggler") == []


@pytest.mark.timeout(200)
def test_the_reference_run_beside_a_busy_process_names_nobody(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        job = run(tmp_path, "--nproc", "3", steps=40, script_args=("--data", "ids"))
    finally:
        busy.kill()
        busy.wait()
    assert job.rc == 0, job.out[-3000:]
    assert job.of("straggler") == []


@pytest.mark.timeout(200)
def test_a_rank_stopped_for_part_of_every_step_is_named_by_its_stalls(tmp_path):
    """Rank 1 stopped (SIGSTOP, by the `freeze` fault's helper) for 150 ms of every
    250 ms from step 5 on: it freezes mostly while the others wait in the all-reduce,
    where its compute time cannot see it; its stall clock does."""
    window = 10
    job = run(tmp_path, "--nproc", "3", "--straggler-window", str(window),
              "--inject", "freeze:rank=1:step=5:ms=150:period=250", steps=40,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [found] = job.of("straggler")
    assert (found["rank"], found["wid"], found["why"]) == (1, "n0w1", "stalled"), found
    assert 5 <= found["step"] <= 5 + window and found["ratio"] >= 2, found
    assert "rank 1 (n0w1) is a straggler: its process stood still" in job.out
    assert not job.summary["failures"] and job.summary["final_step"] == 40
    stalled = [e["stall_s"][1] for e in job.of("step") if "stall_s" in e]
    assert len(stalled) >= 2 and max(stalled) >= 0.1, stalled

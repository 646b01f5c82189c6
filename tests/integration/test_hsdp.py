"""HSDP under `phoenixft run`: replica groups of 2 FSDP2 ranks (dp_shard) x 2 groups, a
group the unit of failure. With a spare, a dead rank is hot-swapped inside its group and
the other group keeps the step's work (final state bit for bit the failure-free run's).
Without one, the group leaves whole and the other takes its microbatches - keeping the
ones it finished, killed inside FSDP2's reduce-scatter or in the cross-group reduction -
with every step's audit equal to the failure-free run's and losses within 1e-4; with
--respawn the group comes back and the world returns to 4."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_hotswap import survivors_kept_pids
from tests.support.jobs import ROOT, run_script

pytestmark = [pytest.mark.integration]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "gated_hsdp.py"
STEPS, M = 10, 4  # M: one microbatch per rank of the 2 x 2 job


def _hsdp(tmp_path, *launch: str, script_args: tuple = ()):
    return run_script(tmp_path, SCRIPT, "--nproc", "4", *launch, timeout=240,
                      script_args=("--steps", str(STEPS), *script_args))


def _audit(job) -> list[dict]:
    return [json.loads(line) for line in (job.run_dir / "audit.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _hsdp(tmp_path_factory.mktemp("hsdp-ref"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["microbatch_passes"] == M * STEPS
    return job


def _equivalent(job, ref, *, extra_passes: int) -> None:
    """Every step consumed the failure-free run's microbatches, losses within 1e-4, and
    no survivor recomputed a microbatch it had finished."""
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_step"] == STEPS
    assert _audit(job) == _audit(ref)
    for x, y in zip(job.summary["losses"], ref.summary["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)
    assert job.summary["microbatch_passes"] == M * STEPS + extra_passes
    kept = job.of("in_step_recovery")
    assert kept and all(not set(e["kept"]) & set(e["recompute"]) for e in kept)


@pytest.mark.timeout(300)
def test_a_rank_killed_with_a_spare_is_swapped_inside_its_group(tmp_path, reference):
    job = _hsdp(tmp_path, "--spares", "1", "--inject", "kill:rank=3:step=4:phase=backward")
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    assert job.summary["losses"] == reference.summary["losses"]
    assert job.summary["world_sizes"] == [4, 4]
    survivors_kept_pids(job)
    # group 0 kept its microbatch of step 4; group 1 (the spare and rank 2) redid its own
    steps = {e["rank"]: (e["kept"], e["recompute"]) for e in job.of("in_step_recovery")}
    assert steps == {0: ([0], []), 1: ([1], []), 2: ([], [2]), 3: ([], [3])}


@pytest.mark.timeout(300)
def test_a_group_killed_in_its_reduce_scatter_leaves_and_comes_back(tmp_path, reference):
    job = _hsdp(tmp_path, "--min-nproc", "2", "--respawn", "2",
                "--inject", "kill:rank=2:step=4:phase=backward",
                "--inject", "kill:rank=3:step=4:phase=backward",
                script_args=("--hold-at", "6", "--spares", "2"))
    # ranks 2, 3 died before finishing a microbatch of step 4: nothing of theirs is redone
    _equivalent(job, reference, extra_passes=0)
    assert job.summary["world_sizes"] == [4, 2, 4]
    first = {e["rank"]: (e["kept"], e["recompute"]) for e in job.of("in_step_recovery")}
    assert first == {0: ([0], [2]), 1: ([1], [3])}  # group 0 took group 1's quota
    grown = [e for e in job.of("joined") if e["gen"] == 2]
    assert sorted(e["source"] for e in grown) == ["resharded_2_to_4"] * 4  # from memory
    # both died: told as their microbatches taken over, or (if the plan came before the
    # second death was seen) as the group leaving; either way 2 ranks go on
    assert "2 ranks go on (was 4)" in job.out


@pytest.mark.timeout(300)
def test_a_rank_killed_in_the_cross_group_reduction_takes_its_group_out(
        tmp_path, reference):
    job = _hsdp(tmp_path, "--min-nproc", "2", "--inject", "kill:rank=0:step=4:phase=reduce")
    # ranks 0, 1 had finished their microbatches of step 4: those 2 are computed again
    _equivalent(job, reference, extra_passes=2)
    assert job.summary["world_sizes"] == [4, 2]
    # rank 0's group partner was alive: it left cleanly, counted as gone, not failed
    [left] = job.of("left_with_group")
    assert (left["wid"], left["rank"]) == ("n0w1", 1)
    assert [e["wid"] for e in job.of("worker_left")] == ["n0w1"]
    assert len(job.summary["failures"]) == 1
    assert "ranks 0, 1 leave with their replica group; 2 ranks go on (was 4)" in job.out
    # group 1 goes on as ranks 0, 1, keeping its own microbatches and taking group 0's
    first = {e["wid"]: (e["rank"], e["kept"], e["recompute"]) for e in job.of("in_step_recovery")}
    assert first == {"n0w2": (0, [2], [0]), "n0w3": (1, [3], [1])}


@pytest.mark.timeout(120)
def test_microbatches_that_a_replica_group_cannot_share_are_refused(tmp_path):
    job = run_script(tmp_path, ROOT / "examples" / "train_fsdp.py", "--nproc", "4",
                     script_args=("--dp-shard", "2", "--microbatches", "5", "--steps", "3"))
    assert job.rc != 0
    assert ("5 microbatches a step cannot be shared evenly by the 2 data-parallel ranks of "
            "a replica group") in job.out


@pytest.mark.timeout(300)
def test_three_groups_lose_one_and_share_its_microbatches_in_rounds(tmp_path, tmp_path_factory):
    """3 groups x 2, M = 6 (the default): after a group leaves, 6 microbatches are not a
    multiple of the 4 ranks left; they go out in rounds of 2 (one per place in a group),
    so every rank of a group runs as many passes and the step is the failure-free one."""
    ref = run_script(tmp_path_factory.mktemp("hsdp-3x2-ref"), SCRIPT, "--nproc", "6",
                     timeout=240, script_args=("--steps", "6"))
    assert ref.rc == 0, ref.out[-3000:]
    job = run_script(tmp_path, SCRIPT, "--nproc", "6", "--min-nproc", "2",
                     "--inject", "kill:rank=5:step=3:phase=backward", timeout=240,
                     script_args=("--steps", "6"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["world_sizes"] == [6, 4]
    assert _audit(job) == _audit(ref)
    for x, y in zip(job.summary["losses"], ref.summary["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)

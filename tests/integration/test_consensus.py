"""Silent data corruption under `phoenixft run` (data parallel, --fingerprint-every 1, the
default): a bit flipped in rank 2's reduced gradients of step 5 (`flip:` fault, the
process carries on) is found by the ranks' vote before the update, rank 2 is named,
fenced and replaced by the spare, the others keep their microbatches, and the job ends
bit for bit as the failure-free run. With 2 ranks nobody can be outvoted: the job stops
before the update with its last committed step intact, never with a zero exit."""

from __future__ import annotations

import pytest

from tests.support.jobs import run

pytestmark = [pytest.mark.integration]
STEPS = 12


@pytest.mark.timeout(240)
def test_a_flipped_gradient_bit_is_outvoted_and_its_rank_swapped(tmp_path, tmp_path_factory):
    args = ("--nproc", "4", "--spares", "1")
    ref = run(tmp_path_factory.mktemp("sdc-ref"), *args, steps=STEPS, script_args=("--data", "ids"))
    assert ref.rc == 0, ref.out[-3000:]
    assert ref.of("fingerprint_mismatch") == [] and ref.summary["quarantined"] == []
    job = run(tmp_path, *args, "--inject", "flip:rank=2:step=5", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"], vote["wids"]) == (5, [2], ["n0w2"])
    [f] = job.summary["failures"]
    assert (f["wid"], f["kind"]) == ("n0w2", "corrupt")
    assert job.summary["quarantined"] == ["n0w2"]
    [rec] = job.summary["recoveries"]
    assert rec["replacement"] == "n0w4" and rec["restore_step"] == 4
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    assert "silent data corruption: rank 2's reduced gradients of step 5" in job.out


@pytest.mark.timeout(200)
def test_two_ranks_cannot_outvote_each_other_and_the_job_stops_clearly(tmp_path):
    job = run(tmp_path, "--nproc", "2", "--inject", "flip:rank=1:step=5", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc != 0
    assert "no strict majority says which are right" in job.out
    assert job.summary["final_state_digest"] is None
    assert job.summary["committed_step"] == 4 and job.summary["final_step"] == 4

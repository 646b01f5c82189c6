"""Faults in the arithmetic under `phoenixft run` (data parallel, 4 ranks + 1 spare, data
drawn from microbatch ids): rank 1 computes wrong gradients from step 10 on (`wrong:`
fault, the process carries on). Every rank sums them alike, so the fingerprint vote
passes them. With `--recompute-every 5`, step 10's recomputation (each rank also computes
the first microbatch of the two ranks before it) finds it before the update: rank 1 is
named, fenced and swapped, the others keep their microbatches, and the job ends bit for
bit as the failure-free run without the checks. Refused where it cannot work."""

from __future__ import annotations

import pytest

from tests.support.jobs import ROOT, run, run_script

pytestmark = [pytest.mark.integration]
STEPS = 12
COMMON = ("--nproc", "4", "--spares", "1")
DATA = ("--data", "ids")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = run(tmp_path_factory.mktemp("wrong-ref"), *COMMON, steps=STEPS, script_args=DATA)
    assert ref.rc == 0, ref.out[-3000:]
    return ref


@pytest.mark.timeout(240)
def test_a_rank_computing_wrong_gradients_is_found_by_the_recomputation(tmp_path, reference):
    """The reference runs without the checks: the job's final digest equal to it says
    both that the wrong gradients never reached an update and that the checks (steps 5
    and 10, before the fault and at it) left no trace."""
    assert reference.summary["final_state_digest"]
    job = run(tmp_path, *COMMON, "--recompute-every", "5", "--inject", "wrong:rank=1:step=10",
              steps=STEPS, script_args=DATA)
    assert job.rc == 0, job.out[-3000:]
    [found] = job.of("recompute_mismatch")
    assert (found["step"], found["named"], found["wids"]) == (10, [1], ["n0w1"]), found
    assert found["found"][0].startswith("rank 1's gradient of ")
    assert 5 in [e["step"] for e in job.of("step") if "check_s" in e]  # checked, agreed
    assert job.of("fingerprint_mismatch") == []  # (the vote saw nothing: all ranks agreed)
    [f] = job.summary["failures"]
    assert (f["wid"], f["kind"]) == ("n0w1", "corrupt")
    assert job.summary["quarantined"] == ["n0w1"]
    [rec] = job.summary["recoveries"]
    assert rec["replacement"] == "n0w4" and rec["restore_step"] == 9
    kept = {e["rank"]: e["kept"] for e in job.of("in_step_recovery") if e["wid"] != "n0w4"}
    assert kept == {0: [0], 2: [2], 3: [3]}, kept
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    assert job.summary["losses"] == reference.summary["losses"]
    # the recomputed passes are not the step's microbatches: the spare redid rank 1's one
    assert job.summary["microbatch_passes"] == reference.summary["microbatch_passes"] + 1


@pytest.mark.timeout(120)
def test_recomputation_is_refused_where_it_cannot_take_effect(tmp_path):
    job = run(tmp_path, "--nproc", "2", "--recompute-every", "5", steps=4, script_args=DATA)
    assert job.rc != 0
    assert "--recompute-every 5: each checked microbatch is computed on 3 ranks" in job.out


@pytest.mark.timeout(120)
def test_recomputation_is_refused_with_tensor_parallelism(tmp_path):
    """A tp group computes each microbatch's gradient together: no rank alone recomputes."""
    job = run_script(tmp_path, ROOT / "examples" / "train_fsdp.py", "--nproc", "4",
                     "--recompute-every", "3", script_args=("--steps", "2", "--tp", "2"))
    assert job.rc != 0
    assert "--recompute-every 3: with tensor parallelism a microbatch's gradient" in job.out

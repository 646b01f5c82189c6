"""Recovery that stays local (`train/kept_groups.py`): a spare taking a dead rank's place
rebuilds only the mesh groups that held the dead rank (and any a collective was left
unfinished in); every other group is kept, the same process-group object, its ranks'
processes untouched, and the job ends on the failure-free run's digest.

The groups' identities come from each `joined` event (`groups`: name -> size, kept, the
object's id in that process); what each member's groups looked like as it left a
generation from its `failure_seen` event ("clean", or which collective never finished)."""

from __future__ import annotations

import pytest

from tests.integration.test_hotswap import survivors_kept_pids
from tests.support.jobs import ROOT, run_script

pytestmark = [pytest.mark.integration]
HSDP = ROOT / "tests" / "integration" / "scripts" / "gated_hsdp.py"
FSDP = ROOT / "examples" / "train_fsdp.py"
STEPS = 6


def _groups(job, gen: int) -> dict[str, dict[str, dict]]:
    """wid -> its mesh groups as it joined generation `gen` (the world group left out)."""
    return {e["wid"]: {n: g for n, g in e["groups"].items() if n != "train"}
            for e in job.of("joined") if e["gen"] == gen}


def _left(job) -> dict[str, dict[str, str]]:
    """wid -> each of its mesh groups' state as it left generation 0."""
    return {e["wid"]: e["groups"] for e in job.of("failure_seen") if e["gen"] == 0}


def _same_digest(job, ref) -> None:
    assert job.rc == 0, job.out[-3000:]
    assert ref.rc == 0, ref.out[-3000:]
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    survivors_kept_pids(job)


def by_rank(job) -> dict[int, str]:
    return {e["rank"]: e["wid"] for e in job.of("joined") if e["gen"] == 0}


def _rebuilt(job, gen: int) -> set[str]:
    return {n for gs in _groups(job, gen).values() for n, g in gs.items() if not g["kept"]}


@pytest.mark.timeout(420)
def test_hsdp_keeps_the_groups_of_the_replica_groups_that_lost_nobody(tmp_path):
    """4 replica groups x 2 FSDP2 ranks + 1 spare; rank 5 (group 2) SIGKILLed inside its
    backward. Groups 0, 1 and 3 keep their dp_shard communicators (same objects), none
    of their collectives was interrupted; only the groups that held rank 5 (group 2's
    dp_shard, dp_replicate.1, and the world) are rebuilt."""
    ref = run_script(tmp_path / "ref", HSDP, "--nproc", "8", timeout=240,
                     script_args=("--steps", str(STEPS)))
    job = run_script(tmp_path / "job", HSDP, "--nproc", "8", "--spares", "1",
                     "--inject", "kill:rank=5:step=3:phase=backward", timeout=240,
                     script_args=("--steps", str(STEPS)))
    _same_digest(job, ref)
    before, after, left = _groups(job, 0), _groups(job, 1), _left(job)
    untouched = [w for w, e in ((e["wid"], e) for e in job.of("joined") if e["gen"] == 0)
                 if e["rank"] // 2 != 2]
    assert len(untouched) == 6
    for wid in untouched:
        [name] = [n for n in before[wid] if n.startswith("dp_shard.")]
        assert after[wid][name]["kept"], (wid, after[wid])
        assert after[wid][name]["pg"] == before[wid][name]["pg"], wid  # the same object
        assert left[wid][name] == "clean", (wid, left[wid])  # nothing of it interrupted
    # rebuilt: what held rank 5. dp_replicate.0 is kept: rank 4 (group 2) left inside
    # FSDP2's reduce-scatter, before the step's cross-group all-reduce that ranks 0, 2
    # and 6 issued; it issues that all-reduce at the join (drained) instead
    assert _rebuilt(job, 1) == {"dp_shard.2.0", "dp_replicate.1"}
    assert "never completed" in left[by_rank(job)[0]]["dp_replicate.0"]


@pytest.mark.timeout(420)
def test_a_2d_mesh_rebuilds_only_the_dead_ranks_row_and_column(tmp_path):
    """dp_shard 2 x tp 2 + 1 spare, rank 3 SIGKILLed as it reaches the step's reduction
    (its row's and column's collectives of the step all finished): rank 0's row and
    column are kept, rank 3's (now the spare's) are rebuilt."""
    args = ("--tp", "2", "--dp-shard", "2", "--steps", str(STEPS))
    ref = run_script(tmp_path / "ref", FSDP, "--nproc", "4", timeout=240, script_args=args)
    job = run_script(tmp_path / "job", FSDP, "--nproc", "4", "--spares", "1",
                     "--inject", "kill:rank=3:step=3:phase=reduce", timeout=240,
                     script_args=args)
    _same_digest(job, ref)
    before, after, ranks = _groups(job, 0), _groups(job, 1), by_rank(job)
    row0, col0 = "tp.0.0", "dp_shard.0.0"  # ranks (0, 1) and (0, 2)
    for rank, names in ((0, (row0, col0)), (1, (row0,)), (2, (col0,))):
        wid = ranks[rank]
        for name in names:
            assert after[wid][name]["kept"], (rank, name, after[wid])
            assert after[wid][name]["pg"] == before[wid][name]["pg"], (rank, name)
    sizes = {n: g["size"] for gs in after.values() for n, g in gs.items()}
    assert {n for n in _rebuilt(job, 1) if sizes[n] > 1} == {"tp.0.1", "dp_shard.0.1"}


@pytest.mark.timeout(420)
def test_a_second_death_inside_the_recovery_keeps_what_is_still_whole(tmp_path):
    """4 replica groups x 2 + 2 spares: rank 5 (group 2) SIGKILLed in backward, then rank
    2 (group 1) SIGKILLed inside the recovery, once generation 1's groups formed. The
    join of generation 1 is abandoned with its kept groups parked again; generation 2
    still keeps groups 0's and 3's dp_shard communicators, the objects of generation 0,
    and the job ends on the failure-free digest."""
    ref = run_script(tmp_path / "ref", HSDP, "--nproc", "8", timeout=240,
                     script_args=("--steps", str(STEPS)))
    job = run_script(tmp_path / "job", HSDP, "--nproc", "8", "--spares", "2",
                     "--inject", "kill:rank=5:step=3:phase=backward",
                     "--inject", "kill:rank=2:gen=1", timeout=300,
                     script_args=("--steps", str(STEPS)))
    _same_digest(job, ref)
    last = max(e["gen"] for e in job.of("joined"))
    assert last >= 2 and len(job.summary["failures"]) == 2
    before, after, ranks = _groups(job, 0), _groups(job, last), by_rank(job)
    for rank in (0, 1, 6, 7):  # groups 0 and 3
        wid = ranks[rank]
        [name] = [n for n in before[wid] if n.startswith("dp_shard.")]
        assert after[wid][name]["kept"], (rank, after[wid])
        assert after[wid][name]["pg"] == before[wid][name]["pg"], rank

"""`step.clip_grad_norm_` with a sharded model: the global norm over every rank's gradient
shards, as plain torchrun computes it with `torch.nn.utils.clip_grad_norm_` (per mesh and
combined where tensor parallelism puts gradients on two meshes, which torch's function
refuses), its all-reduce on the generation's groups. Against plain torchrun: the final
state bit for bit (FSDP2 and FSDP2 + TP), losses too or within 1e-6 (`_same_losses`); a
rank SIGKILLed as the others wait in the norm's all-reduce, and another in backward, end
on the same digest. HSDP (2 replica
groups x 2): the final state bit for bit that of plain FSDP2's own HSDP with torch's
clip_grad_norm_, through a kill in the clip."""

from __future__ import annotations

import pytest

from tests.integration.test_hotswap import survivors_kept_pids
from tests.integration.test_sharded import FSDP, _plain_torchrun
from tests.support.jobs import run_script

pytestmark = [pytest.mark.integration]
STEPS, CLIP = 6, "1.0"  # torchtitan's max_norm; every step's norm is above it: each is clipped


def _job(tmp_path, *launch: str, script_args: tuple = ()):
    job = run_script(tmp_path, FSDP, *launch, timeout=240,
                     script_args=("--steps", str(STEPS), "--clip", CLIP, *script_args))
    assert job.rc == 0, job.out[-3000:]
    return job


def _recovered(job, rank: int) -> None:
    [rec] = job.summary["recoveries"]
    assert (rec["rank"], rec["kind"]) == (rank, "exit"), rec
    survivors_kept_pids(job)


def _same_losses(ours: list[float], plain: list[float]) -> None:
    """Within 1e-6: with 4 data-parallel ranks the step's loss is summed over them in
    another order than the torchrun script's all-reduce (2 ranks: bit for bit); the state
    digests, compared bit for bit, are what the optimizer saw."""
    for x, y in zip(ours, plain, strict=True):
        assert abs(x - y) <= 1e-6 * abs(y), (x, y)


def _clipped(ref: dict) -> None:
    """The reference clipped every step (so a run without clipping could not match it)."""
    assert len(ref["grad_norms"]) == STEPS and min(ref["grad_norms"]) > float(CLIP), ref


@pytest.mark.timeout(600)
def test_fsdp2_clip_is_torchs_and_survives_kills_in_the_clip_and_in_backward(tmp_path):
    ref = _plain_torchrun(tmp_path / "plain", 4, "--steps", str(STEPS), "--clip", CLIP)
    _clipped(ref)
    for where, rank in (("clip", 1), ("backward", 2)):
        job = _job(tmp_path / where, "--nproc", "4", "--spares", "1",
                   "--inject", f"kill:rank={rank}:step=4:phase={where}")
        assert job.summary["final_state_digest"] == ref["final_state_digest"], where
        _same_losses(job.summary["losses"], ref["losses"])
        _recovered(job, rank)


@pytest.mark.timeout(500)
def test_fsdp2_with_tp_clip_over_two_meshes_survives_kills_in_the_clip_and_in_backward(tmp_path):
    """The torchrun reference clips per mesh as phoenixft does (torch's own function
    refuses two meshes), so it is checked too: the (2, 2) mesh trains what plain FSDP2 on
    the 2 data-parallel ranks does with torch's own clip_grad_norm_, within 1e-5."""
    ref = _plain_torchrun(tmp_path / "plain", 4, "--steps", str(STEPS), "--tp", "2",
                          "--clip", CLIP)
    _clipped(ref)
    for where, rank in (("clip", 1), ("backward", 2)):
        job = _job(tmp_path / where, "--nproc", "4", "--spares", "1",
                   "--inject", f"kill:rank={rank}:step=4:phase={where}", script_args=("--tp", "2"))
        assert job.summary["final_state_digest"] == ref["final_state_digest"], where
        assert job.summary["losses"] == ref["losses"], where
        _recovered(job, rank)
    torchs = _plain_torchrun(tmp_path / "dp2", 2, "--steps", str(STEPS), "--clip", CLIP)
    for x, y in zip(ref["grad_norms"] + ref["losses"], torchs["grad_norms"] + torchs["losses"],
                    strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (x, y)


@pytest.mark.timeout(500)
def test_hsdp_clip_is_fsdp2s_own_hsdp_with_torchs_clip_through_kills(tmp_path):
    """2 replica groups x 2: the state bit for bit that of plain FSDP2's HSDP (a 2-D
    mesh) with torch's clip_grad_norm_."""
    ref = _plain_torchrun(tmp_path / "plain", 4, "--steps", str(STEPS), "--dp-shard", "2",
                          "--clip", CLIP)
    _clipped(ref)
    for where, rank in (("clip", 3), ("backward", 0)):
        job = _job(tmp_path / where, "--nproc", "4", "--spares", "1", "--inject",
                   f"kill:rank={rank}:step=4:phase={where}", script_args=("--dp-shard", "2"))
        assert job.summary["final_state_digest"] == ref["final_state_digest"], where
        _same_losses(job.summary["losses"], ref["losses"])
        _recovered(job, rank)

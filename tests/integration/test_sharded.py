"""A model sharded with FSDP2 under `phoenixft run`: the same losses and final state as
the same script under plain torchrun (the independent reference); a rank SIGKILLed or
SIGSTOPped inside FSDP2's own collectives (or before its optimizer step) is hot-swapped:
the spare takes its shards, the survivors keep their processes (and their model and
optimizer objects), the final state is bit for bit that of the failure-free run, also
with bf16 parameters; the whole job killed and resumed from storage, on the same and on
another number of ranks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phoenixft.checkpoint.tiers import FsspecTier
from tests.integration.test_hotswap import survivors_kept_pids
from tests.support.jobs import ROOT, plain_torchrun, run_script

FSDP = ROOT / "examples" / "train_fsdp.py"
STEPS = 8
_REFS: dict[int, dict] = {}


def _fsdp(tmp_path, *launch: str, script_args: tuple = (), timeout: float = 240):
    return run_script(tmp_path / "run", FSDP, *launch, timeout=timeout,
                      script_args=("--steps", str(STEPS), *script_args))


def _failure_free(tmp_path_factory, nproc: int, *script_args: str) -> dict:
    key = (nproc, script_args)
    if key not in _REFS:
        job = _fsdp(tmp_path_factory.mktemp(f"fsdp-ref{nproc}"), "--nproc", str(nproc),
                    script_args=script_args)
        assert job.rc == 0, job.out[-3000:]
        assert job.summary["final_step"] == STEPS
        _REFS[key] = job.summary
    return _REFS[key]


def _same_as(job, ref, *, rank: int, kind: str) -> None:
    """The job recovered once, rank `rank`'s failure of `kind`, onto a spare that mapped
    the dead rank's shards, and ended with the failure-free run's state and losses."""
    assert job.rc == 0, job.out[-3000:]
    s = job.summary
    assert s["final_state_digest"] == ref["final_state_digest"]
    assert s["losses"] == ref["losses"]
    [rec] = s["recoveries"]
    assert (rec["rank"], rec["kind"]) == (rank, kind), rec
    assert rec["source"] == "local_snapshot"  # the spare mapped the dead rank's shards
    survivors_kept_pids(job)
    spare = next(e["wid"] for e in job.of("joined") if e["gen"] == 1 and e["rank"] == rank)
    assert spare not in {e["wid"] for e in job.of("joined") if e["gen"] == 0}
    # the survivors kept their sharded model and optimizer; only the spare built its own
    assert {e["wid"]: e["rebuilt"] for e in job.of("joined") if e["gen"] == 1} == \
        {e["wid"]: e["wid"] == spare for e in job.of("joined") if e["gen"] == 1}
    # no in-step recovery with FSDP2: a rank's gradients are reduced inside backward
    assert not job.of("in_step_recovery") and not job.of("computing_ahead")


def _plain_torchrun(tmp_path: Path, nproc: int, *script_args: str) -> dict:
    """The same script under plain torchrun (no phoenixft): its losses and final digest."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "losses.json"
    plain_torchrun(nproc, FSDP, "--out", str(out), *script_args)
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_fsdp2_under_phoenixft_trains_like_plain_torchrun(tmp_path, tmp_path_factory):
    ref = _failure_free(tmp_path_factory, 2)
    plain = _plain_torchrun(tmp_path, 2, "--steps", str(STEPS))
    assert len(plain["losses"]) == STEPS
    # bit for bit: the same reduce-scatters, the same AdamW steps
    assert ref["final_state_digest"] == plain["final_state_digest"]
    assert ref["losses"] == plain["losses"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("where", ["backward", "update"])
def test_fsdp2_rank_killed_inside_its_collectives_is_hot_swapped(tmp_path, tmp_path_factory,
                                                                 where):
    """backward: rank 1 dies as it issues the step's first reduce-scatter, so the others
    are inside theirs; update: it dies after the step's all-reduce, before its optimizer
    step (the others have stepped)."""
    ref = _failure_free(tmp_path_factory, 4)
    job = _fsdp(tmp_path, "--nproc", "4", "--spares", "1", "--inject",
                f"kill:rank=1:step=5:phase={where}")
    _same_as(job, ref, rank=1, kind="exit")


@pytest.mark.timeout(300)
def test_fsdp2_rank_computing_wrong_gradients_is_found_by_the_recomputation(
        tmp_path, tmp_path_factory):
    """A plain FSDP2 job has no replicas to vote with. Rank 1's arithmetic goes wrong at
    step 6 (`wrong`: its gradients, reduce-scattered into every rank's shards). With
    `--recompute-every 3` each rank recomputes, in FSDP2's no-sync mode, its own first
    microbatch and the two before it in the ring; step 6's check names rank 1 before the
    update, the spare takes its shards from snapshot 5 and the step is redone: losses and
    final state those of the failure-free run (whose steps 3 and 6 were not checked)."""
    ref = _failure_free(tmp_path_factory, 4)
    job = _fsdp(tmp_path, "--nproc", "4", "--spares", "1", "--recompute-every", "3",
                "--inject", "wrong:rank=1:step=6")
    assert job.rc == 0, job.out[-3000:]
    [found] = job.of("recompute_mismatch")
    assert (found["step"], found["named"]) == (6, [1]), found
    assert 3 in [e["step"] for e in job.of("step") if "check_s" in e]  # checked, agreed
    [f] = job.summary["failures"]
    assert f["kind"] == "corrupt"
    [rec] = job.summary["recoveries"]
    assert (rec["rank"], rec["restore_step"]) == (1, 5), rec
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    assert job.summary["losses"] == ref["losses"]


@pytest.mark.timeout(500)
def test_fsdp2_with_tensor_parallelism_on_a_2x2_mesh_through_a_sigkill(tmp_path):
    """FSDP2 over dp_shard + tensor parallelism over tp (the MLPs), a (2, 2) mesh + 1
    spare; rank 1 (the second of its tp group: it snapshots only its own shards, not the
    copies of the parameters tp replicates) SIGKILLed inside backward. The spare takes
    its shards and receives those copies from its tp group: losses and final state bit for
    bit those of plain torchrun with the same mesh. The job's last base, in DCP's format,
    then resumes onto a (2, 1) mesh for 2 more steps: within 1e-4 of plain torchrun's
    run of STEPS + 2 steps."""
    ref = _plain_torchrun(tmp_path / "plain", 4, "--steps", str(STEPS), "--tp", "2")
    longer = _plain_torchrun(tmp_path / "plain2", 4, "--steps", str(STEPS + 2), "--tp", "2")
    ckpt = tmp_path / "ckpt"
    persist = ("--persist", str(ckpt), "--persist-every", "1", "--persist-cpu-share", "1")
    job = _fsdp(tmp_path / "tp", "--nproc", "4", "--spares", "1", *persist, "--inject",
                "kill:rank=1:step=5:phase=backward", script_args=("--tp", "2"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    assert job.summary["losses"] == ref["losses"] == longer["losses"][:STEPS]
    [rec] = job.summary["recoveries"]
    assert (rec["rank"], rec["source"]) == (1, "local_snapshot")
    survivors_kept_pids(job)
    # the copies tp replicates are snapshotted once per tp group: rank 1's base is smaller
    tier = FsspecTier(str(ckpt))
    step = max(tier.manifests())
    size = {r: Path(tier.shards_path(step, r)).stat().st_size for r in range(4)}
    assert size[1] < 0.75 * size[0] and size[3] < 0.75 * size[2], size
    more = _fsdp(tmp_path / "resumed", "--nproc", "2", *persist, "--resume",
                 script_args=("--steps", str(STEPS + 2)))
    assert more.rc == 0, more.out[-3000:]
    assert more.summary["resumed_from"] == STEPS
    assert len(more.summary["losses"]) == 2
    for x, y in zip(more.summary["losses"], longer["losses"][STEPS:]):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)


@pytest.mark.timeout(300)
def test_fsdp2_rank_hung_inside_a_reduce_scatter_is_caught_by_its_deadline(
        tmp_path, tmp_path_factory):
    """SIGSTOPped as it issues a reduce-scatter: the others wait inside theirs, where FSDP2
    waits without a timeout; the heartbeat deadline finds the hang, the leader fences the
    rank, and the survivors leave the collective (not gloo's 30-minute timeout)."""
    ref = _failure_free(tmp_path_factory, 4)
    job = _fsdp(tmp_path, "--nproc", "4", "--spares", "1", "--heartbeat-timeout", "2",
                "--inject", "stop:rank=2:step=5:phase=backward")
    _same_as(job, ref, rank=2, kind="hang")


@pytest.mark.timeout(300)
def test_fsdp2_bf16_params_with_fp32_reduction_through_a_sigkill(tmp_path, tmp_path_factory):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), rank 0 killed."""
    ref = _failure_free(tmp_path_factory, 2, "--bf16")
    job = _fsdp(tmp_path, "--nproc", "2", "--spares", "1", "--inject",
                "kill:rank=0:step=5:phase=backward", script_args=("--bf16",))
    _same_as(job, ref, rank=0, kind="exit")


@pytest.mark.timeout(400)
def test_fsdp2_whole_job_killed_then_resumed_on_the_same_and_another_world_size(
        tmp_path, tmp_path_factory):
    """The agent SIGKILLed at step 6 (the whole job dies with it); --resume with 4 ranks
    ends bit for bit as the failure-free run, and with 2 ranks (the same 4 microbatches a
    step, each rank running 2) resharded from the 4 ranks' records, within 1e-4."""
    ref = _failure_free(tmp_path_factory, 4)
    ckpt = tmp_path / "ckpt"
    persist = ("--persist", str(ckpt), "--persist-every", "3", "--persist-cpu-share", "1")
    killed = _fsdp(tmp_path / "killed", "--nproc", "4", *persist,
                   "--inject", "node:rank=0:step=6")
    assert killed.rc == -9, killed.out[-2000:]
    tier = FsspecTier(str(ckpt))
    *_, before, newest = tier.manifests()
    assert 0 <= before < newest < 6
    shutil.copytree(ckpt, tmp_path / "ckpt2")
    _plain_dcp_loads_the_base(tmp_path, tier)
    # rank 2's shard of the newest persisted step damaged: named, passed over, the step
    # before serves (the reference digest still holds: training is deterministic)
    rec = next(r for r in tier.read_manifest(newest)["records"] if r["rank"] == 2)
    path = Path(tier.locate(newest, 2, rec["kind"]))
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x40
    path.write_bytes(bytes(data))

    same = _fsdp(tmp_path / "same", "--nproc", "4", *persist, "--resume")
    assert same.rc == 0, same.out[-3000:]
    assert path.name in " ".join(e["error"] for e in same.of("restore_source_failed"))
    assert same.summary["resumed_from"] == before
    assert same.summary["final_state_digest"] == ref["final_state_digest"]
    assert same.summary["losses"] == ref["losses"][before:]

    other = _fsdp(tmp_path / "other", "--nproc", "2", "--persist", str(tmp_path / "ckpt2"),
                  "--resume", script_args=("--microbatches", "4"))
    assert other.rc == 0, other.out[-3000:]
    assert other.summary["resumed_from"] == newest
    assert other.of("resumed")[0]["from_world_size"] == 4
    assert len(other.summary["losses"]) == STEPS - newest
    for x, y in zip(other.summary["losses"], ref["losses"][newest:]):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)


def _plain_dcp_loads_the_base(tmp_path: Path, tier: FsspecTier) -> None:
    """The newest persisted step of a job killed whole (4 ranks' records), exported with
    `phoenixft ckpt export --format dcp`, loaded by plain torch.distributed.checkpoint's
    default reader under plain torchrun on 2 ranks, into transformers' Llama sharded with
    FSDP2 (tests/integration/scripts/dcp_load.py imports nothing of phoenixft), equals
    `phoenixft ckpt export` of the same step as a Hugging Face model."""
    from safetensors.torch import load_file

    step = max(tier.manifests())
    where = tmp_path / "export-dcp"
    subprocess.run([sys.executable, "-m", "phoenixft.cli", "ckpt", "export", "--format", "dcp",
                    tier.url, "--step", str(step), "--to", str(where)], check=True, timeout=120)
    exported = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "phoenixft.cli", "ckpt", "export", tier.url,
                    "--step", str(step), "--to", str(exported)], check=True, timeout=120)
    out = tmp_path / "loaded.safetensors"
    plain_torchrun(2, ROOT / "tests/integration/scripts/dcp_load.py",
                   str(exported / "config.json"), str(where), str(out), cwd=tmp_path)
    loaded, ours = load_file(out), load_file(exported / "model.safetensors")
    assert sorted(loaded) == sorted(ours)
    for k in ours:
        assert torch.equal(loaded[k], ours[k]), k


@pytest.mark.timeout(300)
def test_fsdp2_damaged_shard_copy_is_passed_over_for_its_replica(tmp_path, tmp_path_factory):
    """`corrupt`: rank 1 flips a byte in its own snapshot slots, then dies; the spare's
    restore finds the damage, names the slot and takes the same-node replica instead."""
    ref = _failure_free(tmp_path_factory, 2)
    job = _fsdp(tmp_path, "--nproc", "2", "--spares", "1", "--replicas", "1",
                "--inject", "corrupt:rank=1:step=5")
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    [rec] = job.summary["recoveries"]
    assert rec["source"] == "local_replica"
    failed = [e for e in job.of("restore_source_failed") if e["tier"] == "local_snapshot"]
    assert failed and all("snap.r1" in e["error"] for e in failed)

"""A model sharded with FSDP2 under `phoenixft run`: the same losses as the same script
under plain torchrun (the independent reference), and a rank SIGKILLed inside FSDP2's
own collectives is hot-swapped: the spare takes its shards, the survivors keep their
processes (and their model and optimizer objects), the final state is bit for bit that
of the failure-free run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.test_hotswap import survivors_kept_pids
from tests.support.jobs import ROOT, kill_tree, run_script

FSDP = ROOT / "examples" / "train_fsdp.py"
STEPS = 8
_REFS: dict[int, dict] = {}


def _fsdp(tmp_path, *launch: str, steps: int = STEPS, timeout: float = 240):
    return run_script(tmp_path / "run", FSDP, *launch, timeout=timeout,
                      script_args=("--steps", str(steps)))


def _failure_free(tmp_path_factory, nproc: int) -> dict:
    if nproc not in _REFS:
        job = _fsdp(tmp_path_factory.mktemp(f"fsdp-ref{nproc}"), "--nproc", str(nproc))
        assert job.rc == 0, job.out[-3000:]
        assert job.summary["final_step"] == STEPS
        _REFS[nproc] = job.summary
    return _REFS[nproc]


@pytest.mark.timeout(300)
def test_fsdp2_under_phoenixft_trains_like_plain_torchrun(tmp_path, tmp_path_factory):
    ref = _failure_free(tmp_path_factory, 2)
    out = tmp_path / "losses.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHOENIXFT_")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(FSDP), "--steps", str(STEPS),
                          "--out", str(out)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=240)
    finally:
        kill_tree(p.pid)
    assert p.returncode == 0, log[-3000:]
    plain = json.loads(out.read_text())
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
    assert job.rc == 0, job.out[-3000:]
    s = job.summary
    assert s["final_state_digest"] == ref["final_state_digest"]
    assert s["losses"] == ref["losses"]
    [failure] = s["failures"]
    assert failure["rank"] == 1
    [rec] = s["recoveries"]
    assert rec["source"] == "local_snapshot"  # the spare mapped the dead rank's shards
    survivors_kept_pids(job)
    spare = next(e["wid"] for e in job.of("joined") if e["gen"] == 1 and e["rank"] == 1)
    assert spare not in {e["wid"] for e in job.of("joined") if e["gen"] == 0}
    # no in-step recovery with FSDP2: a rank's gradients are reduced inside backward
    assert not job.of("in_step_recovery") and not job.of("computing_ahead")

"""A very short `phoenixft bench pipeline`: the on/off run and the kill runs (phoenixft with
a spare, and torchrun pipelining with dcp.async_save and a restart, through the same
SIGKILL of a stage's rank) all happen and are reported with their goals; never how fast
anything was."""

import argparse
import json

import pytest

from phoenixft.bench import pipeline

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_pipeline_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    pipeline.register(parser.add_subparsers())
    out = tmp_path / "pipeline.json"
    args = parser.parse_args(["pipeline", "--preset", "tiny", "--blocks", "2", "--kill-steps",
                              "12", "--ckpt-every", "4", "--microbatches", "4", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert (r["pp"], r["replicas"]) == (2, 2) and r["blocks"]["pairs"] >= 1
    assert r["kill"]["step"] == 8 and r["kill"]["lost_steps"] == 0
    assert r["kill"]["kill_to_next_step_s"] > 0
    g = r["torchrun_dcp_async"]  # the same SIGKILL in both, torchrun restarted once
    assert g["kill_step"] == 8 and g["spares"]["failures"] == g["restart"]["failures"] == 1
    assert g["restart"]["restarts"]["resumed_from"][-1] in (0, 4)  # its last complete save
    assert g["ratio"] > 0
    assert len(pipeline.goals(r)) == 3 and pipeline.headline(r)
    assert "| SIGKILL of a stage's rank in a send/recv -> next step |" in \
        "\n".join(pipeline.markdown(r))

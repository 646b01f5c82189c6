"""A very short `phoenixft bench sharded`: the on/off run, the memory figure, the kill run
(phoenixft and torchrun + dcp.async_save through the same SIGKILL: recovery figures and
goodput) all happen and are reported with their goals; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import sharded

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_sharded_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    sharded.register(parser.add_subparsers())
    out = tmp_path / "sharded.json"
    args = parser.parse_args(["sharded", "--nproc", "2", "--preset", "tiny", "--blocks", "2",
                              "--kill-steps", "12", "--ckpt-every", "4", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert r["blocks"]["pairs"] >= 1 and r["copies"] == 2  # its own copy and one replica
    assert r["host_per_shard"] == pytest.approx(2 * r["copies"], rel=0.01)
    assert r["kill"]["step"] == 8 and r["kill"]["lost_steps"] == 0
    assert r["kill"]["kill_to_next_step_s"] > 0
    g = r["torchrun_dcp_async"]  # the same SIGKILL in both, torchrun restarted once
    assert g["kill_step"] == 8 and g["spares"]["failures"] == g["restart"]["failures"] == 1
    assert g["restart"]["restarts"]["resumed_from"][-1] in (0, 4)  # its last complete save
    assert g["ratio"] > 0
    assert len(sharded.goals(r)) == 3 and sharded.headline(r)
    assert "| host memory per rank / shard |" in "\n".join(sharded.markdown(r))

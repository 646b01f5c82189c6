"""A very short `phoenixft bench goodput`: one SIGKILL for ReCoVer and for the torchrun
baseline, checking what the benchmark reports, never how fast anything was.

The fault fires when the job starts step 8 (the worker kills itself there), not after a
number of seconds: a tiny job can finish all its steps within any fixed delay."""

import argparse
import json

import pytest

from phoenixft.bench import goodput

pytestmark = pytest.mark.integration


def test_goodput_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    goodput.register(parser.add_subparsers())
    out, plot = tmp_path / "goodput.json", tmp_path / "goodput.png"
    args = parser.parse_args([
        "goodput", "--modes", "shrink,restart", "--preset", "tiny", "--steps", "20",
        "--nproc", "2", "--microbatches", "4", "--failures", "1", "--fault-steps", "8",
        "--ckpt-every", "5", "--timeout", "90",
        "--out", str(out), "--plot", str(plot)])

    assert args.func(args) == 0

    result = json.loads(out.read_text())
    shrink, restart = result["modes"]["shrink"], result["modes"]["restart"]
    for r in (shrink, restart):
        assert r["completed"] and r["final_step"] == 20
        assert r["failures"] == 1 and len(r["kill_to_next_step_s"]) == 1
        assert r["kills"][0]["step"] == 7  # killed as it started step 8
        assert r["eff_steps_s"] > 0 and r["tokens_s"] == pytest.approx(
            r["eff_steps_s"] * result["tokens_per_step"])
    assert (shrink["workers_start"], shrink["workers_end"]) == (2, 1)
    assert shrink["recoveries"] and shrink["recoveries"][0]["replacement"] is None
    # torchrun restarted the whole group once and resumed from a checkpoint.
    assert restart["restarts"]["attempts"] == [0, 1]
    assert restart["restarts"]["resumed_from"][0] == 0
    assert restart["restarts"]["resumed_from"][1] == 5  # the last checkpoint before step 8
    assert restart["vs_restart"] == pytest.approx(1.0)
    assert plot.stat().st_size > 0


def test_goodput_smoke_hsdp(tmp_path):
    """--dp-shard 2: 2 replica groups x 2 FSDP2 ranks; the SIGKILL costs its rank's group
    (the job goes on on the other, a respawned group may come back) and torchrun restarts
    the whole HSDP job from its last dcp.async_save."""
    parser = argparse.ArgumentParser()
    goodput.register(parser.add_subparsers())
    out = tmp_path / "goodput.json"
    args = parser.parse_args([
        "goodput", "--dp-shard", "2", "--modes", "shrink,restart", "--preset", "tiny",
        "--steps", "20", "--nproc", "4", "--microbatches", "4", "--failures", "1",
        "--fault-steps", "8", "--ckpt-every", "5", "--timeout", "120",
        "--out", str(out), "--plot", str(tmp_path / "goodput.png")])

    assert args.func(args) == 0

    result = json.loads(out.read_text())
    assert result["layout"] == "hsdp 2x2"
    shrink, restart = result["modes"]["shrink"], result["modes"]["restart"]
    for r in (shrink, restart):
        assert r["completed"] and r["final_step"] == 20 and r["failures"] == 1
        assert r["kills"][0]["step"] == 7
    [rec] = shrink["recoveries"]
    assert rec["replacement"] is None and rec["source"] == "resharded_4_to_2"
    assert 2 in {world for _, _, world, _ in shrink["progress"]}  # one group went on
    assert shrink["processes"] == "4, up to 2 respawned"
    # the restart loads the newest complete checkpoint: step 5's when its async save had
    # finished by the kill three steps later, else none (seen once in CI, under load);
    # torchrun's behaviour either way, and this smoke test is about the bench, not its pace
    first, again = restart["restarts"]["resumed_from"]
    assert first == 0 and again in (0, 5), restart["restarts"]


def test_goodput_refuses_an_hsdp_shape_it_cannot_run(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    goodput.register(parser.add_subparsers())
    for bad, why in ((["--dp-shard", "4"], "at least 2 replica groups"),
                     (["--dp-shard", "3"], "must divide --nproc 4"),
                     (["--dp-shard", "2", "--microbatches", "8"], "give --microbatches 4")):
        args = parser.parse_args(["goodput", "--nproc", "4", "--microbatches", "4", *bad,
                                  "--modes", "shrink", "--interval", "5",
                                  "--out", str(tmp_path / "g.json")])
        with pytest.raises(SystemExit, match=why):
            args.func(args)

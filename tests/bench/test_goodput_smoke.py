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

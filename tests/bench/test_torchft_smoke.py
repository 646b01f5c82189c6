"""A very short `phoenixft bench torchft`: plain DDP, phoenixft and torchft 0.2.0 (the test
extra installs it) train the same tiny job and each loses a member to a SIGKILL (step times
from the steps before it); checks what the benchmark reports, never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import torchft_side

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_torchft_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    torchft_side.register(parser.add_subparsers())
    out = tmp_path / "torchft.json"
    args = parser.parse_args(["torchft", "--preset", "tiny", "--steps", "16", "--kill-step", "6",
                              "--no-free-runs", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert r["torchft_version"].startswith("0.2.0") and r["ddp_step_s"] > 0
    px, tf = r["rows"]["phoenixft"], r["rows"]["torchft"]
    for row in (px, tf):
        assert row["step_s"] > 0 and row["kill_to_survivor_step_s"] > 0
    # phoenixft's spare took the rank: nothing went untrained
    assert px["microbatches_not_trained"] == 0 and px["lost_steps"] <= 1
    # torchft's survivor trained on alone, on its own share of each step, while the killed
    # group restarted (a new process: seconds)
    assert tf["restart_to_ready_s"] > 0
    assert tf["steps_short_of_data"] >= 1
    assert tf["microbatches_not_trained"] == 4 * tf["steps_short_of_data"]
    assert [g["name"] for g in r["goals"]][0].startswith("survivor stall")


@pytest.mark.timeout(400)
def test_torchft_bench_smoke_hsdp(tmp_path):
    """--hsdp 2: 2 replica groups x 2 FSDP2 ranks on both sides, group 1's last rank
    SIGKILLed; torchft's surviving group trains on its own 2 microbatches a step while the
    killed group restarts, phoenixft's steps keep all 4."""
    parser = argparse.ArgumentParser()
    torchft_side.register(parser.add_subparsers())
    out = tmp_path / "torchft.json"
    args = parser.parse_args(["torchft", "--hsdp", "2", "--preset", "tiny", "--steps", "20",
                              "--kill-step", "8", "--no-free-runs", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert r["layout"] == "hsdp 2x2" and r["microbatches"] == 4 and r["ddp_step_s"] > 0
    px, tf = r["rows"]["phoenixft"], r["rows"]["torchft"]
    for row in (px, tf):
        assert row["step_s"] > 0 and row["kill_to_survivor_step_s"] > 0
    assert px["microbatches_not_trained"] == 0 and px["lost_steps"] <= 1
    assert px["how"] in ("swapped inside its group (a respawned worker was ready)",
                         "its group left, then came back")
    assert tf["restart_to_ready_s"] > 0 and tf["steps_short_of_data"] >= 1
    assert tf["microbatches_not_trained"] == 2 * tf["steps_short_of_data"]

"""A very short `phoenixft bench checkpoint`: every mode and scenario runs and is reported,
with its goals; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import checkpoint

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_checkpoint_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    checkpoint.register(parser.add_subparsers())
    out = tmp_path / "checkpoint.json"
    args = parser.parse_args(["checkpoint", "--preset", "tiny", "--steps", "4", "--every", "2",
                              "--threads", "1", "--dir", str(tmp_path / "ckpt"), "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert set(r["modes"]) == {"none", "torch.save", "dcp.save", "dcp.async_save",
                               "phoenixft, no checkpoint", "phoenixft"}
    for mode in ("torch.save", "dcp.save", "dcp.async_save", "phoenixft"):
        for freq in ("1", "2"):
            assert r["modes"][mode][freq]["durable_s"] > 0
    for by_freq in r["modes"].values():
        assert all(x["step_vs_none"] > 0 for x in by_freq.values())
    every_step = r["modes"]["phoenixft"]["1"]
    # records at every stride-th step (a power of two), and the last step durable at the end
    assert every_step["records"] >= 1 and every_step["last_step"] == 4
    assert every_step["stride"] >= 1 and every_step["stride"] & (every_step["stride"] - 1) == 0
    for s in r["scenarios"].values():
        assert 0 <= s["delta_fraction"] <= 1.5 and s["dcp_bytes"] > 0
    assert r["scenarios"]["adapters"]["fixed_bytes_once"] > r["scenarios"]["adapters"]["delta_bytes"]
    assert [g["name"] for g in r["goals"]] and all(isinstance(g["met"], bool) for g in r["goals"])
    assert (r["processes"], r["threads"]) == (1, 1)

"""A very short `phoenixft bench serve-ft`: the log-overhead pairs, recovery at one context
(replay + next token, warm re-prefill, cold restart in a real subprocess) and the end-to-end
SIGKILL run are all measured and reported with their goals; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import serve_ft

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_serve_ft_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    serve_ft.register(parser.add_subparsers())
    out = tmp_path / "serve_ft.json"
    args = parser.parse_args(["serve-ft", "--tiny", "--contexts", "256", "--requests", "4",
                              "--blocks", "4", "--decode-steps", "4", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    o = r["log_overhead"]
    assert o["pairs"] == 4 and o["ratio"] > 0 and o["se"] >= 0 and o["coalesced"] >= 0
    assert o["epochs"] > 0 and o["merged_steps"] >= 0
    assert o["log_bytes_per_token"] > 0
    (row,) = r["recovery"]
    assert row["context"] == 256 and row["records"] > 0 and row["log_bytes"] > 0
    assert 0 < row["phoenixft_s"] and 0 < row["warm_reprefill_s"] < row["cold_restart_s"]
    e = r["end_to_end"]
    assert e["requests"] > 0 and e["kill_to_next_token_s"] > 0
    assert [g["name"] for g in r["goals"]] and all(isinstance(g["met"], bool) for g in r["goals"])

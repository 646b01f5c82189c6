"""A short `phoenixft bench regroup`: both runs (every group rebuilt, whole groups kept)
happen through the same SIGKILL and are reported with their goals; the communicators
each rebuilt are counted (what the code does, not how fast)."""

import argparse
import json

import pytest

from phoenixft.bench import regroup

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_regroup_bench_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    regroup.register(parser.add_subparsers())
    out = tmp_path / "regroup.json"
    args = parser.parse_args(["regroup", "--steps", "5", "--kill-step", "3", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    rows = {x["mode"]: x for x in r["rows"]}
    assert r["dead_rank"] == 5 and r["same_digest"]
    assert len(rows["rebuild"]["rebuilt"]) == rows["rebuild"]["communicators"] == 7
    kept = set(rows["rebuild"]["rebuilt"]) - set(rows["keep"]["rebuilt"])
    assert kept == {"dp_shard.0.0", "dp_shard.1.0", "dp_shard.3.0", "dp_replicate.0"}
    assert rows["keep"]["build_s_by_size"] and rows["keep"]["recover_s"] > 0
    assert len(regroup.goals(r)) == 2 and regroup.headline(r)
    assert "| whole groups kept | 3 of 7 | none |" in "\n".join(regroup.markdown(r))
    assert all(g.met for g in regroup.goals(r))

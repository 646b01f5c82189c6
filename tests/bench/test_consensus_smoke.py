"""A very short `phoenixft bench consensus`: every mode runs and is reported; the slow
rank is named in each faulted mode and swapped in `swap`, each flipped bit is found and
its rank quarantined; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import consensus

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_consensus_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    consensus.register(parser.add_subparsers())
    out = tmp_path / "consensus.json"
    args = parser.parse_args(["consensus", "--steps", "20", "--noisy-steps", "8",
                              "--microbatches", "6", "--recompute-every", "5",
                              "--slow-step", "5", "--window", "6", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    rows = r["rows"]
    assert list(rows) == ["clean", "nofp", "fp_blocks", "fp_blocks_sep", "k8", "slow", "swap",
                          "rebalance", "noisy",
                          "noisy2", "freeze", "recompute", "wrong", "flip_grad", "flip_param",
                          "flip_optim"]
    for mode in ("slow", "swap", "rebalance", "freeze"):
        assert rows[mode]["detected_after_steps"] is not None, mode
        assert rows[mode]["steps"] == 20 and rows[mode]["failures"] == 0
    # (named again when its freezes left the window and came back: with 25 ms steps one in
    # two or three holds a 150 ms freeze)
    assert {(x["rank"], x["why"]) for x in rows["freeze"]["stragglers"]} == {(1, "stalled")}
    # found at the first check step from the fault (step 5) on, its rank swapped
    assert (rows["wrong"]["detected_after_steps"], rows["wrong"]["quarantined"]) == (0, ["n0w1"])
    assert rows["recompute"]["digest_as_clean"] and rows["wrong"]["digest_as_clean"]
    assert 0 < r["recompute_cost"] < 1
    assert rows["swap"]["swapped"] == ["n0w1"] and rows["slow"]["swapped"] == []
    assert rows["clean"]["vs_clean"] == 1.0
    for mode, after in (("flip_grad", 1), ("flip_param", 1), ("flip_optim", 1)):
        row = rows[mode]
        assert (row["detected_after_steps"], row["quarantined"]) == (after, ["n0w1"]), mode
        assert row["failures"] == 1 and row["digest_as_clean"], mode
    assert rows["k8"]["digest_as_clean"] and rows["nofp"]["digest_as_clean"]
    assert 0 < r["digest_share_of_step"] < 1 and 0 < r["vote_wait_share_of_step"] < 1
    assert -1 < r["fingerprint_cost"] < 1 and -1 < r["fingerprint_cost_k8"] < 1
    assert rows["fp_blocks"]["blocks"]["pairs"] >= 3 and rows["fp_blocks"]["digest_as_clean"]
    assert -1 < r["fingerprint_cost_in_run"] < 1 and r["fingerprint_cost_in_run_se"] >= 0
    assert -1 < r["fingerprint_cost_in_run_separate"] < 1
    assert [g["name"].split()[0] for g in r["goals"]] == ["fingerprints'", "straggler", "false",
                                                          "recomputation's", "wrong", "a", "a"]

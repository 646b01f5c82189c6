"""A small `phoenixft bench control-plane`: the counts it reports are the protocol's, exactly
(every member reads the plan's change, records its source and acknowledges once a
failure; the spares read the change too), a hang is found by the members' agents, and
the scaling figures are fitted; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import control_plane

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_control_plane_counts(tmp_path):
    parser = argparse.ArgumentParser()
    control_plane.register(parser.add_subparsers())
    out = tmp_path / "cp.json"
    args = parser.parse_args(["control-plane", "--members", "16", "32", "--per-node", "4",
                              "--failures", "1", "--steady", "0.5", "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert [row["members"] for row in r["rows"]] == [16, 32]
    for run in r["runs"]:
        n = run["members"]
        exit_, hang = run["failures"]
        assert (exit_["how"], hang["how"]) == ("exit", "hang")
        for f in (exit_, hang):
            assert f["world_size"] == n  # a spare took the rank
            assert f["detect_s"] >= 0 and f["acked_s"] >= 0
        # the exit: its agent's report (add + set); each of the n members and the one
        # spare left reads whether a newer plan is out (check) and the change (get); each
        # member records its source (set) and acknowledges (add); rank 0 sets its record
        # and progress; the last acknowledgement commits (check, get, multi_set)
        assert exit_["member_ops"] == {"add": n + 1, "set": n + 3, "check": n + 2,
                                       "get": n + 2, "multi_set": 1}
        # the hang: no report from the member; its agent's hang report instead goes over
        # the agents' connection, so the members' own requests are the plan's alone
        # (no spare is left to read it)
        assert hang["member_ops"] == {"add": n, "set": n + 2, "check": n + 1,
                                      "get": n + 1, "multi_set": 1}
        assert hang["detect_s"] >= 3.0  # the heartbeat timeout, seen by the agent
        assert exit_["plan_bytes"] > 0 and exit_["protocol_bytes"] < n * exit_["plan_bytes"]
        assert run["steady"]["heartbeats_s"] > 0 and run["steady"]["leader_requests_s"] > 0
    assert set(r["exponents"]) >= {"control_s", "protocol_requests", "protocol_bytes"}
    assert r["goals"] == []  # the goal is stated at 4,096 members only

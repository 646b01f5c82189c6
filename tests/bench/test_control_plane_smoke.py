"""A small `phoenixft bench control-plane`: the counts it reports are the protocol's, exactly
(per failure each node's agent reads the plan's change once and hands it to its workers
in shared memory; each node's last member to join acknowledges the node's snapshot
copies, and records the node's restore sources where they are read, one request each),
a hang is found by the
members' agents, start-up bytes grow as N, and the scaling figures are fitted; never how
fast anything was."""

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
        nodes = n // 4
        # the exit: its agent's report (add + set); each node's relay reads the change
        # (get); each node's last member adds the node's acknowledgements (add); the
        # node holding the replaced rank and rank 0's node (one node or two) record
        # their members' sources (set); rank 0 sets its record and progress; the last
        # acknowledgement commits (check, get, multi_set). Per node, not per member.
        for f in (exit_, hang):
            assert f["source_nodes"] in (1, 2)
        assert exit_["member_ops"] == {"add": nodes + 1, "set": exit_["source_nodes"] + 3,
                                       "check": 1, "get": nodes + 1, "multi_set": 1}
        # the hang: no report from the member (its agent's hang report goes over the
        # agents' connection)
        assert hang["member_ops"] == {"add": nodes, "set": hang["source_nodes"] + 2,
                                      "check": 1, "get": nodes + 1, "multi_set": 1}
        assert hang["detect_s"] >= 3.0  # the heartbeat timeout, seen by the agent
        assert exit_["plan_bytes"] > 0 and exit_["protocol_bytes"] < n * exit_["plan_bytes"]
        assert run["steady"]["heartbeats_s"] > 0 and run["steady"]["leader_requests_s"] > 0
    assert set(r["exponents"]) >= {"control_s", "protocol_requests", "protocol_bytes"}
    # start-up: registrations, and the first plan read once a node (a few bytes): O(N)
    assert r["exponents"]["start_bytes"] <= 1.1
    assert r["goals"] == []  # the goals are stated at 16,384 members only

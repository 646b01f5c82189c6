"""The fault matrix: kinds of fault x the phase of training they strike, with real faults.

Outcome rule for every cell: the job finishes with the failure-free final state digest, or
it stops within a deadline with a clear message. Never a hang, never a wrong digest
reported as success. One job per kind runs that kind in every phase, one fault after the
other, each recovered by its own spare (docs/reliability.md has the table and names the
test for every cell; whole nodes, the leader and shared memory deleted without a death
are in test_hosts.py, test_hotswap.py and test_lifecycle.py)."""

from __future__ import annotations

import pytest

from tests.support.jobs import failure_free, run, run_two_nodes

pytestmark = [pytest.mark.integration]
STEPS = 30

PHASES = {  # where, in the order the faults fire (fault k creates generation k)
    "start": "step=4",
    "recovery": "gen=1",  # while recovering from the first fault; strikes its spare
    "microbatch": "step=7:microbatch=0",
    "reduce": "step=10:phase=reduce",
    "update": "step=13:phase=update",
    "snapshot": "step=16:phase=snapshot",
    "replicate": "step=19:phase=replicate",
    "commit": "step=22:phase=commit",
}


def specs(kind: str, phases: list[str]) -> list[str]:
    out = []
    for i, p in enumerate(phases):
        rank = 1 if p == "recovery" else i % 2  # the recovery fault hits the spare of fault 1
        out += ["--inject", f"{kind}:rank={rank}:{PHASES[p]}"]
    return out


def survives(tmp_path, tmp_path_factory, kind: str, phases: list[str], *extra: str):
    ref = failure_free(tmp_path_factory, 2, STEPS)
    job = run(tmp_path, "--nproc", "2", "--spares", str(len(phases)), *extra,
              *specs(kind, phases), steps=STEPS, timeout=300)
    assert job.rc == 0, job.out[-4000:]
    s = job.summary
    assert s["final_state_digest"] == ref["final_state_digest"]
    assert s["losses"] == ref["losses"]
    assert not s["problems"]  # every fault fired
    fired = job.of("inject")
    assert len(fired) == len(phases) == len(s["failures"])
    for e, p in zip(fired, phases):  # each fault struck where it was meant to
        if p == "recovery":
            assert e["gen"] == 1
        elif p == "microbatch":
            assert e["microbatch"] == 0
        elif p != "start":
            assert e["phase"] == p
    assert all(r["lost_steps"] <= 1 for r in s["recoveries"])
    return job


@pytest.mark.timeout(400)
def test_kill_in_every_phase(tmp_path, tmp_path_factory):
    job = survives(tmp_path, tmp_path_factory, "kill", list(PHASES))
    # Each spare computed the dead rank's microbatch ahead from the node's snapshots, and
    # every completed recovery kept that work (even where the survivors' own step was
    # rolled back: a death during the optimizer update); the final state above is still
    # the failure-free one. (A generation struck during its recovery leaves no record.)
    ahead = {e["gen"] for e in job.of("computing_ahead")}
    recovered = {r["gen"]: r for r in job.of("recovered")}
    assert len(ahead) == len(PHASES) and set(recovered) <= ahead, (ahead, recovered)
    assert all(r["in_step"] for r in recovered.values()), recovered
    kept = {e["gen"] for e in job.of("in_step_recovery") if e["kept"] and
            e["wid"] in {a["wid"] for a in job.of("computing_ahead")}}
    assert set(recovered) <= kept, (kept, recovered)


@pytest.mark.timeout(400)
def test_hang_in_every_phase(tmp_path, tmp_path_factory):
    job = survives(tmp_path, tmp_path_factory, "stop",
                   [p for p in PHASES if p != "recovery"], "--heartbeat-timeout", "2")
    assert all(f["kind"] == "hang" for f in job.summary["failures"])


@pytest.mark.timeout(400)
def test_corrupted_snapshot_then_death_restores_from_the_replica(tmp_path, tmp_path_factory):
    job = survives(tmp_path, tmp_path_factory, "corrupt", ["start", "reduce", "snapshot", "commit"],
                   "--replicas", "1")  # one node: the replica must be asked for
    sources = {r["source"] for r in job.summary["recoveries"]}
    assert "local_snapshot" not in sources, "a corrupt snapshot was loaded"
    assert [e["copies"] for e in job.of("snapshot_size")] == [2]


@pytest.mark.timeout(200)
def test_a_same_node_copy_damaged_in_the_copy_commits_without_it(tmp_path, tmp_path_factory):
    """`--replicas 1` on one node, rank 0's copy of rank 1's snapshot 10 damaged as it is
    read: that copy is rejected and named, and step 10 commits without it at once (before,
    the copy went unacknowledged and the commit waited out its deadline)."""
    ref = failure_free(tmp_path_factory, 2, STEPS)
    job = run(tmp_path, "--nproc", "2", "--replicas", "1", "--inject", "garble:rank=0:step=10",
              steps=STEPS, timeout=150)
    assert job.rc == 0, job.out[-4000:]
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    assert not job.summary["failures"] and not job.summary["problems"]
    [damaged] = job.of("snapshot_degraded")
    assert damaged["rank"] == 0 and "rank 1's snapshot 10 was damaged in the copy" in \
        damaged["detail"], damaged
    assert 10 in {e["step"] for e in job.of("snapshot_committed")}


@pytest.mark.timeout(200)
def test_a_snapshot_damaged_in_memory_gets_its_worker_replaced(tmp_path, tmp_path_factory):
    """`--replicas 1` on one node, rank 1's own snapshot 10 damaged in shared memory as soon
    as it is written (`rot`, bad memory): its holder finds no intact copy of it, withholds
    its acknowledgement and reports rank 1, the leader fences rank 1 and gives its rank to
    the spare, which restores step 9 (10 never committed); the job ends as the
    failure-free one (before, the commit waited out its deadline and the job stopped)."""
    ref = failure_free(tmp_path_factory, 2, STEPS)
    job = run(tmp_path, "--nproc", "2", "--spares", "1", "--replicas", "1", "--inject",
              "rot:rank=1:step=10", steps=STEPS, timeout=150)
    assert job.rc == 0, job.out[-4000:]
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    assert job.summary["losses"] == ref["losses"]
    [failure] = job.of("failure")
    assert failure["kind"] == "damaged" and failure["rank"] == 1, failure
    assert "rank 0 found rank 1's own snapshot 10 is damaged" in failure["detail"], failure
    [rec] = job.summary["recoveries"]
    assert rec["kind"] == "damaged" and rec["restore_step"] == 9, rec
    assert 10 not in {e["step"] for e in job.of("snapshot_committed") if e["gen"] == 0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["update", "snapshot"])
def test_a_worker_raising_stops_the_job_with_the_error(tmp_path, where):
    # stops, never hangs: the job exits (run() fails loudly if it has not within 100 s)
    job = run(tmp_path, "--nproc", "2", "--spares", "1", "--inject",
              f"raise:rank=1:{PHASES[where]}", steps=STEPS, timeout=100)
    assert job.rc == 1
    assert "the training script raised on worker n0w1" in job.out
    assert f"InjectedFault: injected fault raise:rank=1:{PHASES[where]}" in job.out
    assert not job.of("recovered")
    [abort] = job.of("abort")  # stopped by the leader on the error, not by a deadline
    assert abort["error"], abort


@pytest.mark.timeout(120)
def test_every_copy_lost_on_one_node_stops_clearly(tmp_path):
    """All of a rank's copies live on the only node: deleting its shared memory and killing
    it leaves nothing to restore from, and the job must say so, not hang or guess."""
    job = run(tmp_path, "--nproc", "2", "--spares", "1", "--inject", "shm:rank=1:step=5",
              steps=STEPS, timeout=100)  # it exits: run() fails loudly if not within 100 s
    assert job.rc == 1
    assert "recovery is impossible: no surviving copy of rank" in job.out
    assert "restart from a persisted checkpoint (--persist, --resume), or run with --replicas 1" in job.out


@pytest.mark.timeout(300)
def test_shared_memory_deleted_and_death_on_one_of_two_nodes(tmp_path, tmp_path_factory):
    """Node 1's shared memory is deleted and its worker killed: its own snapshot and the
    replica it held are gone, but node 0 holds a replica of it, which is sent over."""
    ref = failure_free(tmp_path_factory, 2, STEPS)
    job, _ = run_two_nodes(tmp_path, (), (), "--nproc", "1", "--spares", "1", "--inject",
                           "shm:rank=1:step=8", steps=STEPS)
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    [rec] = job.summary["recoveries"]
    assert rec["rank"] == 1 and rec["replacement"] == "n1w1" and rec["source"] == "peer_memory"

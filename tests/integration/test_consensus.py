"""Silent data corruption under `phoenixft run` (data parallel, --fingerprint-every 1, the
default): a bit flipped in rank 2's state at step 5 (`flip:` fault, the process carries
on) is found. Its reduced gradients of step 5 and its parameters after step 5 by the
ranks' vote, carried in step 6's own all-reduce (the default): the job rolls back to
step 4, the last state a vote vouched for, and the spare takes rank 2's place. Its
optimizer state (held by no other rank) by its own seal of snapshot 5, before step 6's
update: the spare restores snapshot 5 and the others keep their microbatches. The job
ends bit for bit as the failure-free run. With `--fingerprint-vote separate` the vote
runs after each step's all-reduce, before its update, and 2 ranks that cannot outvote
each other replay the step's collectives to name the one whose copy differs; with the
vote carried they roll back instead."""

from __future__ import annotations

import json

import pytest

from phoenixft.observe.train_metrics import TrainMetrics
from tests.support.jobs import ROOT, run, run_script, run_two_nodes

pytestmark = [pytest.mark.integration]
STEPS = 12


# where the bit flips -> (the step whose vote finds it, the restored step, what it names)
FOUND = {"grad": (6, 4, "rank 2's reduced gradients (step 5) differ from the majority's"),
         "param": (6, 4, "rank 2's parameters (step 6) differ from the majority's"),
         "optim": (6, 5, "rank 2's optimizer state changed in memory after snapshot 5 was "
                         "copied (opt.exp_avg)")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = run(tmp_path_factory.mktemp("sdc-ref"), "--nproc", "4", "--spares", "1",
              steps=STEPS, script_args=("--data", "ids"))
    assert ref.rc == 0, ref.out[-3000:]
    assert ref.of("fingerprint_mismatch") == [] and ref.summary["quarantined"] == []
    return ref


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["grad", "param", "optim"])
def test_a_flipped_bit_is_found_and_its_rank_swapped(tmp_path, reference, where):
    job = run(tmp_path, "--nproc", "4", "--spares", "1",
              "--inject", f"flip:rank=2:step=5:where={where}", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    step, restored, found = FOUND[where]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"], vote["wids"]) == (step, [2], ["n0w2"])
    assert vote["found"] == [found]
    [f] = job.summary["failures"]
    assert (f["wid"], f["kind"]) == ("n0w2", "corrupt")
    assert job.summary["quarantined"] == ["n0w2"]
    [rec] = job.summary["recoveries"]
    assert rec["replacement"] == "n0w4" and rec["restore_step"] == restored
    kept = {e["rank"]: e["kept"] for e in job.of("in_step_recovery") if e["wid"] != "n0w4"}
    if where == "optim":  # found before step 6's update: the others keep its microbatches
        assert kept == {0: [0], 1: [1], 3: [3]}, kept
    else:  # a vote carried into step 6 finds what step 5 left: back to step 4
        assert kept == {}, kept
        [rolled] = job.of("fingerprint_rollback")
        assert (rolled["step"], rolled["to_step"], rolled["rank"]) == (6, 4, 0)
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    assert job.summary["losses"] == reference.summary["losses"]
    assert f"silent data corruption: {found}" in job.out
    # named where people look: status.json (`phoenixft status`) and the metrics
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["quarantined"] == ["n0w2"]
    assert [m["role"] for m in st["members"] if m["wid"] == "n0w2"] == ["quarantined"]
    reg = TrainMetrics(tmp_path)
    assert reg.get_sample_value("phoenixft_train_quarantined_workers") == 1
    assert reg.get_sample_value("phoenixft_train_failures_total", {"kind": "corrupt"}) == 1


@pytest.mark.timeout(240)
def test_storage_never_commits_the_step_a_vote_took_back(tmp_path, reference):
    """--persist, every step: rank 2's parameters flipped at step 5 are persisted with
    snapshot 5 before step 6's vote finds them (a record is written as soon as its slot is
    copied). The vote takes step 5 back, and storage must too: no manifest of step 5
    in the generation that computed it, so a job resumed from storage never starts from
    the flipped state. The job ends as the failure-free run, its last step in storage."""
    ckpt = tmp_path / "ckpt"
    job = run(tmp_path / "run", "--nproc", "4", "--spares", "1", "--persist", str(ckpt),
              "--persist-cpu-share", "1", "--inject", "flip:rank=2:step=5:where=param",
              steps=STEPS, script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [rolled] = job.of("fingerprint_rollback")
    assert (rolled["step"], rolled["to_step"]) == (6, 4)
    committed = [(e["gen"], e["step"]) for e in job.of("persisted")]
    assert (0, 5) not in committed, committed
    assert max(s for g, s in committed if g == 0) <= 4, committed
    assert committed[-1][1] == STEPS, committed
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]


@pytest.mark.timeout(240)
def test_without_a_spare_the_others_go_on_without_the_flipped_rank(tmp_path, tmp_path_factory):
    """3 ranks, no spare, --min-nproc 2: rank 1's optimizer state, flipped after snapshot 5,
    breaks its seal at step 6's vote, before the update, and its worker is fenced; the
    other two take its quota (ReCoVer: they keep the microbatches they finished), so
    every step consumes the failure-free run's 12 microbatches (audit) and the losses stay
    within 1e-4 of it."""
    common, script = ("--nproc", "3", "--min-nproc", "2"), ("--data", "ids", "--microbatches", "12")
    ref = run(tmp_path_factory.mktemp("sdc-shrink-ref"), *common, steps=STEPS,
              script_args=script)
    job = run(tmp_path, *common, "--inject", "flip:rank=1:step=5:where=optim", steps=STEPS,
              script_args=script)
    for j in (ref, job):
        assert j.rc == 0, j.out[-3000:]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"]) == (6, [1])
    assert job.summary["quarantined"] == ["n0w1"]
    assert job.summary["world_sizes"] == [3, 2]
    kept = {e["rank"]: e["kept"] for e in job.of("in_step_recovery")}
    assert len(kept) == 2 and all(kept.values()), kept

    def audit(j):
        return [json.loads(x) for x in (j.run_dir / "audit.jsonl").read_text().splitlines()]
    assert audit(job) == audit(ref)
    for x, y in zip(job.summary["losses"], ref.summary["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)


@pytest.mark.timeout(240)
def test_a_seal_broken_between_votes_names_its_own_rank(tmp_path, reference):
    """--fingerprint-every 4: step 6 has no vote, so rank 2 finds its optimizer state
    changed by itself and stops before its update; the others, already inside theirs,
    are interrupted when the leader replaces it and redo step 6 from snapshot 5."""
    job = run(tmp_path, "--nproc", "4", "--spares", "1", "--fingerprint-every", "4",
              "--inject", "flip:rank=2:step=5:where=optim", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["rank"], vote["step"], vote["outvoted"]) == (2, 6, [2])
    assert vote["found"] == [FOUND["optim"][2]]
    [rec] = job.summary["recoveries"]
    assert rec["replacement"] == "n0w4" and rec["restore_step"] == 5
    assert job.summary["quarantined"] == ["n0w2"]
    # (the others had updated: their step 6 microbatches are computed again)
    assert all(e["kept"] == [] for e in job.of("in_step_recovery") if e["wid"] != "n0w4")
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]


@pytest.fixture(scope="module")
def reference2(tmp_path_factory):
    """The failure-free run of 2 ranks + 1 spare (the same bits with either vote: the
    step's all-reduce buffer keeps its length)."""
    ref = run(tmp_path_factory.mktemp("sdc2-ref"), "--nproc", "2", "--spares", "1",
              steps=STEPS, script_args=("--data", "ids"))
    assert ref.rc == 0, ref.out[-3000:]
    return ref


@pytest.mark.timeout(240)
@pytest.mark.parametrize("vote,where", [("separate", "grad"), ("separate", "param"),
                                        ("carried", "grad")])
def test_two_ranks_cannot_outvote_each_other_so_a_replay_names_the_flipped_one(
        tmp_path, reference2, vote, where):
    """Separate votes: the step's collectives are replayed before its update, and the
    rank whose first copy differs from what the replay gave both is named and swapped.
    Carried votes find it after the update: nobody can be named, so the job rolls back to
    step 4 with the same members (the spare stays unused)."""
    args, ref = ("--nproc", "2", "--spares", "1"), reference2
    job = run(tmp_path, *args, "--fingerprint-vote", vote,
              "--inject", f"flip:rank=1:step=5:where={where}", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    if vote == "carried":
        [rolled] = job.of("fingerprint_rollback")
        assert (rolled["step"], rolled["to_step"], rolled["named"]) == (6, 4, [])
        assert "no strict majority says which reduced gradients are right" in rolled["why"]
        assert job.summary["failures"] == [] and job.summary["quarantined"] == []
        assert [r["gen"] for r in job.summary["rollbacks"]] == [1]
        assert {e["gen"]: e["restore_step"] for e in job.of("recovered")} == {1: 4}
        return
    step, restored = (5, 4) if where == "grad" else (6, 5)
    [replay] = [e for e in job.of("fingerprint_replay") if e["rank"] == 0]
    i = 0 if where == "grad" else 1
    first, again = replay["first"][i], replay["replayed"][i]
    assert first[0] != first[1] and again[0] == again[1] == first[0]  # rank 0's was right
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"], vote["wids"]) == (step, [1], ["n0w1"])
    assert "differed from what a replay of the step's collectives gave every rank" in \
        vote["found"][0]
    [rec] = job.summary["recoveries"]
    assert rec["replacement"] == "n0w2" and rec["restore_step"] == restored
    assert job.summary["quarantined"] == ["n0w1"]


HSDP = ROOT / "tests" / "integration" / "scripts" / "gated_hsdp.py"


HSDP_ARGS = ("--nproc", "3", "--spares", "1")
HSDP_SCRIPT = ("--steps", "8", "--dp-shard", "1")


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    ref = run_script(tmp_path_factory.mktemp("hsdp-sdc-ref"), HSDP, *HSDP_ARGS, timeout=240,
                     script_args=HSDP_SCRIPT)
    assert ref.rc == 0, ref.out[-3000:]
    return ref


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["grad", "param"])
def test_hsdp_replica_groups_outvote_the_one_whose_shards_differ(tmp_path, hsdp_reference,
                                                                 where):
    """3 replica groups of 1 FSDP2 rank each (+1 spare): the groups hold the same shards
    (cross-group gradient sum, parameters, optimizer state), so the vote is among the
    ranks at one place of every group; group 1's rank is named, swapped inside its group,
    and the job ends on the failure-free digest."""
    ref = hsdp_reference
    job = run_script(tmp_path, HSDP, *HSDP_ARGS, "--inject", f"flip:rank=1:step=4:where={where}",
                     timeout=240, script_args=HSDP_SCRIPT)
    assert job.rc == 0, job.out[-3000:]
    [vote] = job.of("fingerprint_mismatch")
    what = "reduced gradient shards (step 4)" if where == "grad" else "parameter shards (step 5)"
    assert (vote["step"], vote["outvoted"]) == (5, [1])  # (carried into step 5's all-reduce)
    assert vote["found"] == [f"rank 1's {what} differ from the majority's"]
    assert job.summary["quarantined"] == ["n0w1"]
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]


# a flip on the last step is found by the checks the job runs after its last step (what
# step 13's all-reduce would have carried), named as step 13's
LAST = {"grad": (13, "rank 2's reduced gradients (step 12) differ from the majority's"),
        "param": (13, "rank 2's parameters (step 13) differ from the majority's"),
        "optim": (13, "rank 2's optimizer state changed in memory after snapshot 12 was "
                      "copied (opt.exp_avg)")}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["grad", "param", "optim"])
def test_a_flip_on_the_last_step_is_found_before_the_job_ends(tmp_path, reference, where):
    """The job never ends, saves or reports a state its own checks would reject one step
    later: the final digest and the saved model are the failure-free run's."""
    from safetensors.torch import load_file

    job = run(tmp_path, "--nproc", "4", "--spares", "1",
              "--inject", f"flip:rank=2:step={STEPS}:where={where}", steps=STEPS,
              script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    step, found = LAST[where]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"], vote["found"]) == (step, [2], [found])
    assert job.summary["quarantined"] == ["n0w2"]
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    assert job.summary["losses"] == reference.summary["losses"]
    ours = load_file(tmp_path / "model" / "model.safetensors")
    theirs = load_file(reference.run_dir / "model" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(ours[k].equal(theirs[k]) for k in ours)


FSDP = ROOT / "examples" / "train_fsdp.py"


@pytest.mark.timeout(300)
def test_fsdp2_optimizer_flip_on_the_last_step_is_found_by_the_seal(tmp_path, tmp_path_factory):
    """A plain FSDP2 model (no replicas): its optimizer state flipped after the last
    snapshot is found by the rank's seal in the check after the last step; the job ends on
    the failure-free digest. A gradient or parameter flip, which no rank could find (no
    copy to vote with), is refused at set-up in one line instead of changing the result."""
    ref = run_script(tmp_path_factory.mktemp("fsdp-sdc-ref"), FSDP, "--nproc", "2",
                     script_args=("--steps", "6"))
    assert ref.rc == 0, ref.out[-3000:]
    job = run_script(tmp_path / "optim", FSDP, "--nproc", "2", "--spares", "1",
                     "--inject", "flip:rank=1:step=6:where=optim", script_args=("--steps", "6"))
    assert job.rc == 0, job.out[-3000:]
    [vote] = job.of("fingerprint_mismatch")
    assert (vote["step"], vote["outvoted"]) == (7, [1])
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    for where in ("grad", "param"):
        bad = run_script(tmp_path / where, FSDP, "--nproc", "2", "--inject",
                         f"flip:rank=1:step=3:where={where}", script_args=("--steps", "4"))
        assert bad.rc != 0 and bad.summary.get("final_state_digest") is None
        assert (f"phoenixft: job stopped: --inject flip:rank=1:step=3:where={where} could never "
                "be found: no other rank holds") in bad.out, bad.out[-2000:]
        assert "Traceback" not in bad.out


@pytest.mark.timeout(300)
def test_a_node_whose_workers_are_named_twice_is_quarantined_whole(tmp_path, reference):
    """Two nodes of 2 ranks (node 0 with 2 spares, node 1 with 1): rank 2's bit flips at
    step 4 and is replaced by node 1's spare (a spare on its node first); rank 3's flips at
    step 8, the second worker of node 1 named: node 1 is quarantined, so its spare, which
    now holds rank 2 and computed nothing wrong, is fenced with it, and node 0's spares take
    both ranks. The job ends as the failure-free run."""
    job, rc1 = run_two_nodes(tmp_path, ("--spares", "2"),
                             ("--spares", "1", "--inject", "flip:rank=2:step=4",
                              "--inject", "flip:rank=3:step=8"),
                             "--nproc", "2", steps=STEPS, script_args=("--data", "ids"))
    assert job.rc == 0, job.out[-3000:]
    [q] = job.of("node_quarantined")
    assert (q["node"], q["named"], q["fenced"]) == (1, ["n1w0", "n1w1"], ["n1w2"]), q
    s = job.summary
    assert s["quarantined"] == ["n1w0", "n1w1"] and s["quarantined_nodes"] == [1]
    assert [(f["wid"], f["kind"]) for f in s["failures"]] == [
        ("n1w0", "corrupt"), ("n1w1", "corrupt"), ("n1w2", "quarantined_node")]
    members = [e for e in job.of("joined") if e["gen"] == max(x["gen"] for x in job.of("joined"))]
    assert sorted(e["wid"] for e in members) == ["n0w0", "n0w1", "n0w2", "n0w3"]
    assert s["final_state_digest"] == reference.summary["final_state_digest"]
    assert s["losses"] == reference.summary["losses"]
    assert "node 1 quarantined: 2 of its workers were named (n1w0, n1w1)" in job.out


@pytest.mark.timeout(420)
def test_tp_copies_that_differ_roll_the_job_back(tmp_path, tmp_path_factory):
    """FSDP2 + tensor parallelism on a (2, 2) mesh, no spare: the ranks of a tp group hold
    the tp copies (attention, norms, embeddings) bit for bit, and vote on them. A bit
    flipped in a copy right after step 3's update, on rank 0 (which snapshots the copies,
    so snapshot 3 holds the flip) and later on rank 3 (which does not): two copies
    cannot outvote each other, so each time the job takes back the last commit and
    rolls back to the step before it with the same members, and ends on the failure-free
    digest. A gradient flip, which that vote cannot find, is refused at set-up."""
    args = ("--nproc", "4")
    script_args = ("--steps", "8", "--tp", "2")
    ref = run_script(tmp_path_factory.mktemp("tp-sdc-ref"), FSDP, *args, timeout=300,
                     script_args=script_args)
    assert ref.rc == 0, ref.out[-3000:]
    assert ref.of("fingerprint_rollback") == [] and ref.summary["rollbacks"] == []
    job = run_script(tmp_path / "flip", FSDP, *args, "--inject", "flip:rank=0:step=3:where=param",
                     "--inject", "flip:rank=3:step=6:where=param", timeout=300,
                     script_args=script_args)
    assert job.rc == 0, job.out[-3000:]
    rolled = job.of("fingerprint_rollback")
    assert [(e["step"], e["to_step"], e["rank"]) for e in rolled] == [(4, 2, 0), (7, 5, 0)]
    assert all("no strict majority says which tp-copied parameter shards are right"
               in e["why"] for e in rolled), rolled
    assert [r["gen"] for r in job.summary["rollbacks"]] == [1, 2]
    assert job.summary["failures"] == [] and job.summary["quarantined"] == []
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    restored = {e["gen"]: e["restore_step"] for e in job.of("recovered")}
    assert restored == {1: 2, 2: 5}, restored
    bad = run_script(tmp_path / "grad", FSDP, *args, "--inject", "flip:rank=1:step=3:where=grad",
                     script_args=script_args)
    assert bad.rc != 0 and bad.summary.get("final_state_digest") is None
    assert ("could never be found: no other rank holds this one's gradients" in bad.out
            and "flip where=param" in bad.out), bad.out[-2000:]

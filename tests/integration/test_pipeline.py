"""Pipeline parallelism under `phoenixft run` (gloo, real processes, real SIGKILL/SIGSTOP).

- The same pipelined script (examples/train_pp.py) under plain torchrun and under
  phoenixft run: final parameters equal bit for bit, losses within the float32 rounding of
  the reported sum.
- pp=2 x 2 replicas + 1 spare: a stage's rank killed as it sends or receives activations
  (forward) or gradients (backward), or stopped as it receives: the spare takes its
  place, every other rank keeps its process, and the final state equals the failure-free
  run's bit for bit; the untouched replica keeps the microbatches it finished.
- No spare: the dead rank's pipeline replica leaves whole, the other takes its
  microbatches (each step's audit equals the failure-free run's), and --respawn brings a
  replica back.
- pp=2 with FSDP2 inside each stage (dp_shard=2), or tensor parallelism (tp=2), + 1 spare:
  a rank killed, same digest.
- The whole job killed: --resume onto 2 stages from a 4-stage run's records, and `ckpt
  export` of the 4-stage checkpoint is the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from phoenixft.checkpoint.tiers import FsspecTier
from phoenixft.models.llama import LlamaForCausalLM, preset
from tests.support.jobs import PHOENIXFT, ROOT, plain_torchrun, run_script

pytestmark = [pytest.mark.integration]
PP = ROOT / "examples" / "train_pp.py"
GATED = ROOT / "tests" / "integration" / "scripts" / "gated_pp.py"
STEPS = 6
EXAMPLE_ARGS = ("--preset", "tiny", "--layers", "4", "--microbatches", "4", "--clip", "1.0")


def _pp(tmp_path, *launch: str, script_args: tuple = (), steps: int = STEPS, nproc: int = 4):
    return run_script(tmp_path, GATED, "--nproc", str(nproc), *launch, timeout=240,
                      script_args=("--steps", str(steps), *script_args))


def _audit(job) -> list[dict]:
    return [json.loads(line) for line in (job.run_dir / "audit.jsonl").read_text().splitlines()]


def _others_kept_their_processes(job) -> None:
    """Every worker of the first generation but the dead one is in the last, same PID."""
    pids: dict[str, set[int]] = {}
    for e in job.of("joined"):
        pids.setdefault(e["wid"], set()).add(e["pid"])
    assert all(len(p) == 1 for p in pids.values()), pids
    gens = sorted({e["gen"] for e in job.of("joined")})
    first = {e["wid"] for e in job.of("joined") if e["gen"] == gens[0]}
    last = {e["wid"] for e in job.of("joined") if e["gen"] == gens[-1]}
    failed = {f["wid"] for f in job.summary["failures"]}
    assert len(failed) == 1 and first - failed <= last and len(last) == len(first)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _pp(tmp_path_factory.mktemp("pp-ref"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["world_sizes"] == [4]
    return job


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """examples/train_pp.py, 2 stages, 8 steps under phoenixft run (its final parameters
    written by rank 0 from the session's full state)."""
    d = tmp_path_factory.mktemp("pp2")
    job = run_script(d, PP, "--nproc", "2", timeout=240,
                     script_args=(*EXAMPLE_ARGS, "--pp", "2", "--steps", "8",
                                  "--out-dir", str(d / "out")))
    assert job.rc == 0, job.out[-3000:]
    return job, load_file(str(d / "out" / "stages.safetensors"))


@pytest.mark.timeout(300)
def test_the_same_script_under_phoenixft_run_ends_as_under_plain_torchrun(tmp_path, two_stages):
    job, params = two_stages
    plain_torchrun(2, PP, *EXAMPLE_ARGS, "--pp", "2", "--steps", "8", "--out-dir", str(tmp_path))
    ref = {}
    for f in sorted(tmp_path.glob("stage*.safetensors")):
        ref.update(load_file(str(f)))
    assert params.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(params[k], ref[k])] == []
    # the losses are equal but for where the microbatches' losses are summed: plain
    # torchrun sums python floats, phoenixft its float32 all-reduce buffer
    plain = json.loads((tmp_path / "losses.json").read_text())["losses"]
    assert len(job.summary["losses"]) == len(plain) == 8
    for x, y in zip(job.summary["losses"], plain):
        assert abs(x - y) <= 1e-6 * abs(y), (x, y)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase", [(3, "forward"), (3, "backward")])
def test_a_stage_rank_killed_in_its_send_or_recv_is_hot_swapped(tmp_path, reference,
                                                                 rank, phase):
    job = _pp(tmp_path, "--spares", "1", "--inject", f"kill:rank={rank}:step=4:phase={phase}")
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    assert job.summary["losses"] == reference.summary["losses"]
    assert job.summary["world_sizes"] == [4, 4]
    assert f"takes rank {rank}" in job.out
    _others_kept_their_processes(job)
    # replica 0 (ranks 0, 1) kept its microbatches of step 4; replica 1 redid its own
    steps = {e["rank"]: (e["kept"], e["recompute"]) for e in job.of("in_step_recovery")}
    assert steps == {0: ([0, 1], []), 1: ([0, 1], []), 2: ([], [2, 3]), 3: ([], [2, 3])}


@pytest.mark.timeout(300)
def test_a_stage_rank_stopped_in_a_recv_is_found_by_its_heartbeat(tmp_path, reference):
    job = _pp(tmp_path, "--spares", "1", "--inject", "stop:rank=3:step=4:phase=forward")
    assert job.rc == 0, job.out[-3000:]
    [failure] = job.summary["failures"]
    assert "heartbeat" in json.dumps(failure), failure
    assert job.summary["final_state_digest"] == reference.summary["final_state_digest"]
    _others_kept_their_processes(job)


@pytest.mark.timeout(300)
def test_without_a_spare_a_replica_leaves_and_comes_back(tmp_path, reference):
    job = _pp(tmp_path, "--min-nproc", "2", "--respawn", "2",
              "--inject", "kill:rank=3:step=4:phase=forward",
              script_args=("--hold-at", "5", "--spares", "2"))
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["world_sizes"] == [4, 2, 4]
    assert "ranks 2, 3 leave with their replica group" in job.out
    assert _audit(job) == _audit(reference)
    for x, y in zip(job.summary["losses"], reference.summary["losses"], strict=True):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)
    # the surviving replica kept its microbatches of step 4 and took the other's
    first = {e["rank"]: (e["kept"], e["recompute"]) for e in job.of("in_step_recovery")}
    assert first == {0: ([0, 1], [2, 3]), 1: ([0, 1], [2, 3])}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("inside", ["--dp-shard", "--tp"])
def test_fsdp2_or_tensor_parallelism_inside_each_stage_hot_swaps_a_rank(tmp_path, inside):
    """pp 2 x dp_shard 2 (FSDP2 in each stage), or pp 2 x tp 2 (each stage's MLPs cut over
    a tp group, its two ranks running the same pipeline): rank 3 killed, same digest."""
    args = (inside, "2")
    ref = _pp(tmp_path / "ref", script_args=args)
    assert ref.rc == 0, ref.out[-3000:]
    job = _pp(tmp_path / "kill", "--spares", "1", "--inject", "kill:rank=3:step=4:phase=backward",
              script_args=args)
    assert job.rc == 0, job.out[-3000:]
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    _others_kept_their_processes(job)


@pytest.mark.timeout(400)
def test_the_whole_job_killed_resumes_onto_fewer_stages(tmp_path, two_stages):
    """4 stages on 4 ranks, the whole job SIGKILLed at step 6; --resume onto 2 stages on 2
    ranks from the 4 ranks' records: the losses of the 2-stage run that never failed (one
    pipeline replica computes what the unpipelined model does, at any depth). `ckpt
    export` of the 4-stage records is the whole model, and of the final step the model
    as trained."""
    ref, _ = two_stages
    ckpt = tmp_path / "ckpt"
    persist = ("--persist", str(ckpt), "--persist-every", "2", "--persist-cpu-share", "1")
    killed = run_script(tmp_path / "killed", PP, "--nproc", "4", *persist,
                        "--inject", "node:rank=0:step=6", timeout=240,
                        script_args=(*EXAMPLE_ARGS, "--pp", "4", "--steps", "8"))
    assert killed.rc == -9, killed.out[-2000:]
    newest = FsspecTier(str(ckpt)).manifests()[-1]
    out = tmp_path / "hf"
    subprocess.run([*PHOENIXFT, "ckpt", "export", str(ckpt), "--to", str(out)], cwd=ROOT,
                   check=True, timeout=120)
    exported = load_file(str(out / "model.safetensors"))
    full = LlamaForCausalLM(dataclasses.replace(preset("tiny"), num_hidden_layers=4))
    assert {k: v.shape for k, v in exported.items()} == \
        {k: v.shape for k, v in full.state_dict().items()}
    resumed = run_script(tmp_path / "resumed", PP, "--nproc", "2", *persist, "--resume",
                         timeout=240, script_args=(*EXAMPLE_ARGS, "--pp", "2", "--steps", "8",
                                                   "--out-dir", str(tmp_path / "final")))
    assert resumed.rc == 0, resumed.out[-3000:]
    start = resumed.summary["resumed_from"]
    assert 0 < start < 6 and resumed.of("resumed")[0]["from_world_size"] == 4
    assert len(resumed.summary["losses"]) == 8 - start
    for x, y in zip(resumed.summary["losses"], ref.summary["losses"][start:]):
        assert abs(x - y) <= 1e-4 * abs(y), (x, y)
    assert start == newest
    # the final step's records, exported, are the trained model (every stage's parameters
    # as the session holds them at the end, none of them the initial copy a rank keeps
    # of another stage's layers)
    subprocess.run([*PHOENIXFT, "ckpt", "export", str(ckpt), "--to", str(tmp_path / "hf8")],
                   cwd=ROOT, check=True, timeout=120)
    final = load_file(str(tmp_path / "hf8" / "model.safetensors"))
    trained = load_file(str(tmp_path / "final" / "stages.safetensors"))
    assert final.keys() == trained.keys()
    assert [k for k in final if not torch.equal(final[k], trained[k])] == []


@pytest.mark.timeout(300)
def test_a_slow_stage_is_named_and_its_neighbours_are_not(tmp_path):
    """Rank 3 (stage 1 of replica 1) computes 10x slower: it is compared with the same
    stage's rank of the other replica and named with its stage; rank 2, its replica's
    other stage, waits on it in its send/recv, which is not its compute: not flagged."""
    # (ratio 4: a stage computes a few ms a microbatch here, and a machine under a test
    # suite's load stretches some steps of some ranks by more than 2x)
    job = _pp(tmp_path, "--straggler", "report", "--straggler-window", "4",
              "--straggler-ratio", "4", "--inject", "slow:rank=3:step=2:factor=10",
              steps=10)
    assert job.rc == 0, job.out[-3000:]
    found = job.of("straggler")
    assert [e["rank"] for e in found] == [3], found
    assert found[0]["where"] == "stage 1 of pipeline replica 1"
    assert "rank 3 (n0w3, stage 1 of pipeline replica 1) is a straggler" in job.out


@pytest.mark.timeout(400)
def test_the_vote_across_three_replicas_finds_a_flipped_stage(tmp_path):
    """3 replicas of 2 stages: the ranks of one stage vote; a bit flipped in rank 3's
    parameters (stage 1 of replica 1) is outvoted, a spare takes its place, and the final
    state equals the run without the flip."""
    ref = _pp(tmp_path / "ref", "--fingerprint-every", "1", steps=5, nproc=6)
    assert ref.rc == 0, ref.out[-3000:]
    job = _pp(tmp_path / "flip", "--spares", "1", "--fingerprint-every", "1",
              "--inject", "flip:rank=3:step=3:where=param", steps=5, nproc=6)
    assert job.rc == 0, job.out[-3000:]
    [failure] = job.summary["failures"]
    assert "differ from the majority" in json.dumps(failure), failure
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]

"""A torchrun + DDP user moves over: the DDP script and its phoenixft twin
(examples/migrate/) train to the same losses and the same saved model, the twin survives a
SIGKILL with a spare, the DDP script itself stops at once with one line saying what to
change, torchrun's environment is there, and Slurm's variables alone start two nodes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.support.jobs import PHOENIXFT, ROOT, kill_members, kill_tree, load, run_script

pytestmark = [pytest.mark.integration]

EXAMPLES = ROOT / "examples" / "migrate"
ARGS = ("--steps", "12", "--windows", "48")  # 6 batches per rank and epoch: 2 epochs
_RUNS: dict[str, object] = {}


def _reference(tmp_path_factory):
    """The phoenixft twin without faults (shared by two tests)."""
    if "ref" not in _RUNS:
        d = tmp_path_factory.mktemp("twin")
        _RUNS["ref"] = run_script(d, EXAMPLES / "ddp_phoenixft.py", "--nproc-per-node", "2",
                                  script_args=(*ARGS, "--out", str(d / "model")))
    return _RUNS["ref"]


@pytest.mark.timeout(240)
def test_the_ddp_script_and_its_twin_train_alike(tmp_path, tmp_path_factory):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / "ddp_torchrun.py"), *ARGS, "--losses", str(tmp_path / "losses.json"),
           "--out", str(tmp_path / "model")]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, _ = p.communicate(timeout=180)
    finally:
        kill_tree(p.pid)
    assert p.returncode == 0, out
    ddp = json.loads((tmp_path / "losses.json").read_text())
    twin = _reference(tmp_path_factory)
    assert twin.rc == 0, twin.out
    ours = twin.summary["losses"]
    assert len(ours) == len(ddp) == 12
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, ddp)), (ours, ddp)
    mine = (twin.run_dir / "model" / "model.safetensors").read_bytes()
    assert mine == (tmp_path / "model" / "model.safetensors").read_bytes()


@pytest.mark.timeout(240)
def test_the_twin_survives_a_sigkill_with_a_spare(tmp_path, tmp_path_factory):
    ref = _reference(tmp_path_factory)
    job = run_script(tmp_path, EXAMPLES / "ddp_phoenixft.py", "--nproc-per-node", "2",
                     "--spares", "1", "--inject", "kill:rank=1:step=9", script_args=ARGS)
    assert job.rc == 0, job.out
    rec = job.summary["recoveries"]
    assert len(rec) == 1 and rec[0]["replacement"] != rec[0]["failed_worker"]
    # mid-epoch: the spare rebuilt the dead rank's loader, schedule and RNG
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]


@pytest.mark.timeout(90)
def test_a_script_that_builds_its_own_process_group_stops_at_once(tmp_path):
    job = run_script(tmp_path, EXAMPLES / "ddp_torchrun.py", "--nproc", "2",
                     script_args=("--steps", "2"), timeout=80)
    assert job.rc != 0
    lines = [ln for ln in job.out.splitlines() if "init_process_group" in ln]
    assert lines and "remove it" in lines[0] and "docs/migrating.md" in lines[0], job.out
    assert "Traceback" not in job.out


ENV_SCRIPT = textwrap.dedent('''
    import json, os, sys, torch, phoenixft
    sess = phoenixft.Session()
    sess.setup(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"]
    env = {k: os.environ.get(k) for k in names}
    for st in sess.steps(2):
        for _ in st.microbatches():
            st.backward(sess.state.model(torch.ones(1, 2)).sum())
    out = os.path.join(os.environ["PHOENIXFT_RUN_DIR"], f"env{sess.rank}.json")
    with open(out, "w") as f:
        json.dump(dict(env, rank=sess.rank), f)
''')


@pytest.mark.timeout(120)
def test_workers_get_torchruns_environment_and_modules_run_with_m(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envtrain.py").write_text(ENV_SCRIPT)
    cmd = [*PHOENIXFT, "run", "--nproc-per-node", "2", "--standalone", "--run-dir",
           str(tmp_path / "run"), "-m", "pkg.envtrain"]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        out, _ = p.communicate(timeout=100)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path / "run")
    assert p.returncode == 0, out
    envs = [json.loads((tmp_path / "run" / f"env{r}.json").read_text()) for r in (0, 1)]
    job = json.loads((tmp_path / "run" / "summary.json").read_text())
    for r, e in enumerate(envs):
        assert e["RANK"] == str(r) == str(e["rank"]) and e["WORLD_SIZE"] == "2"
        assert e["LOCAL_WORLD_SIZE"] == "2" and e["GROUP_RANK"] == e["NODE_RANK"] == "0"
        assert e["GROUP_WORLD_SIZE"] == "1" and e["MASTER_ADDR"] == "127.0.0.1"
        assert e["TORCHELASTIC_RUN_ID"] == job["job_id"]
    assert {e["LOCAL_RANK"] for e in envs} == {"0", "1"}


def _free_port_in(lo: int, hi: int) -> int:
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


@pytest.mark.timeout(240)
def test_slurms_variables_alone_start_a_two_node_job(tmp_path):
    port = _free_port_in(10000 + os.getpid() % 9000, 19999)
    job_id = f"77{port - 10000:04d}"
    procs = []
    try:
        for node in (0, 1):
            env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_NNODES="2",
                       SLURM_NODEID=str(node), SLURM_JOB_NODELIST="127.0.0.1",
                       PYTHONUNBUFFERED="1")
            env.pop("MASTER_PORT", None)
            procs.append(subprocess.Popen(
                [*PHOENIXFT, "run", "--nproc", "1", "--run-dir", str(tmp_path),
                 str(ROOT / "examples" / "train_gpt.py"), "--steps", "4"],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        out0, _ = procs[0].communicate(timeout=200)
        out1, _ = procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            kill_tree(p.pid)
        kill_members(tmp_path)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, out0 + out1
    assert f"store 127.0.0.1:{port}" in out0
    job = load(tmp_path, 0, out0)
    assert job.summary["final_step"] == 4
    start = job.of("start")[0]
    assert start["nnodes"] == 2
    assert {e["node"] for e in job.of("agent_start") if "node" in e} >= {1}


def test_slurm_node_lists():
    from phoenixft.launch.torchrun import first_host
    assert first_host("gpu[003-005,007],cpu1") == "gpu003"
    assert first_host("node7,node8") == "node7"
    assert first_host("a-b.example.org") == "a-b.example.org"
    assert first_host("n[12]") == "n12"


@pytest.mark.timeout(240)
def test_bf16_parameters_on_fp32_master_shards_survive_a_sigkill(tmp_path, tmp_path_factory):
    from tests.support.jobs import failure_free, run
    ref = failure_free(tmp_path_factory, 2, 10, "--dtype", "bfloat16")
    job = run(tmp_path, "--nproc", "2", "--spares", "1", "--inject", "kill:rank=0:step=6",
              steps=10, script_args=("--dtype", "bfloat16"))
    assert job.rc == 0, job.out
    assert len(job.summary["recoveries"]) == 1
    assert job.summary["final_state_digest"] == ref["final_state_digest"]
    assert job.summary["losses"] == ref["losses"]

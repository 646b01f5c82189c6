"""Bad launcher input gets one clear line (not a traceback); a script that raises stops
the job with its traceback shown, without hanging."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.support.jobs import PHOENIXFT, ROOT, kill_members, kill_tree, load

pytestmark = [pytest.mark.integration]


def phoenixft(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*PHOENIXFT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--inject", "explode:rank=1:step=3"], "unknown fault kind 'explode'"),
    (["--inject", "kill:step=3"], "needs rank=R"),
    (["--inject", "kill:rank=1:step=x"], "step must be an integer"),
    (["--nproc", "0"], "--nproc must be >= 1"),
    (["--spares", "-1"], "--spares must be >= 0"),
    (["--nproc", "2", "--inject", "kill:rank=2:step=3"], "can never fire: rank 2 does not exist"),
    (["--inject", "kill:rank=0:step=0"], "step must be >= 1"),
    (["--inject", "kill:rank=0:gen=0"], "gen must be >= 1"),
    (["--heartbeat-timeout", "nan"], "--heartbeat-timeout must be a finite number"),
    (["--heartbeat-timeout", "inf"], "--heartbeat-timeout must be a finite number"),
    (["--persist-cpu-share", "0"], "--persist-cpu-share must be in (0, 1], got 0.0"),
    (["--persist-cpu-share", "nan"], "--persist-cpu-share must be in (0, 1], got nan"),
    (["--store", "127.0.0.1:99999"], "--store port must be an integer in 1..65535"),
    (["--store", "::1:29500"], "write an IPv6 address in brackets"),
    (["--store", "nosuchhost.invalid:29500"], "cannot resolve the store host 'nosuchhost.invalid'"),
    (["--store", "192.0.2.1:29500"], "reachable from other hosts: give every agent the same --auth-token"),
    (["--store", "192.0.2.1:29500", "--auth-token", "0123456789abcdef"],
     "cannot listen on --store 192.0.2.1"),
    (["--auth-token", "short"], "--auth-token must be at least 16 characters"),
    (["--nnodes", "2", "--store", "127.0.0.1:0"], "--store port must be an integer"),
    (["--run-dir", "/proc/phoenixft-run"], "--run-dir"),
    (["--nproc", "1000000000"], "= 1000000000 workers on this node is more than it can hold ("),
    (["--nproc", "2", "--spares", "1", "--max-local-workers", "2"],
     "--nproc 2 + --spares 1 = 3 workers on this node, above --max-local-workers 2"),
    (["--replicas", "99"], "--replicas must be in [0, 0]: a job of 1 rank has 0 peers"),
    (["--nproc", "2", "--replicas", "2"], "--replicas must be in [0, 1]: a job of 2 ranks has 1 peer"),
    (["--log-every", "0"], "--log-every must be a number of steps >= 1"),
    (["--log-every", "nans"], "--log-every must be a number of steps >= 1"),
    (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
])
def test_bad_arguments_one_clear_line(tmp_path, args, message):
    r = phoenixft("run", "--run-dir", str(tmp_path), *args, "examples/train_gpt.py")
    assert r.returncode == 2
    # refused at once: before any worker was started (the run's timeout bounds the rest)
    assert not list(tmp_path.glob("logs/*"))
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = phoenixft("run", "--run-dir", str(f), "examples/train_gpt.py")
    assert r.returncode == 2 and f"{f} is a file, not a directory" in r.stderr


@pytest.mark.timeout(120)
def test_an_inject_that_never_fired_fails_the_job_even_quietly(tmp_path):
    r = phoenixft("run", "--quiet", "--run-dir", str(tmp_path), "--inject", "kill:rank=0:step=50",
                  "examples/train_gpt.py", "--steps", "3", timeout=100)
    assert r.returncode == 1
    assert "--inject kill:rank=0:step=50 never fired (the run ended at step 3)" in r.stderr
    assert r.stdout == ""


@pytest.mark.timeout(120)
def test_a_microbatch_inject_that_can_never_fire_stops_the_job(tmp_path):
    r = phoenixft("run", "--run-dir", str(tmp_path), "--nproc", "2", "--inject",
                  "kill:rank=1:step=2:microbatch=1", "examples/train_gpt.py", "--steps", "3",
                  timeout=100)
    assert r.returncode == 1
    assert "kill:rank=1:step=2:microbatch=1 can never fire: rank 1 computes 1 microbatch" in r.stderr


@pytest.mark.timeout(120)
def test_an_ipv6_store(tmp_path):
    r = phoenixft("run", "--run-dir", str(tmp_path), "--store", "[::1]:0", "--nproc", "2",
                  "examples/train_gpt.py", "--steps", "3", timeout=100)
    assert r.returncode == 0, r.stderr
    assert "store [::1]:" in r.stdout


@pytest.mark.timeout(60)
def test_missing_script(tmp_path):
    r = phoenixft("run", "--run-dir", str(tmp_path), "no/such/script.py")
    assert r.returncode == 2
    assert "script 'no/such/script.py' does not exist" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(120)
def test_script_that_raises_stops_the_job_with_its_traceback(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        import torch, phoenixft
        sess = phoenixft.Session()
        model = torch.nn.Linear(4, 4)
        sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
        for step in sess.steps(10):
            for _ in step.microbatches():
                if step.index == 3 and sess.rank == 1:
                    raise ValueError("user bug at step 3")
                step.backward(model(torch.ones(2, 4)).sum())
    """))
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*PHOENIXFT, "run", "--run-dir", str(run_dir), "--nproc", "2",
                          "--spares", "1", str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=90)
    finally:
        kill_tree(p.pid)
        kill_members(run_dir)
    assert p.returncode == 1
    assert "the training script raised on worker" in err
    assert "ValueError: user bug at step 3" in err
    job = load(run_dir, p.returncode, out)
    assert not job.of("recovered"), "a script error must not be 'recovered' by a spare"


FSDP = ROOT / "examples" / "train_fsdp.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launch, script, message", [
    (["--nproc", "3"], ["--tp", "2"],
     "--nproc 3: 3 ranks cannot form tensor-parallel groups of tp=2 (--tp): run a multiple of 2"),
    (["--nproc", "4"], ["--dp-shard", "3"],
     "--nproc 4: 4 ranks cannot form replica groups of dp_shard x tp = 3"),
    (["--nproc", "2", "--straggler", "rebalance"], [],
     "--straggler rebalance gives ranks different numbers of microbatches"),
    (["--nproc", "4", "--min-nproc", "2"], [],
     "--min-nproc 2: a plain FSDP2 model keeps its world size (4 ranks"),
    (["--nproc", "4", "--min-nproc", "3"], ["--dp-shard", "2"],
     "--min-nproc 3: HSDP's replica groups of 2 ranks (--dp-shard x --tp) leave the job whole"),
])
def test_a_sharded_setup_the_flags_cannot_make_is_one_line(tmp_path, launch, script, message):
    """Found when the workers set up (the launcher cannot see the script's layout), said
    in one line naming the flags, before any step: not the workers' traceback, and not at
    the first failure."""
    p = phoenixft("run", "--run-dir", str(tmp_path / "run"), *launch, str(FSDP), "--steps", "3",
                  *script, timeout=100)
    kill_members(tmp_path / "run")
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert f"phoenixft: job stopped: {message}" in err, err[-3000:]
    assert "Traceback" not in err and "raised on worker" not in err

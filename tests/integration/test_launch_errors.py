"""Bad launcher input gets one clear line (not a traceback); a script that raises stops
the job with its traceback shown, without hanging."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from jobs import PHOENIXFT, ROOT, kill_members, kill_tree, load

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
])
def test_bad_arguments_one_clear_line(tmp_path, args, message):
    r = phoenixft("run", "--run-dir", str(tmp_path), *args, "examples/train_gpt.py")
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


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

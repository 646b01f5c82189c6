"""What `phoenixft run` prints: a job with a SIGKILL tells who failed, how it was seen, who
took the rank and where the state came from, once each, with progress lines at a regular
cadence; `--quiet` keeps the failure and the summary."""

from __future__ import annotations

import json
import re
import subprocess
import threading

import pytest

from tests.support.disks import fill_up, small_tmpfs
from tests.support.jobs import (
    GATED,
    PHOENIXFT,
    ROOT,
    kill_members,
    kill_tree,
    load,
    reached_step,
    run,
    run_script,
    start,
    wait_until,
)

pytestmark = [pytest.mark.integration]


def _once(out: str, pattern: str) -> str:
    found = [ln for ln in out.splitlines() if re.search(pattern, ln)]
    assert len(found) == 1, f"{pattern!r} on {len(found)} lines of:\n{out}"
    return found[0]


@pytest.mark.timeout(200)
def test_a_kill_is_told_once_each_with_regular_progress(tmp_path):
    job = run(tmp_path, "--nproc", "2", "--spares", "1", "--log-every", "4",
              "--inject", "kill:rank=1:step=6", steps=16)
    assert job.rc == 0, job.out
    out = job.out
    fail = _once(out, r"failed:")
    assert "worker n0w1 (rank 1) failed: killed by SIGKILL" in fail
    assert re.search(r"detected in \d+ ms by process exit", fail), fail
    _once(out, r"generation 1: n0w2 takes rank 1 from n0w1$")
    rec = job.summary["recoveries"][0]
    again = _once(out, r"generation 1 training again")
    assert f"restored step {rec['restore_step']} from a snapshot in the node's shared memory" \
        in again, again
    assert re.search(r"in \d+ ms after detection, \d+ completed steps? lost$", again), again
    steps = [int(m.group(1)) for m in re.finditer(r"^step +(\d+)  loss \d+\.\d{4} ", out, re.M)]
    assert steps == [4, 8, 12, 16], out
    done = _once(out, r"^phoenixft: done:")
    assert done.startswith("phoenixft: done: 16 steps, 1 failure, 1 recovery; final loss ")
    assert job.summary["final_state_digest"] in done
    assert done.endswith(f"details in {tmp_path}/summary.json, timeline: phoenixft plot {tmp_path}")
    assert "2 workers + 1 spare," in out


@pytest.mark.timeout(200)
def test_quiet_keeps_the_failure_and_the_summary_and_status_shows_the_end(tmp_path):
    job = run(tmp_path, "--nproc", "2", "--spares", "2", "--quiet",
              "--inject", "kill:rank=0:step=3", steps=8)
    assert job.rc == 0, job.out
    _once(job.out, r"worker n0w0 \(rank 0\) failed: killed by SIGKILL")
    _once(job.out, r"^phoenixft: done: 8 steps, 1 failure, 1 recovery")
    assert not re.search(r"^step ", job.out, re.M), job.out
    assert "generation 1" not in job.out and "store 127.0.0.1" not in job.out
    st = json.loads((tmp_path / "status.json").read_text())
    states = {m["wid"]: (m["role"], m["state"]) for m in st["members"]}
    unused = [w for w, (role, _) in states.items() if role == "spare"]
    assert len(unused) == 1 and states[unused[0]][1] == "stopped", states
    assert states["n0w0"] == ("failed", "dead") and st["ended"] is True
    assert not any(state in ("waiting", "running") for _, state in states.values()), states


@pytest.mark.timeout(60)
def test_status_on_a_missing_or_damaged_run_dir_says_so(tmp_path):
    missing = tmp_path / "nothing-here"
    r = subprocess.run([*PHOENIXFT, "status", str(missing), "--watch", "--wait", "0.5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert f"no job in {missing} yet; waiting up to 0.5 s" in r.stderr
    assert f"no job appeared in {missing} within 0.5 s" in r.stderr
    (tmp_path / "status.json").write_text('{"generation": 1, "memb')
    r = subprocess.run([*PHOENIXFT, "status", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'status.json'} cannot be read" in r.stderr, r.stderr


@pytest.fixture()
def small_run_disk(tmp_path):
    """An 8 MiB tmpfs for the run directory."""
    with small_tmpfs(tmp_path, "8m", deselect="full_run_dir") as mnt:
        yield mnt


@pytest.mark.timeout(300)
def test_a_full_run_dir_disk_mid_run_costs_records_not_training(tmp_path, tmp_path_factory,
                                                                small_run_disk):
    """The run directory's disk fills while the job runs (held at step 4 until it is full,
    at step 9 until the test has seen the console say so and made room): training goes
    on to the failure-free digest, the console says it once each way, and no temporary
    file is left behind."""
    holds = ("--hold-at", "4", "--hold-until-file", "go", "--hold-again-at", "9",
             "--hold-again-until-file", "go2")
    ref = run_script(tmp_path_factory.mktemp("ref"), GATED, "--nproc", "2",
                     script_args=("--steps", "14"))
    assert ref.rc == 0, ref.out
    run_dir = small_run_disk / "run"
    p = start(run_dir, "--nproc", "2", script=GATED, steps=None,
              script_args=("--steps", "14", *holds))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        wait_until(lambda: reached_step(run_dir, 3) or p.poll() is not None, 120, "step 3")
        assert p.poll() is None, "".join(lines)
        filler = fill_up(small_run_disk)
        (run_dir / "go").touch()  # an empty file needs no room on tmpfs
        wait_until(lambda: any("cannot write the run directory" in ln for ln in lines) or
                   p.poll() is not None, 120, "the console saying the run dir is full")
        assert p.poll() is None, "".join(lines)
        filler.unlink()
        (run_dir / "go2").touch()
        p.wait(timeout=180)
        reader.join(timeout=30)
    finally:
        kill_tree(p.pid)
        kill_members(run_dir)
    out = "".join(lines)
    job = load(run_dir, p.returncode, out)
    assert job.rc == 0, out
    assert "Traceback" not in out
    assert job.summary["final_state_digest"] == ref.summary["final_state_digest"]
    assert job.summary["losses"] == ref.summary["losses"]
    full = _once(out, r"cannot write the run directory")
    assert "No space left on device" in full and "training goes on" in full
    _once(out, rf"the run directory {re.escape(str(run_dir))} is writable again \(\d+ event")
    assert not list(run_dir.rglob("*.tmp")), list(run_dir.rglob("*.tmp"))
    assert job.of("run_dir_writable")


@pytest.mark.timeout(120)
def test_status_watch_on_a_dead_job_or_a_foreign_status_file_ends(tmp_path):
    """The agent SIGKILLed with its workers (`node:` fault): status.json still says the job
    runs; `--watch` ends, saying no agent holds the run directory any more. A status.json
    of another shape is one line, not a traceback."""
    job = run(tmp_path / "run", "--nproc", "2", "--inject", "node:rank=0:step=3", steps=20)
    assert job.rc == -9
    assert json.loads((tmp_path / "run" / "status.json").read_text())["kind"] == "run"
    r = subprocess.run([*PHOENIXFT, "status", str(tmp_path / "run"), "--watch", "--interval",
                        "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    assert f"no agent holds {tmp_path / 'run'} any more" in r.stderr
    for shape in ("[]", '{"members": 5}'):
        (tmp_path / "run" / "status.json").write_text(shape)
        r = subprocess.run([*PHOENIXFT, "status", str(tmp_path / "run"), "--watch"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "is not a phoenixft job's status" in r.stderr

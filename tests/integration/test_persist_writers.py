"""One writer per persistent URL, with real jobs: two jobs started on one URL at once (one
is refused with one line, the other's checkpoints stay its own), a `--resume` of a job
that is still running (refused), and a URL that holds another job's checkpoints (named,
never restored)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from phoenixft.checkpoint.tiers import FsspecTier
from phoenixft.observe.events import read_events
from tests.support.jobs import GATED, kill_members, kill_tree, load, run, start, wait_until

pytestmark = [pytest.mark.integration]
HOLD = ("--hold-at", "2", "--hold-until-file", "go")  # the job waits at step 2 for the test


def persisted(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "persisted"]


@pytest.mark.timeout(240)
def test_two_jobs_started_on_one_url_at_once_one_is_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [start(d, "--nproc", "2", "--persist", url, "--persist-cpu-share", "1",
                   script=GATED, steps=8, script_args=HOLD) for d in dirs]
    try:
        wait_until(lambda: any(p.poll() is not None for p in procs), 120,
                   "one of the two jobs refused")
        [refused] = [p for p in procs if p.poll() is not None]
        [running] = [i for i, p in enumerate(procs) if p is not refused]
        out = refused.communicate(timeout=30)[0]
        assert refused.returncode == 2, out[-3000:]
        [line] = [x for x in out.splitlines() if "error" in x]
        assert f"--persist {url} is being written by job" in line, out
        assert "Traceback" not in out
        (dirs[running] / "go").touch()
        out, _ = procs[running].communicate(timeout=180)
    finally:
        for p, d in zip(procs, dirs):
            kill_tree(p.pid)
            kill_members(d)
    job = load(dirs[running], procs[running].returncode, out)
    assert job.rc == 0, out[-3000:]
    tier = FsspecTier(url)
    jobs = {tier.read_manifest(s)["job_id"] for s in tier.manifests()}
    [agent_start] = job.of("agent_start")
    assert jobs == {agent_start["job"]}, jobs  # every committed step is the running job's
    assert tier.manifests()[-1] == 8


@pytest.mark.timeout(240)
def test_resuming_a_job_that_is_still_running_or_starting_another_is_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    p = start(tmp_path / "a", "--nproc", "2", "--persist", url, "--persist-cpu-share", "1",
              script=GATED, steps=8, script_args=HOLD)
    try:
        wait_until(lambda: persisted(tmp_path / "a") or p.poll() is not None, 120,
                   "a first committed step")
        assert p.poll() is None
        second = run(tmp_path / "b", "--nproc", "2", "--persist", url, "--resume",
                     script=GATED, steps=8, timeout=120)
        assert second.rc == 2, second.out[-3000:]
        assert "is still running and writing there" in second.out, second.out[-3000:]
        assert p.poll() is None  # the running job goes on
        # a new job there is told that a job writes there (not to --resume it)
        third = run(tmp_path / "c", "--nproc", "2", "--persist", url, script=GATED, steps=8,
                    timeout=120)
        assert third.rc == 2 and f"--persist {url} is being written by job" in third.out, \
            third.out[-3000:]
        (tmp_path / "a" / "go").touch()
        out, _ = p.communicate(timeout=180)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path / "a")
    assert p.returncode == 0, out[-3000:]


@pytest.mark.timeout(300)
def test_resume_names_another_jobs_checkpoints_and_never_restores_them(tmp_path):
    """Job A's checkpoints (steps up to 12) and, copied in as an interleaving writer left
    them, job B's newer step 16 (bases only: no record of B depends on one of A's): the
    resume continues B, names A's checkpoints, and keeps them."""
    url, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    a = run(tmp_path / "a", "--nproc", "2", "--persist", url, "--persist-cpu-share", "1", steps=12)
    b = run(tmp_path / "b", "--nproc", "2", "--persist", other, "--persist-cpu-share", "1",
            "--persist-every", "1", steps=16)
    assert a.rc == 0 and b.rc == 0, a.out[-2000:] + b.out[-2000:]
    job_a, job_b = (j.of("agent_start")[0]["job"] for j in (a, b))
    for rel in ("manifests/0000000016.json", "r0/s0000000016.base", "r1/s0000000016.base"):
        Path(url, rel).parent.mkdir(exist_ok=True)
        shutil.copy(Path(other, rel), Path(url, rel))
    steps_a = FsspecTier(url).manifests()[:-1]
    job = run(tmp_path / "resumed", "--nproc", "2", "--persist", url, "--resume", steps=20)
    assert job.rc == 0, job.out[-3000:]
    [warning] = [x for x in job.out.splitlines() if "also holds the checkpoints" in x]
    assert f"job {job_a}" in warning and f"resuming job {job_b}" in warning, warning
    assert job.summary["resumed_from"] == 16
    tier = FsspecTier(url)
    assert set(steps_a) <= set(tier.manifests())  # job A's committed steps are all kept
    assert {tier.read_manifest(s)["job_id"] for s in steps_a} == {job_a}

"""What `--resume` and `phoenixft ckpt` check, on a real job's real files: an unreadable
newest manifest is named and passed over (never deleted) by `--resume`, `ckpt ls` and
`ckpt verify`; a missing record and a damaged model file are named by `ckpt verify`, and
`ckpt export` refuses the latter in one line, as it does an export target that would put
files where nobody meant them; the resume message names the step restored."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from phoenixft.checkpoint.tiers import FsspecTier
from tests.support.jobs import PHOENIXFT, ROOT, run

pytestmark = [pytest.mark.integration]
PER_STEP = ("--persist-cpu-share", "1")


def ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PHOENIXFT, "ckpt", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def persisted(tmp_path_factory) -> str:
    """A finished job's checkpoints (steps up to 12, a base every 4 records, 3 bases kept);
    each test works on its own copy."""
    d = tmp_path_factory.mktemp("persisted")
    job = run(d / "run", "--nproc", "2", "--persist", str(d / "ckpt"), *PER_STEP,
              "--persist-every", "4", "--persist-keep", "3", steps=12)
    assert job.rc == 0, job.out[-3000:]
    return str(d / "ckpt")


@pytest.fixture()
def url(persisted, tmp_path) -> str:
    subprocess.run(["cp", "-a", persisted, str(tmp_path / "ckpt")], check=True)
    return str(tmp_path / "ckpt")


@pytest.mark.timeout(240)
def test_an_unreadable_newest_manifest_is_named_and_passed_over(url, tmp_path):
    tier = FsspecTier(url)
    steps = tier.manifests()
    bad = Path(tier.manifest_path(steps[-1]))
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    ls = ckpt("ls", url)
    assert ls.returncode == 0, ls.stderr
    assert f"UNREADABLE: {url}/manifests/{bad.name}" in ls.stdout, ls.stdout
    assert all(f"{s:>8}  " in ls.stdout for s in steps[:-1])
    verify = ckpt("verify", url)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert f"BAD manifest: {url}/manifests/{bad.name}: unreadable manifest" in verify.stdout
    assert verify.stdout.count(": ok") >= 2 * (len(steps) - 1)
    job = run(tmp_path / "resumed", "--nproc", "2", "--persist", url, "--resume", steps=16)
    assert job.rc == 0, job.out[-3000:]
    assert f"passed over {url}/manifests/{bad.name}: unreadable manifest" in job.out
    assert "resuming job" in job.out and f"from step {steps[-2]} " in job.out, job.out[-2000:]
    assert job.summary["resumed_from"] == steps[-2]
    assert bad.exists()  # named, never deleted


@pytest.mark.timeout(120)
def test_verify_names_a_missing_record_file(url):
    tier = FsspecTier(url)
    step = tier.manifests()[-1]
    rec = next(r for r in tier.read_manifest(step)["records"] if r["rank"] == 0)
    path = Path(tier.record_path(step, 0, rec["kind"]))
    path.unlink()
    verify = ckpt("verify", url, "--step", str(step))
    assert verify.returncode == 1
    [line] = [x for x in verify.stdout.splitlines() if "BAD" in x]
    assert f"step {step} rank 0: BAD: {path.parent.as_posix()}/{path.name}" in line, line
    assert "missing" in line


@pytest.mark.timeout(120)
def test_a_damaged_model_file_fails_verify_and_export_says_why_in_one_line(url, tmp_path):
    fixed = Path(url, "model", "g0000.safetensors")
    data = bytearray(fixed.read_bytes())
    data[len(data) // 2] ^= 0x40  # a flipped byte in the tensors
    fixed.write_bytes(bytes(data))
    verify = ckpt("verify", url)
    assert verify.returncode == 1, verify.stdout
    assert f"model tensors model/g0000.safetensors: BAD: {fixed}: checksum mismatch" in verify.stdout
    export = ckpt("export", url, "--to", str(tmp_path / "hf"))
    assert export.returncode == 2
    assert export.stderr.strip().count("\n") == 0, export.stderr
    assert f"{fixed}: checksum mismatch" in export.stderr
    fixed.write_bytes(b"not safetensors")  # (a manifest from before checksums: parsed)
    export = ckpt("export", url, "--to", str(tmp_path / "hf"))
    assert export.returncode == 2 and "Traceback" not in export.stderr, export.stderr


@pytest.mark.timeout(240)
def test_the_resume_message_names_the_step_that_is_restored(url, tmp_path):
    """The newest step's record of rank 1 is truncated: the launcher says it resumes from
    the step before, which is the one restored."""
    tier = FsspecTier(url)
    steps = tier.manifests()
    rec = next(r for r in tier.read_manifest(steps[-1])["records"] if r["rank"] == 1)
    path = Path(tier.record_path(steps[-1], 1, rec["kind"]))
    path.write_bytes(path.read_bytes()[:100])
    job = run(tmp_path / "resumed", "--nproc", "2", "--persist", url, "--resume", steps=16)
    assert job.rc == 0, job.out[-3000:]
    restored = job.summary["resumed_from"]
    [line] = [x for x in job.out.splitlines() if "resuming job" in x]
    assert f"from step {restored} " in line and f"continues at step {restored + 1}" in line, line
    assert restored == steps[-2]


@pytest.mark.timeout(120)
def test_export_refuses_an_empty_or_non_empty_target_unless_forced(url, tmp_path):
    empty = ckpt("export", url, "--to", "")
    assert empty.returncode == 2 and "--to is empty" in empty.stderr, empty.stderr
    assert not Path(ROOT, "model.safetensors").exists()  # nothing in the current directory
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    r = ckpt("export", url, "--to", str(full))
    assert r.returncode == 2 and "is not empty" in r.stderr and "--force" in r.stderr, r.stderr
    assert sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    r = ckpt("export", url, "--to", str(full), "--force")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in full.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


@pytest.mark.timeout(240)
def test_a_resume_with_no_step_that_verifies_stops_instead_of_starting_afresh(url, tmp_path):
    """Every persisted record has a flipped byte (same size, so the launcher's look at the
    files passes): the workers find no step that verifies. The job used to train from
    step 0 without a word; it stops, saying why."""
    tier = FsspecTier(url)
    for step in tier.manifests():
        for rec in tier.read_manifest(step)["records"]:
            path = Path(tier.record_path(step, rec["rank"], rec["kind"]))
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    job = run(tmp_path / "resumed", "--nproc", "2", "--persist", url, "--resume", steps=16)
    assert job.rc == 1, job.out[-3000:]
    assert "--resume: no step persisted in" in job.out and "rather than train from step 0" in job.out
    assert not job.of("step"), "it trained"
    assert job.of("restore_source_failed")

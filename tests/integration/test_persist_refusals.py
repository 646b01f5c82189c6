"""`--persist` storage that cannot be used is refused at launch, before any worker starts,
in one line naming the cause and the fix (never a traceback): S3 without credentials, an
S3 endpoint that does not answer, a bucket that does not exist (on a real S3-compatible
server, moto's, on loopback), and a local path that is a file. `phoenixft ckpt` says the
same in one line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.jobs import EXAMPLE, PHOENIXFT, ROOT

pytestmark = [pytest.mark.integration]


def launch(tmp_path: Path, url: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*PHOENIXFT, "run", "--run-dir", str(tmp_path / "run"), "--nproc", "2",
                           "--persist", url, str(EXAMPLE), "--steps", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)


def one_line_refusal(r: subprocess.CompletedProcess, tmp_path: Path, *want: str) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    [line] = r.stderr.strip().splitlines()
    assert all(w in line for w in want), line
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started


def without_s3(env: dict[str, str]) -> dict[str, str]:
    """The test's environment with no AWS settings at all (nor files to find them in)."""
    out = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    out.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true")
    return out


@pytest.mark.timeout(200)
def test_s3_without_credentials_is_one_line(tmp_path, s3_url):
    env = without_s3(dict(os.environ))
    env["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    r = launch(tmp_path, s3_url + "/job", env)
    one_line_refusal(r, tmp_path, "no usable S3 credentials", "AWS_ACCESS_KEY_ID")
    r = subprocess.run([*PHOENIXFT, "ckpt", "ls", s3_url], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no usable S3 credentials" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(200)
def test_an_unreachable_s3_endpoint_is_one_line(tmp_path, s3_server):
    from phoenixft.platform import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint)
    r = launch(tmp_path, "s3://phx-bucket/job", env)
    one_line_refusal(r, tmp_path, f"cannot reach the S3 endpoint {endpoint}", "AWS_ENDPOINT_URL")


@pytest.mark.timeout(200)
def test_a_bucket_that_does_not_exist_is_one_line(tmp_path, s3_server):
    r = launch(tmp_path, "s3://phx-no-such-bucket/job", dict(os.environ))
    one_line_refusal(r, tmp_path, "the bucket 'phx-no-such-bucket' does not exist", "create it")


@pytest.mark.timeout(120)
def test_persist_naming_a_file_says_so(tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("a file, not a directory")
    r = launch(tmp_path, str(f), dict(os.environ))
    one_line_refusal(r, tmp_path, f"--persist '{f}': {f} is a file, not a directory")
    r = launch(tmp_path, str(f / "inside"), dict(os.environ))
    one_line_refusal(r, tmp_path, f"{f} is a file, not a directory")

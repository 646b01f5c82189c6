"""Session-wide fixtures. Shared helpers are the `tests.support` package (imported by
name: the tests are a package, nothing is put on sys.path)."""

import glob
import time

import pytest

SHM = "/dev/shm/phoenixft*"  # what jobs, servers and their logs put in host memory


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput")  # (xdist's workers have it)


def pytest_sessionstart(session):
    if _is_controller(session.config):
        session.config._shm_before = set(glob.glob(SHM))


def pytest_sessionfinish(session, exitstatus):
    """The suite fails if it leaves more in /dev/shm than it found: every test removes what
    it makes (one run left four serving logs, 84 MB of host memory). Janitors clean up
    after their job's processes: their work is waited for, up to 30 s."""
    before = getattr(session.config, "_shm_before", None)
    if before is None:
        return
    deadline = time.monotonic() + 30
    while (left := sorted(set(glob.glob(SHM)) - before)) and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for janitors (a state), bounded
    if left:
        print(f"\nthe tests left {len(left)} entries in /dev/shm: {left[:8]}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server on loopback (moto's server mode), and the environment
    that points boto3/s3fs at it."""
    import os

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "phoenixft-test", "AWS_SECRET_ACCESS_KEY": "phoenixft-test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def s3_url(s3_server, request) -> str:
    """A fresh bucket per test."""
    import uuid

    import boto3

    bucket = f"phx-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}"

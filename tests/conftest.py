"""Session-wide fixtures. Shared helpers are the `tests.support` package (imported by
name: the tests are a package, nothing is put on sys.path)."""

import pytest


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

"""The writer lease on a real directory and a real S3-compatible server (moto's, on
loopback): one job at a time, stale leases taken over, a resumed job's takeover fencing
the run it replaced, and launches racing for a free lease (real processes) with exactly
one winner."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from phoenixft.checkpoint.tiers import FsspecTier
from phoenixft.checkpoint.writer_lease import LEASE, LeaseHeld, LeaseLost, WriterLease


@pytest.fixture(params=["directory", "s3"])
def url(request, tmp_path):
    if request.param == "directory":
        return str(tmp_path / "ckpt")
    return request.getfixturevalue("s3_url") + "/ckpt"


def held_by(url: str) -> dict:
    return json.loads(FsspecTier(url).read_object(LEASE))


def test_a_second_job_is_refused_and_a_stale_lease_taken_over(url):
    a = WriterLease(FsspecTier(url), "job-a")
    assert a.acquire(resume=False) is None
    with pytest.raises(LeaseHeld, match="being written by job job-a"):
        WriterLease(FsspecTier(url), "job-b").acquire(resume=False)
    assert held_by(url)["job_id"] == "job-a"
    # job a dies without letting go: once its lease is older than its TTL it is stale
    rec = held_by(url) | {"renewed": time.time() - 3600}
    FsspecTier(url).write_object(LEASE, json.dumps(rec).encode())
    b = WriterLease(FsspecTier(url), "job-b")
    warning = b.acquire(resume=False)
    assert warning and "job job-a" in warning and "stale" in warning
    assert held_by(url)["token"] == b.token
    with pytest.raises(LeaseLost, match="held by job job-b"):
        a.renew()  # job a's late writes are refused, not interleaved


def test_resuming_the_same_job_takes_over_and_fences_the_run_it_replaces(url):
    first = WriterLease(FsspecTier(url), "job-a")
    first.acquire(resume=False)
    # as left by a run on another host: its PID cannot be checked from here
    FsspecTier(url).write_object(LEASE, json.dumps(held_by(url) | {"host": "elsewhere"}).encode())
    with pytest.raises(LeaseHeld, match="still running"):
        WriterLease(FsspecTier(url), "job-a").acquire(resume=False)  # not a resume
    second = WriterLease(FsspecTier(url), "job-a")
    warning = second.acquire(resume=True)
    assert warning and "taken over" in warning
    with pytest.raises(LeaseLost):
        first.check()
    with pytest.raises(LeaseLost):
        first.renew()
    second.renew()
    second.check()
    # a writer of the job without a token (another node's worker) takes the holder's
    follower = WriterLease(FsspecTier(url), "job-a")
    follower.check()
    assert follower.token == second.token
    second.release()
    assert not FsspecTier(url).fs.exists(FsspecTier(url)._path(LEASE))


RACE = """
import sys
from phoenixft.checkpoint.writer_lease import LeaseHeld, WriterLease
from phoenixft.checkpoint.tiers import FsspecTier
open(sys.argv[3], "w").close()
import os, time
while len(os.listdir(os.path.dirname(sys.argv[3]))) < int(sys.argv[4]):
    time.sleep(0.001)  # all started: go at once
try:
    WriterLease(FsspecTier(sys.argv[1]), sys.argv[2]).acquire(resume=False)
    print("won")
except LeaseHeld as exc:
    print("refused:", exc)
"""


@pytest.mark.timeout(120)
def test_launches_racing_for_a_free_lease_have_exactly_one_winner(url, tmp_path):
    n = 4
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACE, url, f"job-{i}", str(ready / str(i)),
                               str(n)], stdout=subprocess.PIPE, text=True) for i in range(n)]
    try:
        outs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert sorted(o.split(":")[0].strip() for o in outs) == ["refused"] * (n - 1) + ["won"], outs
    winner = next(i for i, o in enumerate(outs) if o.startswith("won"))
    assert held_by(url)["job_id"] == f"job-{winner}"

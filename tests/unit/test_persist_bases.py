"""Persisted bases across ranks: no committed step ever depends on a base that was not
committed, even when the ranks' base steps drift apart (a rank that coalesced a step
counts its records differently). Two real persisters (ranks 0 and 1 of one generation),
a real TCPStore on loopback, real slot files and a real directory."""

from __future__ import annotations

import torch

from phoenixft.checkpoint.persist import JobInfo, Persister
from phoenixft.checkpoint.record import SnapshotHeader
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, SlotFile, SlotKind, slot_path
from phoenixft.checkpoint.tiers import FsspecTier
from phoenixft.checkpoint.writer_lease import TOKEN_ENV, WriterLease
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.config import Persistence
from tests.support.waiting import wait_until

WORLD = 2


def write_slot(shm_dir, rank: int, step: int) -> None:
    """Rank's snapshot of `step` in its slot, as the snapshot thread leaves it."""
    g = torch.Generator().manual_seed(rank)
    tensors = {"w": torch.randn(4096, generator=g) + step}
    lay = Layout.of(tensors)
    f = SlotFile(slot_path(shm_dir, SlotKind.SNAP, rank, step))
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(step)
    f.view(lay.entries[0]).copy_(tensors["w"])
    f.finish_write(step, lay, SnapshotHeader(rank=rank))


class Generation:
    """A generation of WORLD ranks persisting to a directory: each rank's real persister,
    a real TCPStore on loopback (this job's writer lease taken), real slot files."""

    def __init__(self, tmp_path, monkeypatch, *, voted: bool = False) -> None:
        self.url = str(tmp_path / "ckpt")
        self.tier = FsspecTier(self.url)
        lease = WriterLease(self.tier, "job")
        lease.acquire(resume=False)
        monkeypatch.setenv(TOKEN_ENV, lease.token)
        self.server, port = kv.host_store("127.0.0.1")
        self.store = kv.connect(f"127.0.0.1:{port}")
        self.shm = tmp_path / "shm"
        self.shm.mkdir()
        cfg = Persistence(url=self.url, every=2, cpu_share=1.0, keep=100)
        self.events: list[tuple] = []
        self.persisters = [
            Persister(FsspecTier(self.url), rank=r, shm_dir=str(self.shm), cfg=cfg,
                      job=JobInfo(job_id="job", generation=0, world_size=WORLD, voted=voted),
                      connect=lambda: kv.connect(f"127.0.0.1:{port}"),
                      emit=lambda event, **kw: self.events.append((event, kw)))
            for r in range(WORLD)]

    def persist(self, rank: int, step: int) -> None:
        """Rank's slot of `step` written and offered; returns once its persister is idle."""
        write_slot(self.shm, rank, step)
        self.persisters[rank].offer(step)
        assert self.persisters[rank].wait_idle(30)

    def stop(self) -> None:
        for p in self.persisters:
            p.stop()
        del self.server

    def failed(self) -> list[tuple]:
        return [e for e in self.events if e[0] == "persist_failed"]


def test_a_delta_never_rests_on_a_base_no_manifest_commits(tmp_path, monkeypatch):
    """Rank 1 misses steps 3 and 8 (coalesced under slow storage): with a base every 2
    records, rank 0's bases fall on 1, 3, 5, 7, 9 and rank 1's on 1, 4, 6, 9 as each
    counts. Every manifest's delta must name a base step that a manifest commits with
    that rank's base record; before the fix, step 4 committed rank 0's delta on its base
    3, which no manifest could ever commit (rank 1 has no record of step 3)."""
    gen = Generation(tmp_path, monkeypatch)
    tier = gen.tier
    try:
        for step in range(1, 13):
            # rank 1 first, so that rank 0 commits each step as soon as it is ready
            for rank in (1, 0):
                if rank == 1 and step in (3, 8):
                    continue
                gen.persist(rank, step)
        assert gen.persisters[0].flush(12, 30)
    finally:
        gen.stop()
    assert not gen.failed(), gen.events
    manifests = {s: tier.read_manifest(s) for s in tier.manifests()}
    assert 12 in manifests
    kinds = {(r["step"], r["rank"]): r["kind"] for m in manifests.values() for r in m["records"]}
    for step, m in manifests.items():
        for r in m["records"]:
            if r["kind"] == "delta":
                assert kinds.get((r["base_step"], r["rank"])) == "base", (
                    f"step {step}: rank {r['rank']}'s delta rests on base {r['base_step']}, "
                    f"which no manifest commits (committed: {sorted(manifests)})")
    # and each committed step restores, read as a resume reads it
    for step, m in manifests.items():
        for r in range(WORLD):
            assert tier.get(step, r, m)


def test_a_voted_job_commits_no_manifest_past_the_step_its_vote_vouched_for(tmp_path, monkeypatch):
    """With a fingerprint vote, the state of step t is checked at step t+1 and may be taken
    back (a rollback): rank 0 writes no manifest past `Keys.VOUCHED`, so storage never
    commits a state the vote then found wrong. Every rank's record of steps 1-4 is durable;
    the manifests follow the vouched step, not the records."""
    gen = Generation(tmp_path, monkeypatch, voted=True)
    tier, store = gen.tier, gen.store

    def durable(step: int) -> bool:  # every rank announced its record of `step`
        return store.check([Keys.persisted(0, step, r) for r in range(WORLD)])

    try:
        for step in range(1, 5):
            for rank in (1, 0):
                gen.persist(rank, step)
        assert durable(4)
        assert tier.manifests() == []  # nothing vouched for yet
        store.set(Keys.VOUCHED, "2")  # the vote at step 3 found step 2's state alike
        wait_until(lambda: 2 in tier.manifests(), 30, "step 2's manifest once it is vouched for")
        assert max(tier.manifests()) == 2  # (and its base's, step 1)
        store.set(Keys.VOUCHED, "4")  # (the vote after the last step)
        assert gen.persisters[0].flush(4, 30)
        assert max(tier.manifests()) == 4
    finally:
        gen.stop()
    assert not gen.failed(), gen.events

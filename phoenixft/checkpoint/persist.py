"""Background persistence: each rank's snapshots go to persistent storage without ever
blocking a training step, and rank 0 commits each step that every rank made durable.

Per rank, after the snapshot thread copied step t into shared memory it *offers* t to the
`Persister` thread (never waits). The thread copies the slot's bytes, verifies them, and
writes a record: a *base* (the whole blob) every `every` records, else a *delta* against
the rank's last base. One offer is pending at most: when storage is slower than training, an
older pending step is replaced by the newer one (coalesced, counted, logged), so host
memory stays bounded at two blobs per rank (the base and the one being written) whatever
the storage does. A step whose slot was rewritten before it could be read is skipped the
same way.

CPU share: a record costs CPU (reading and verifying the slot, a delta: hashing, XOR and
zstd of the whole blob, checksums; a base of fp32 state is stored uncompressed, since zstd
saved 8% of it for 27 ms of CPU): about 50 ms for a 20 MB delta here, more than a small model's
whole step, so persisting every step made such a job's steps 3-4x slower. Records are
therefore taken only at steps that are multiples of a *stride*, a power of two that rank
0 sets from its measured CPU per record (smoothed, over records actually written; lowered
only when half the stride would still fit comfortably) and the time between steps so that
a persister uses at most `cpu_share` of one core on average (5% by default), and
publishes in the store per generation (`Keys.persist_stride`): every rank persists the
same steps, so they all become durable and commit, and a coarser stride's steps are steps
of every finer one. The step time is the median of the last few gaps between offers;
after a persister's first record, offers are passed over until a few gaps are known (the
first steps' warm-up would otherwise set a stride far too fine). The memory
tiers still hold every step; storage lags further behind on a busy machine instead of
training slowing down. `flush` (the end of training) persists the last step offered,
wherever it falls.

Commit (the global one): each rank announces its durable records in the store
(`Keys.persisted`); rank 0 writes the step's manifest once every rank of the generation
has announced it: the manifest is the commit, written atomically and last. Only manifests
count when restoring, so a half-written step is invisible; rank 0 then keeps the newest
`keep` bases and deletes the manifests and records older than them.

No commit depends on a base that was not committed. Ranks pick their base steps apart
(a rank that coalesced a step counts its records differently), so a rank's base may be
a step some other rank never wrote, which no manifest can commit; deltas against it then
hung on a record no manifest named (seen: deltas of steps 10-26 on an uncommitted base 8).
So: a rank writes a delta only against a base whose step every rank of the generation
announced ("ready"), and rank 0 commits every ready step that holds a base, oldest first,
besides the newest ready step. A ready step is final (each rank announces in step order,
so a step still missing when a newer one is ready never comes), hence a ready base is
always committed before any delta on it; until its base is ready a rank writes bases.

Vouched. With fingerprints voted on (`train/fingerprints.py`), the state of step t is
checked at step t+1, and a difference takes back t's commit and rolls the job back
(`snapshot.retract_commit`). A persister writes t's record as soon as its slot is copied,
so without more its manifest could commit, in storage, a state the vote then found wrong,
and a job resumed from storage would start from it. So rank 0 writes no manifest for a
step past `Keys.VOUCHED`, the newest step a vote vouched for (rank 0 of training raises
it with each step's progress, and after the vote that follows the last step): a
retracted step is never vouched, so its records stay invisible and are collected as
garbage, and a job without a vote to wait for (fingerprints off, or nobody holding a
copy of another's state) vouches for every step at once.

A storage error never stops training: it is logged (`persist_failed`, the first and then
every 20th), announced in the store for the console, and the next step tries again.
"""

from __future__ import annotations

import collections
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from phoenixft.checkpoint.delta import CHUNK, chunk_hashes
from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.checkpoint.manifests import collect_garbage
from phoenixft.checkpoint.slots import SlotFile, SlotKind, slot_path, verify_blob
from phoenixft.checkpoint.tiers import FsspecTier, info_dict
from phoenixft.checkpoint.writer_lease import RENEW_S, TOKEN_ENV, WriterLease
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.config import Persistence

GAPS = 9  # the step time the stride is set from: the median of this many recent gaps
MIN_GAPS = 8  # offers after the first wait for this many gaps (module doc: CPU share)


@dataclass
class PersistStats:
    records: int = 0
    bases: int = 0
    coalesced: int = 0
    errors: int = 0
    bytes_written: int = 0
    blob_bytes: int = 0
    write_s: float = 0.0
    manifests: int = 0
    last_step: int = -1
    host_bytes: int = 0  # the base blob + the blob in flight
    cpu_s: float = 0.0  # the thread's CPU time on records and commits
    stride: int = 1  # steps between records (see the module doc)
    durable_s: list[float] = field(default_factory=list)  # rank 0: offer -> manifest, per step
    delta_bytes: list[int] = field(default_factory=list)  # each delta record's size


@dataclass(kw_only=True)
class JobInfo:
    """What rank 0 puts in every manifest besides the records."""

    job_id: str
    generation: int
    world_size: int
    model: dict = field(default_factory=dict)  # layout, config, fixed tensors' path
    # a fingerprint vote checks the ranks' state: a manifest waits until the vote vouched
    # for its step (`Keys.VOUCHED`; module doc, "Vouched")
    voted: bool = False


class Persister:
    """One rank's background writer to the persistent tier: takes the snapshot its
    snapshot thread just copied (`offer`, never a wait), writes a base every
    `Persistence.every` records and deltas between, within its CPU share (a stride of
    steps), and announces each durable record; rank 0 writes the step's manifest, the
    commit, once every rank's record is durable. Storage errors are counted and reported,
    and training goes on."""

    def __init__(self, tier: FsspecTier, *, rank: int, shm_dir: str, cfg: Persistence,
                 job: JobInfo, connect: Callable[[], dist.Store],
                 emit: Callable[..., None]) -> None:
        self.tier, self.rank, self.shm_dir, self.cfg, self.job = tier, rank, shm_dir, cfg, job
        self._connect = connect
        self._emit = emit
        self.stats = PersistStats()
        # the launch's token (its agent put it in the environment), else the one of the
        # lease our job holds (a worker started by another node's agent)
        self.lease = WriterLease(tier, job.job_id, os.environ.get(TOKEN_ENV))
        self._lease_t = -RENEW_S  # when the lease was last renewed or checked
        self._reported: set[int] = set()  # manifests garbage collection kept and named
        self._base: tuple[int, bytes] | None = None
        self._base_hashes = None  # its chunks' hashes, computed once
        self._base_checksum: str | None = None  # its checksum (its record's), likewise
        self._pending: int | None = None
        self._writing = -1  # the step the thread is persisting now (-1: none)
        self._done_step = -1  # newest step this rank made durable (or gave up on)
        self._committed = -1  # rank 0: newest manifest written
        self._committed_steps: set[int] = set()  # rank 0: this generation's manifests
        self._candidates: list[int] = []
        self._offered: dict[int, float] = {}  # step -> when it was offered (for durable_s)
        self._failed_step = -1  # newest step whose record could not be written
        self._cond = threading.Condition()
        self._stopped = False
        self.stride = 1  # persist only steps that are multiples of it (rank 0 decides)
        self._record_cpu_s = 0.0  # CPU per record written, smoothed (rank 0: the stride's input)
        self._since_base = 0  # records written since the last base
        self._latest = -1  # the newest step offered, on the stride or not
        self._last_offer_t: float | None = None
        # time between offers (one per step): the median of the last GAPS gaps. A smoothed
        # mean kept the first steps' warm-up (or a pause) for dozens of steps, so the
        # stride came out too fine and the persister took far more than its share early on
        # (seen: 7 records in 55 steps where the share allowed 2)
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS)
        self._step_s = 0.0
        self._thread = threading.Thread(target=self._run, name=f"phoenixft-persist-r{rank}",
                                        daemon=True)
        self._thread.start()

    # -- the snapshot thread's side -----------------------------------------------------
    def offer(self, step: int) -> None:
        """Step `step`'s slot is complete in shared memory: persist it when the thread is
        free, if it is on the stride. Never blocks; a step still pending is replaced
        (coalesced)."""
        with self._cond:
            now = time.perf_counter()
            if self._last_offer_t is not None and step > self._latest:
                self._gaps.append((now - self._last_offer_t) / (step - self._latest))
                self._step_s = statistics.median(self._gaps)
            self._last_offer_t, self._latest = now, step
            if self.cfg.cpu_share < 1 and 0 < len(self._gaps) < MIN_GAPS:
                return  # the step time is not known yet: only the first offer is taken
            if step % self.stride:
                return  # not a step to persist (a later one on the stride will be)
            self._take(step)

    def _take(self, step: int) -> None:
        """(Under the lock) make `step` the one pending offer."""
        if self._pending is not None:
            self.stats.coalesced += 1
            self._done_step = max(self._done_step, self._pending)
        self._pending = step
        if self.rank == 0:
            self._offered[step] = time.perf_counter()
        self._cond.notify_all()

    def flush(self, step: int, timeout_s: float) -> bool:
        """Wait until `step` is durable (rank 0: committed by a manifest). False at once if
        this rank failed to write it, else when the deadline passed (storage slow)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            taken = max(self._done_step, self._writing,
                        -1 if self._pending is None else self._pending)
            if self._latest > taken:  # (not one being written: it would be written twice)
                self._take(self._latest)  # the last step offered is persisted, off the stride too
            ok = self._wait_locked(
                lambda: (self._committed if self.rank == 0 else self._done_step) >= step,
                deadline, failed=lambda: self._failed_step >= step)
        if ok and self.rank == 0:  # the job's last commit: records no manifest needs go
            # (a rank's record of a step that never committed stayed for good otherwise:
            # garbage is collected when a base commits, and no base may come again)
            try:
                self._collect_garbage()
            except Exception as exc:  # noqa: BLE001 - storage errors: said, never raised
                self._emit("persist_failed", step=step, error=f"garbage collection: {exc}"[:500],
                           errors=self.stats.errors)
        return ok

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (bounded) until nothing is pending or being written; False at the deadline.
        For measurements that must charge a record's work to the steps that caused it."""
        with self._cond:
            return self._wait_locked(lambda: self._pending is None and self._writing < 0,
                                     time.monotonic() + timeout_s)

    def _wait_locked(self, done: Callable[[], bool], deadline: float,
                     failed: Callable[[], bool] = lambda: False) -> bool:
        """(Under the lock) wait until `done()`; False at the deadline, once the persister
        stopped, or once `failed()`."""
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self._stopped or failed():
                return False
            self._cond.wait(min(left, 0.2))
        return True

    def stop(self, join_timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(join_timeout_s)

    # -- the persister thread -----------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(1)  # this thread's own count (see Snapshotter._run)
        store = self._connect()
        while True:
            with self._cond:
                while self._pending is None and not self._stopped:
                    self._cond.wait(0.2)
                    if self.rank == 0 and self._candidates:
                        break  # look again whether the other ranks caught up
                if self._stopped:
                    return
                step, self._pending = self._pending, None
                self._writing = -1 if step is None else step
            cpu0 = time.thread_time()
            wrote = False
            try:
                if step is not None:
                    wrote = self._persist(store, step)
                if self.rank == 0:
                    self._commit(store)
            except Exception as exc:  # noqa: BLE001 - storage trouble never stops training
                self._failed(store, step, exc)
            cpu = time.thread_time() - cpu0
            self.stats.cpu_s += cpu
            if wrote:  # (a skipped slot or a failed write says nothing of a record's cost)
                self._record_cpu_s = (cpu if not self._record_cpu_s
                                      else 0.7 * self._record_cpu_s + 0.3 * cpu)
                self._set_stride(store)
            with self._cond:
                if step is not None:
                    self._done_step = max(self._done_step, step)
                self._writing = -1
                self._cond.notify_all()

    def _set_stride(self, store: dist.Store) -> None:
        """Rank 0: the stride that keeps a record's CPU within `cpu_share` of the steps
        between records (the smallest power of two that does, raised at once, lowered only
        when a quarter less than half of it would do); the others take it. A share of 1
        persists every step it can (stride 1, coalescing when busy); no stride is set
        before a step's time is known."""
        if self.cfg.cpu_share >= 1 or (self.rank == 0 and not self._step_s):
            return
        key = Keys.persist_stride(self.job.generation)
        try:
            if self.rank == 0:
                want = self._record_cpu_s / self.cfg.cpu_share / max(self._step_s, 1e-4)
                stride = 1 << max(0, math.ceil(math.log2(max(want, 1.0))))
                if stride < self.stride and want > 0.75 * self.stride / 2:
                    stride = self.stride  # (no flapping between two strides)
                if stride != self.stride:
                    store.set(key, str(stride))
                    self._emit("persist_stride", stride=stride,
                               cpu_s=round(self._record_cpu_s, 4), step_s=round(self._step_s, 4))
            else:
                stride = kv.get_int(store, key, self.stride)
        except Exception:  # noqa: BLE001 - the store is gone: keep the stride we have
            return
        self.stride = stride
        self.stats.stride = stride

    def _read_slot(self, step: int) -> bytes | None:
        """A verified copy of this rank's slot for `step` (verified after copying: the
        live slot may be rewritten meanwhile), or None."""
        f = SlotFile(slot_path(self.shm_dir, SlotKind.SNAP, self.rank, step))
        try:
            blob = bytes(f.np[:f.used_nbytes()])
            verify_blob(blob, step)
            return blob
        except IntegrityError:
            return None

    def _hold_lease(self) -> None:
        """At least every RENEW_S, before a record: rank 0 renews the writer lease, the
        others check it (`writer_lease.py`); LeaseLost when another launch took it over."""
        now = time.monotonic()
        if now - self._lease_t < RENEW_S:
            return
        if self.rank == 0:
            self.lease.renew()
        else:
            self.lease.check()
        self._lease_t = now

    def _persist(self, store: dist.Store, step: int) -> bool:
        """Write `step`'s record; False when its slot was rewritten first (nothing written)."""
        self._hold_lease()
        blob = self._read_slot(step)
        if blob is None:  # rewritten before we could read it: a newer step will come
            self.stats.coalesced += 1
            return False
        base = self._base
        if base is not None and (self._since_base >= self.cfg.every or len(base[1]) != len(blob)
                                 or not self._ready(store, base[0])):
            base = None  # (a base some rank lacks is never committed: module doc)
        t0 = time.perf_counter()
        info = self.tier.put(step, self.rank, blob, base=base, chunk=CHUNK,
                             base_hashes=self._base_hashes if base is not None else None,
                             base_checksum=self._base_checksum if base is not None else None)
        self.stats.write_s += time.perf_counter() - t0
        if info.kind == "base":
            self._base, self._base_checksum = (step, blob), info.checksum
            self._base_hashes = chunk_hashes(blob, CHUNK)
            self.stats.bases += 1
            self._since_base = 1
        else:
            self.stats.delta_bytes.append(info.nbytes)
            self._since_base += 1
        self.stats.records += 1
        self.stats.bytes_written += info.nbytes
        self.stats.blob_bytes += len(blob)
        self.stats.last_step = step
        self.stats.host_bytes = len(blob) + (len(self._base[1]) if self._base else 0)
        kv.set_json(store, Keys.persisted(self.job.generation, step, self.rank), info_dict(info))
        if self.rank == 0:
            self._candidates.append(step)
        return True

    def _ready(self, store: dist.Store, step: int) -> bool:
        """Has every rank of the generation announced its record of `step`?"""
        return store.check([Keys.persisted(self.job.generation, step, r)
                            for r in range(self.job.world_size)])

    def _commit(self, store: dist.Store) -> None:
        """Rank 0: write the manifests of the newest step every rank made durable (and a
        vote vouched for, when one is held: module doc, "Vouched") and of each older one
        that holds a base (module doc: a ready base is always committed)."""
        upto = kv.get_int(store, Keys.VOUCHED, -1) if self.job.voted else math.inf
        newest = next((s for s in sorted(self._candidates, reverse=True)
                       if s <= upto and self._ready(store, s)), None)
        if newest is None:
            return
        # (readiness of the older steps is final now that a newer one is ready)
        older = [s for s in sorted(self._candidates) if s < newest and self._ready(store, s)]
        self._candidates = [s for s in self._candidates if s > newest]
        self.lease.check()  # (a lease taken over meanwhile: this run must not commit)
        for step in older + [newest]:
            records = [kv.get_json(store, Keys.persisted(self.job.generation, step, r))
                       for r in range(self.job.world_size)]
            if step == newest or any(r["kind"] == "base" for r in records):
                self._write_manifest(store, step, records)

    def _write_manifest(self, store: dist.Store, step: int, records: list[dict]) -> None:
        lost = sorted({r["base_step"] for r in records if r["kind"] == "delta"}
                      - self._committed_steps)
        if lost:  # (never, by the protocol in the module doc; a manifest would not restore)
            self._emit("persist_failed", step=step, errors=self.stats.errors,
                       error=f"not committed: deltas on bases {lost} that no manifest commits")
            return
        manifest = {
            "step": step, "job_id": self.job.job_id, "generation": self.job.generation,
            "world_size": self.job.world_size, "time": time.time(), "records": records,
            "model": self.job.model}
        self.tier.write_manifest(step, manifest)
        kv.raise_to(store, Keys.PERSISTED, step)
        self._committed_steps.add(step)
        with self._cond:
            self._committed = step
            t = self._offered.pop(step, None)
            for s in [s for s in self._offered if s < step]:
                del self._offered[s]
        if t is not None:
            self.stats.durable_s.append(time.perf_counter() - t)
        self.stats.manifests += 1
        self._emit("persisted", step=step, records=len(records),
                   bytes=sum(r["nbytes"] for r in records),
                   kinds=sorted({r["kind"] for r in records}))
        if self.stats.manifests == 1 or any(r["kind"] == "base" for r in records):
            self._collect_garbage()  # only a new base can make older records unneeded

    def _collect_garbage(self) -> None:
        """(`manifests.collect_garbage`) Each manifest it keeps for being unreadable or
        another job's is named once in the event log."""
        def report(step: int, why: str) -> None:
            if step not in self._reported:
                self._reported.add(step)
                self._emit("persist_kept", step=step, reason=why[:500])

        collect_garbage(self.tier, self.cfg.keep, self.job.job_id, report)

    def _failed(self, store: dist.Store, step: int | None, exc: Exception) -> None:
        self.stats.errors += 1
        if step is not None:
            self._failed_step = max(self._failed_step, step)
        text = f"{type(exc).__name__}: {exc}"
        if self.stats.errors == 1 or self.stats.errors % 20 == 0:
            self._emit("persist_failed", step=step, error=text[:500], errors=self.stats.errors)
        try:
            store.set(Keys.persist_error(self.rank), json.dumps({"step": step, "error": text[:300],
                                                                 "errors": self.stats.errors}))
            store.add(Keys.PERSIST_ERRORS, 1)
        except Exception:
            pass



def write_fixed(tier: FsspecTier, generation: int, tensors: dict) -> dict:
    """Write a generation's untrained tensors (frozen parameters, buffers) once, for `ckpt
    export`; returns what the manifests say of them, their checksum included (`ckpt
    verify` and `export` check it: a damaged file used to pass verify and fail export)."""
    from safetensors.torch import save

    data = save(tensors) if tensors else save({})
    rel = f"model/g{generation:04d}.safetensors"
    tier.write_object(rel, data)
    return {"fixed": rel, "fixed_checksum": checksum(data)}

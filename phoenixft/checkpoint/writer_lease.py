"""The writer lease: one job at a time persists to a URL.

Two jobs persisting to one URL interleave their manifests and records (same step numbers,
same file names), and one job's committed steps silently become the other's. So the URL
holds one small object, ``writer.lease`` (JSON: job id, a token for this launch, the host
and PID that took it, the time it was last renewed, its time to live), and nothing is
persisted there without holding it:

- `phoenixft run --persist URL` takes it before any worker starts (`acquire`): a lease of
  another job that is fresh (renewed within `TTL_S`) refuses the launch with one line; a
  stale one (its job died without letting go) is taken over, with a warning. `--resume`
  of the same job takes a fresh lease over too (the job was just killed: waiting out the
  TTL would help nobody), except when its holder is a live phoenixft process on this host
  (the job is still running: refused).
- The launching agent renews it every `RENEW_S` while it runs and lets go at exit
  (`keep_renewed`); rank 0's persister renews it too (a standalone store's job outlives
  node 0's agent), and every persister checks it before writing: a lease that another
  launch took over stops this one persisting, loudly (`LeaseLost`, a `persist_failed`
  event and a console line), never its training.

Each change is a compare-and-swap, so two launches racing for a free lease cannot both
win: under an exclusive `flock` on a directory, a conditional PUT (If-None-Match /
If-Match) on S3. Freshness compares the renewer's wall clock with the reader's: the hosts'
clocks must agree to well within `TTL_S` (NTP does).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from phoenixft.checkpoint.tiers import FsspecTier

LEASE = "writer.lease"
TTL_S = 60.0  # a lease not renewed for this long is stale: its job is gone
RENEW_S = 10.0  # holders renew (and writers check) at least this often
TOKEN_ENV = "PHOENIXFT_PERSIST_LEASE"  # the launching agent's token, for its workers


class LeaseHeld(RuntimeError):
    """The URL's writer lease belongs to another job (or launch); the message says which
    and what to do."""


class LeaseLost(LeaseHeld):
    """A writer found its lease taken over: it must not write there any more."""


def describe(rec: dict, now: float | None = None) -> str:
    age = (now or time.time()) - rec.get("renewed", 0)
    return (f"job {rec.get('job_id')} (host {rec.get('host')}, pid {rec.get('pid')}; "
            f"renewed {age:.0f}s ago)")


def fresh(rec: dict, now: float | None = None) -> bool:
    return (now or time.time()) - rec.get("renewed", 0) < rec.get("ttl_s", TTL_S)


def _alive_here(rec: dict) -> bool | None:
    """The holder is a live phoenixft process on this host (a PID reused by anything else
    does not count); None when it is on another host (it cannot be told from here)."""
    if rec.get("host") != socket.gethostname() or not isinstance(rec.get("pid"), int):
        return None
    try:
        return b"phoenixft" in Path(f"/proc/{rec['pid']}/cmdline").read_bytes()
    except OSError:
        return False


class WriterLease:
    """The lease of `job_id` on `tier`'s URL; `token` names the launch. A writer without
    one (a worker started by another node's agent, a standalone session) takes the token
    of the lease its job holds when it first looks (`renew` or `check`), or makes one."""

    def __init__(self, tier: FsspecTier, job_id: str, token: str | None = None) -> None:
        self.tier, self.job_id, self.token = tier, job_id, token
        self._path = tier._path(LEASE)
        self._stop: threading.Event | None = None

    # -- one compare-and-swap ------------------------------------------------------------
    def _swap(self, decide: Callable[[dict | None], dict | None]) -> dict | None:
        """Read the lease, `decide` what it becomes (None: leave it) and write that only
        if nobody changed it meanwhile (else decide again). Returns what it holds now."""
        for _ in range(10):
            if self.tier.local:
                return self._swap_locked(decide)
            cur, etag = self._read_s3()
            new = decide(cur)
            if new is None:
                return cur
            if self._put_s3(new, etag):
                return new
        raise LeaseHeld(f"{self.tier.url}/{LEASE}: changed under us 10 times in a row "
                        "(another launch keeps writing it)")

    def _swap_locked(self, decide: Callable[[dict | None], dict | None]) -> dict | None:
        import fcntl

        os.makedirs(self.tier.root, exist_ok=True)
        with open(self.tier._path(".writer.lock"), "ab") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            try:
                cur = _parse(Path(self._path).read_bytes())
            except FileNotFoundError:
                cur = None
            new = decide(cur)
            if new is not None:
                self.tier.write_atomic(self._path, json.dumps(new).encode())
            return new if new is not None else cur

    def _read_s3(self) -> tuple[dict | None, str | None]:
        fs = self.tier.fs
        fs.invalidate_cache(self._path)
        try:
            etag = fs.info(self._path)["ETag"]
            return _parse(fs.cat_file(self._path)), etag
        except FileNotFoundError:
            return None, None

    def _put_s3(self, rec: dict, etag: str | None) -> bool:
        fs = self.tier.fs
        bucket, key, _ = fs.split_path(self._path)
        cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=json.dumps(rec).encode(), **cond)
        except OSError as exc:  # s3fs: FileExistsError, or OSError(EINVAL) for If-Match
            if isinstance(exc, FileExistsError) or "pre-condition" in str(exc):
                return False  # another writer was first: read again
            raise
        finally:
            fs.invalidate_cache(self._path)
        return True

    def _mine(self, since: float | None = None) -> dict:
        now = time.time()
        self.token = self.token or uuid.uuid4().hex
        return {"job_id": self.job_id, "token": self.token, "host": socket.gethostname(),
                "pid": os.getpid(), "since": since or now, "renewed": now, "ttl_s": TTL_S}

    # -- what holders do -----------------------------------------------------------------
    def acquire(self, *, resume: bool) -> str | None:
        """Take the lease for a launch (see the module doc). Returns a warning to show when
        a lease was taken over, None when it was free; LeaseHeld when refused."""
        said: list[str] = []

        def decide(cur: dict | None) -> dict | None:
            said.clear()
            if cur is None or (self.token and cur.get("token") == self.token):
                return self._mine()
            if cur.get("unreadable"):
                said.append(f"the writer lease {self.tier.url}/{LEASE} was unreadable "
                            f"({cur['unreadable']}): replaced")
                return self._mine()
            held = describe(cur)
            if not fresh(cur):
                said.append(f"the writer lease of {held} is stale: taken over")
                return self._mine()
            if cur.get("job_id") != self.job_id:
                raise LeaseHeld(f"--persist {self.tier.url} is being written by {held}: give "
                                "this job another URL, or stop that job first (a lease not "
                                f"renewed for {TTL_S:.0f}s is stale and taken over)")
            alive = _alive_here(cur)
            if not resume or alive:
                raise LeaseHeld(f"--persist {self.tier.url}: {held} is still running and "
                                "writing there: stop it before resuming it")
            if alive is None:  # (on this host and gone: the job was killed; nothing to say)
                said.append(f"the writer lease of {held} is taken over: that run, if it is "
                            "still alive, stops persisting")
            return self._mine()

        self._swap(decide)
        return said[0] if said else None

    def holder(self) -> dict | None:
        """Who holds the lease now, while fresh (None: free or stale)."""
        cur = self._swap(lambda cur: None)
        return cur if cur is not None and not cur.get("unreadable") and fresh(cur) else None

    def _ours(self, cur: dict) -> bool:
        """`cur` is this launch's lease (adopting its token if we have none yet)."""
        if self.token is None and cur.get("job_id") == self.job_id and cur.get("token"):
            self.token = cur["token"]
        return cur.get("token") == self.token

    def renew(self) -> None:
        """Holder: refresh the lease (take it again if it is gone); LeaseLost when another
        launch holds it now."""
        def decide(cur: dict | None) -> dict | None:
            if cur is None or cur.get("unreadable"):
                return self._mine()
            if not self._ours(cur):
                raise self._lost(cur)
            return self._mine(since=cur.get("since"))

        self._swap(decide)

    def check(self) -> None:
        """Writer: LeaseLost unless the lease is this launch's (or free: the holder renews)."""
        cur = self._swap(lambda cur: None)
        if cur is not None and not cur.get("unreadable") and not self._ours(cur):
            raise self._lost(cur)

    def release(self) -> None:
        """Let go, if the lease is still ours (a launch that ends stops writing)."""
        if self._stop is not None:
            self._stop.set()
        try:
            cur = self._swap(lambda cur: None)
            if cur is not None and self.token and cur.get("token") == self.token:
                self.tier.fs.rm(self._path)
        except Exception:  # noqa: BLE001 - at exit: a stale lease expires on its own
            pass

    def _lost(self, cur: dict) -> LeaseLost:
        return LeaseLost(f"the writer lease of {self.tier.url} is held by {describe(cur)}, not "
                         f"by this run of job {self.job_id}: this run no longer persists there")

    def keep_renewed(self, every_s: float = RENEW_S) -> None:
        """Renew from a daemon thread until `release` (errors are retried: storage that is
        down for a while is not a reason to stop; a lease taken over ends the thread)."""
        self._stop = stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.renew()
                except LeaseLost:
                    return
                except Exception:  # noqa: BLE001 - storage trouble: try again next time
                    continue

        threading.Thread(target=loop, name="phoenixft-lease", daemon=True).start()


def _parse(data: bytes) -> dict:
    try:
        rec = json.loads(data)
        if isinstance(rec, dict):
            return rec
    except ValueError:
        pass
    return {"unreadable": f"{len(data)} bytes, not a lease record"}

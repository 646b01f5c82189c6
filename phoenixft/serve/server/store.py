"""The front's record of requests: accepted ones (so a restarted server resubmits what no
log holds) and finished ones' results (so a retry with the same `Idempotency-Key` gets
the completion computed once), in the run directory when there is one (atomic JSON
files, `requests/<id>.json`), and in memory.

Finished requests are kept for a bounded time and number (`keep`, `keep_s`; the flags
`--keep-finished-requests`, `--keep-finished-seconds`): a run directory used for weeks
would otherwise hold every request ever served, and the front's memory every result.
The oldest are dropped first, when a request finishes and when the store is loaded; a
retry after that is computed again. A request that ends without a result (aborted by its
client, failed) is dropped at once: nothing will ask for it again, and a restarted
server must not resubmit it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

DEFAULT_KEEP = 1000
DEFAULT_KEEP_S = 24 * 3600.0


def key_id(key: str) -> str:
    """An Idempotency-Key as it is stored (a digest: keys are the client's secrets)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class RequestStore:
    def __init__(self, run_dir: str | Path | None, *, keep: int = DEFAULT_KEEP,
                 keep_s: float = DEFAULT_KEEP_S) -> None:
        if keep < 0 or not keep_s >= 0:  # NaN fails too
            raise ValueError(f"--keep-finished-requests {keep} / --keep-finished-seconds "
                             f"{keep_s}: give numbers >= 0")
        self.keep, self.keep_s = keep, keep_s
        self.dir = Path(run_dir) / "requests" if run_dir else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        # finished requests, oldest first: id -> (finished at, key digest or None)
        self.finished_at: OrderedDict[str, tuple[float, str | None]] = OrderedDict()

    def _write(self, rid: str, record: dict) -> None:
        if self.dir is None:
            return
        tmp = self.dir / f".{rid}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.dir / f"{rid}.json")

    def accepted(self, p) -> None:
        s = p.seq
        self._write(s.seq_id, {"id": s.seq_id, "endpoint": p.endpoint, "key": p.key,
                               "body_sha": p.body_sha, "prompt": s.prompt_token_ids,
                               "params": asdict(s.params), "seed": s.seed,
                               "adapter": s.adapter, "adapter_version": s.adapter_version,
                               "created": time.time()})

    def finished(self, rid: str, key: str | None, result: dict) -> list[tuple[str, str | None]]:
        """Store a result; returns the (id, key digest) of the finished requests dropped
        to stay within the retention limits."""
        now = time.time()
        if self.dir is not None:
            path = self.dir / f"{rid}.json"
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                record = {"id": rid}
            record["result"], record["finished"] = result, now
            self._write(rid, record)
        self.finished_at.pop(rid, None)
        self.finished_at[rid] = (now, key_id(key) if key else None)
        return self.prune(now)

    def discard(self, rid: str) -> None:
        """A request that ended without a result: nothing is kept of it."""
        self.finished_at.pop(rid, None)
        if self.dir is not None:
            try:
                os.unlink(self.dir / f"{rid}.json")
            except FileNotFoundError:
                pass

    def prune(self, now: float | None = None) -> list[tuple[str, str | None]]:
        now = time.time() if now is None else now
        dropped = []
        while self.finished_at:
            rid, (t, key) = next(iter(self.finished_at.items()))
            if len(self.finished_at) <= self.keep and now - t <= self.keep_s:
                break
            self.discard(rid)
            dropped.append((rid, key))
        return dropped

    def load(self) -> list[dict]:
        """The records of the run directory, finished ones within the retention limits
        (the others are deleted now)."""
        if self.dir is None:
            return []
        out = []
        for f in self.dir.glob("*.json"):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        done = sorted((r for r in out if "result" in r),
                      key=lambda r: r.get("finished") or r.get("created") or 0.0)
        for r in done:
            self.finished_at[r["id"]] = (r.get("finished") or r.get("created") or 0.0,
                                         key_id(r["key"]) if r.get("key") else None)
        gone = {rid for rid, _ in self.prune()}
        return sorted((r for r in out if r["id"] not in gone), key=lambda r: r["id"])

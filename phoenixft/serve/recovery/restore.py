"""Rebuild a serving engine from its recovery log (log.py): replay the records up to the
last valid commit into a fresh engine (same model and configuration, KV cache empty):
KV records are scattered back into the cache, state records rebuild the requests, and the
engine takes them over where they stood. Records after the last commit and torn or damaged
ones are dropped and reported; the tokens they covered are computed again (sampling is a
pure function of the request's seed, the token index and the logits, so they come out the
same). The log is then cut at that commit, so the next writer continues a valid log.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from phoenixft.serve.engine.adapters import Adapter

from .log import ADAPTER, FULL, KV, STATE, cut_after_commit, replay
from .regions import KVRegion, StateTable


@dataclass
class RecoveryReport:
    last_commit: int = -1
    records: int = 0
    kv_records: int = 0
    dropped_records: int = 0
    damage: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    waiting: int = 0
    adapters: int = 0
    next_seq: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"last_commit": self.last_commit, "records": self.records,
                "kv_records": self.kv_records, "dropped_records": self.dropped_records,
                "damage": self.damage, "resumed": len(self.resumed), "waiting": self.waiting,
                "adapters": self.adapters,
                "seconds": round(self.seconds, 4)}


def recover(engine, log_dir: str | Path) -> RecoveryReport:
    t0 = time.perf_counter()
    rep = replay(log_dir)
    kv = KVRegion(engine.runner.k_cache, engine.runner.v_cache)
    table = StateTable()
    out = RecoveryReport(last_commit=rep.last_commit, records=len(rep.records),
                         dropped_records=rep.dropped_records, damage=list(rep.damage),
                         next_seq=rep.next_seq)
    for r in rep.records:
        if r.kind == KV:
            kv.apply(r.payload)
            out.kv_records += 1
        elif r.kind == STATE:
            table.apply(r.payload, bool(r.flags & FULL))
        elif r.kind == ADAPTER:
            (n,) = struct.unpack_from("<I", r.payload, 0)
            meta = json.loads(r.payload[4:4 + n])
            engine.adapters.install(Adapter.from_bytes(r.payload[4 + n:], meta))
            out.adapters += 1
    waiting, running = table.sequences()
    engine.install(waiting, running)
    cut_after_commit(log_dir, rep)
    out.resumed = [s.seq_id for s in (*running, *waiting)]
    out.waiting = len(waiting)
    out.seconds = time.perf_counter() - t0
    return out

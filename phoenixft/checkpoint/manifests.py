"""Which committed manifests a URL holds, read once, the damaged ones named, never deleted.

One unreadable manifest (truncated, overwritten, a flipped byte) used to stop `--resume`,
`ckpt ls` and `ckpt verify` although the older manifests were intact: every reader now
goes through `scan`, which keeps the readable ones and names each bad file with why, and
garbage collection (`collect_garbage`) passes over what it cannot read or what another
job committed instead of deleting it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.tiers import FsspecTier


@dataclass
class Scan:
    good: dict[int, dict] = field(default_factory=dict)  # step -> manifest, oldest first
    bad: dict[int, str] = field(default_factory=dict)  # step -> why it cannot be read (names the file)

    @property
    def steps(self) -> list[int]:
        return sorted(self.good)

    def newest(self, job_id: str | None = None) -> dict | None:
        """The newest readable manifest (of `job_id` when given)."""
        steps = [s for s, m in self.good.items() if job_id is None or m["job_id"] == job_id]
        return self.good[max(steps)] if steps else None

    def jobs(self) -> dict[str, list[int]]:
        """Job id -> its committed steps (more than one job: the URL was shared)."""
        out: dict[str, list[int]] = {}
        for s in self.steps:
            out.setdefault(self.good[s]["job_id"], []).append(s)
        return out


def scan(tier: FsspecTier, steps: list[int] | None = None) -> Scan:
    """Read every manifest (or those of `steps`); a missing one (deleted meanwhile) is
    left out, an unreadable one is in `bad`."""
    out = Scan()
    for s in tier.manifests() if steps is None else steps:
        try:
            out.good[s] = tier.read_manifest(s)
        except IntegrityError as exc:
            out.bad[s] = str(exc)
        except KeyError:
            continue
    return out


def collect_garbage(tier: FsspecTier, keep: int, job_id: str,
                    report: Callable[[int, str], None] = lambda step, why: None) -> None:
    """Keep the newest `keep` base steps of rank 0 of `job_id` and everything newer; drop
    that job's older manifests, then records no kept manifest needs (never one newer than
    the newest manifest: it may be in flight). Manifests that cannot be read, or that
    another job committed, are never deleted, nor the records those of other jobs use;
    each is `report`ed (step, why)."""
    found = scan(tier)
    if not found.good:
        return
    for s, why in found.bad.items():
        report(s, why)
    mine = {s: m for s, m in found.good.items() if m["job_id"] == job_id}
    others = {s: m for s, m in found.good.items() if m["job_id"] != job_id}
    for s, m in others.items():
        report(s, f"{tier.url}: step {s} was committed by job {m['job_id']}, not {job_id}: kept")
    if not mine:
        return
    bases = sorted({r["step"] if r["kind"] == "base" else r["base_step"]
                    for m in mine.values() for r in m["records"] if r["rank"] == 0})
    floor = bases[-keep] if len(bases) >= keep else bases[0]
    kept = {s: m for s, m in mine.items() if s >= floor} | others
    needed = set()
    for m in kept.values():
        for r in m["records"]:
            needed.add((r["step"], r["rank"]))
            if r["kind"] == "delta":
                needed.add((r["base_step"], r["rank"]))
    for s in mine:
        if s not in kept:
            tier.delete_manifest(s)
    newest = max([*found.good, *found.bad])
    for rec in tier.list():
        if rec.step < newest and (rec.step, rec.rank) not in needed:
            tier.delete(rec.step, rec.rank)


def records_missing(tier: FsspecTier, manifest: dict) -> str | None:
    """Why `manifest`'s step cannot be restored as far as a listing tells (a record or a
    delta's base missing, a record not of its committed size), or None. Cheap (no record
    is read): the launcher names the step the workers will restore, and they verify every
    checksum on top (a flipped byte is only found there, and named in the event log)."""
    for r in manifest["records"]:
        path = tier.locate(r["step"], r["rank"], r["kind"])
        try:
            size = tier.fs.info(path)["size"]
        except FileNotFoundError:
            return f"{tier._url_of(path)}: missing"
        if r.get("nbytes") and size != r["nbytes"]:
            return f"{tier._url_of(path)}: {size} bytes, committed with {r['nbytes']} (truncated?)"
        if r["kind"] == "delta" and not tier.fs.exists(tier.locate(r["base_step"], r["rank"], "base")):
            return f"{tier._url_of(path)}: its base (step {r['base_step']}) is missing"
    return None

"""What `--persist URL` and `--resume` mean at launch, checked before anything starts.

- The storage must be reachable and writable: node 0's agent reads the manifests and
  takes the URL's writer lease (`checkpoint/writer_lease.py`) before any worker starts, within
  `CHECK_S`; what fails (no credentials, an endpoint that does not answer, no such
  bucket, a file in the way) is one line naming the cause and the fix.
- One job writes a URL at a time: another job's fresh lease refuses the launch; the
  agent renews the lease while it runs and lets go at exit, and hands its token to its
  workers (`TOKEN_ENV` in their environment) so that their persisters stop if a later
  launch takes the lease over.
- `--persist URL` on storage that already holds another job's committed checkpoints is
  refused (writing there would interleave two jobs and could delete the other's data);
  `--resume` is how to continue that job.
- `--resume` continues the job of the newest readable manifest: same job id (and so the
  same records), every rank restored from its persisted step by the workers' restore
  planner. A manifest that cannot be read, or whose records are not all there at their
  committed sizes, is named and passed over (never deleted); manifests of other jobs are
  named and never restored. On a URL with nothing committed it is refused, naming the URL.
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
from collections.abc import Callable

from phoenixft.launch.config import AgentConfig, LaunchError

CHECK_S = 60.0  # the storage check at launch answers within this, or the launch is refused


def check_init_from(cfg: AgentConfig) -> None:
    """`--init-from DIR` names a readable checkpoint in DCP's default format (its
    `.metadata`, unpickled safely) with a model in it, or the launch is refused."""
    url = cfg.persistence.init_from
    if not url:
        return
    from phoenixft.checkpoint import dcp_checkpoint
    from phoenixft.checkpoint.integrity import IntegrityError

    try:
        keys = _within(lambda: dcp_checkpoint.saved_keys(url), CHECK_S)
    except IntegrityError as exc:
        raise LaunchError(f"--init-from: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - storage errors: one line, not a traceback
        raise LaunchError(f"--init-from {url}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not any(not k.startswith(("optimizer.", "train_state.", "lr_scheduler.", "dataloader."))
               for k in keys):
        raise LaunchError(f"--init-from {url}: the checkpoint holds no model tensors (only "
                          f"{', '.join(sorted(keys)[:3])}...)")


def persisted_job(cfg: AgentConfig) -> str | None:
    """The job id to run with (the persisted one with --resume, a new one otherwise),
    holding the URL's writer lease; None without --persist. LaunchError when the
    combination cannot be right or the storage cannot be used."""
    if not cfg.persistence.url:
        return None
    from phoenixft.checkpoint.storage_errors import explain

    try:
        return _within(lambda: _claim(cfg), CHECK_S)
    except TimeoutError:
        raise LaunchError(f"--persist {cfg.persistence.url}: no answer from the storage within "
                          f"{CHECK_S:.0f}s: is the endpoint up and reachable from here?") from None
    except LaunchError:
        raise
    except Exception as exc:  # noqa: BLE001 - s3fs/botocore errors: one line, not a traceback
        raise LaunchError(f"--persist {explain(cfg.persistence.url, exc)}") from None


def _claim(cfg: AgentConfig) -> str:
    from phoenixft.checkpoint.manifests import records_missing, scan
    from phoenixft.checkpoint.tiers import FsspecTier
    from phoenixft.checkpoint.writer_lease import TOKEN_ENV, LeaseHeld, WriterLease, describe

    tier = FsspecTier(cfg.persistence.url)
    found = scan(tier)
    if not cfg.persistence.resume and (found.good or found.bad):
        holder = WriterLease(tier, "").holder()  # a job writing there now is the news
        if holder is not None:
            raise LaunchError(f"--persist {cfg.persistence.url} is being written by {describe(holder)}: "
                              "give this job another URL, or stop that job first")
    for why in found.bad.values():
        _warn(f"passed over {why} (kept; `phoenixft ckpt verify {cfg.persistence.url}` checks the rest)")
    newest = found.newest()
    if cfg.persistence.resume:
        if newest is None:
            raise LaunchError(f"--resume: {cfg.persistence.url} holds no {'readable ' if found.bad else ''}"
                              "committed checkpoint (no manifest"
                              f"{' that can be read' if found.bad else ''}): nothing to resume; "
                              "run without --resume to start")
        job = newest["job_id"]
        jobs = found.jobs()
        if len(jobs) > 1:
            others = ", ".join(f"job {j} (steps {s[0]}-{s[-1]})" for j, s in jobs.items() if j != job)
            _warn(f"{cfg.persistence.url} also holds the checkpoints of {others}: resuming job {job} "
                  "(the newest); the others are kept and never restored")
        start = None
        for s in reversed(jobs[job]):
            why = records_missing(tier, found.good[s])
            if why is None:
                start = found.good[s]
                break
            _warn(f"passed over step {s}: {why}")
        if start is None:
            raise LaunchError(f"--resume: none of job {job}'s committed steps in {cfg.persistence.url} "
                              "has all its records (see the lines above)")
    elif newest is not None:
        raise LaunchError(f"--persist {cfg.persistence.url} already holds job {newest['job_id']}'s "
                          f"checkpoints (newest step {newest['step']}): pass --resume to "
                          "continue it, or give this job another URL")
    elif found.bad:
        raise LaunchError(f"--persist {cfg.persistence.url} holds {len(found.bad)} manifest(s), none "
                          "readable (named above): give this job another URL, or move them away")
    else:
        job = uuid.uuid4().hex[:12]
    lease = WriterLease(tier, job)
    try:
        warning = lease.acquire(resume=cfg.persistence.resume)
    except LeaseHeld as exc:
        raise LaunchError(str(exc)) from None
    if warning:
        _warn(warning)
    os.environ[TOKEN_ENV] = lease.token  # the workers' persisters check the lease with it
    lease.keep_renewed()
    atexit.register(lease.release)
    if cfg.persistence.resume:
        print(f"phoenixft: resuming job {job} from step {start['step']} ({start['world_size']} "
              f"ranks) in {cfg.persistence.url}: training continues at step {start['step'] + 1}",
              flush=True)
    return job


def _warn(text: str) -> None:
    print(f"phoenixft: warning: {text}", flush=True)


def _within(fn: Callable[[], str], timeout_s: float) -> str:
    """`fn()` on a daemon thread, its exception re-raised here; TimeoutError when it has
    not returned within `timeout_s` (an S3 endpoint that drops packets is retried by
    botocore for minutes)."""
    out: list = []

    def call() -> None:
        try:
            out.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append((False, exc))

    t = threading.Thread(target=call, name="phoenixft-persist-check", daemon=True)
    t.start()
    t.join(timeout_s)
    if not out:
        raise TimeoutError
    ok, value = out[0]
    if not ok:
        raise value
    return value


def newest_persisted(url: str | None, fallback: int) -> int:
    """The newest committed step in `url` (read from storage: the store may be gone), or
    `fallback` when storage cannot be read either; -1 without persistence."""
    if not url:
        return -1
    try:
        from phoenixft.checkpoint.tiers import FsspecTier

        steps = FsspecTier(url).manifests()
        return steps[-1] if steps else fallback
    except Exception:  # noqa: BLE001 - only a message depends on it
        return fallback

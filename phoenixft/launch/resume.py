"""What `--persist URL` and `--resume` mean at launch, checked before anything starts.

- `--persist URL` on storage that already holds another job's committed checkpoints is
  refused (writing there would interleave two jobs and could delete the other's data);
  `--resume` is how to continue that job.
- `--resume` continues the job of the newest manifest: same job id (and so the same
  records), every rank restored from its persisted step by the workers' restore planner.
  On a URL with nothing committed it is refused, naming the URL.
"""

from __future__ import annotations

from phoenixft.launch.config import AgentConfig, LaunchError


def persisted_job(cfg: AgentConfig) -> str | None:
    """The job id to continue (with --resume), None for a new job; LaunchError when the
    combination cannot be right."""
    if not cfg.persist:
        return None
    from phoenixft.checkpoint.integrity import IntegrityError
    from phoenixft.checkpoint.tiers import FsspecTier

    try:
        tier = FsspecTier(cfg.persist)
        steps = tier.manifests()
        newest = tier.read_manifest(steps[-1]) if steps else None
    except (OSError, IntegrityError, ValueError, ImportError) as exc:
        raise LaunchError(f"--persist {cfg.persist}: cannot read it ({type(exc).__name__}: "
                          f"{exc})") from None
    if cfg.resume:
        if newest is None:
            raise LaunchError(f"--resume: {cfg.persist} holds no committed checkpoint (no "
                              "manifest): nothing to resume; run without --resume to start")
        print(f"phoenixft: resuming job {newest['job_id']} from step {newest['step']} "
              f"({newest['world_size']} ranks) in {cfg.persist}", flush=True)
        return newest["job_id"]
    if newest is not None:
        raise LaunchError(f"--persist {cfg.persist} already holds job {newest['job_id']}'s "
                          f"checkpoints (newest step {newest['step']}): pass --resume to "
                          "continue it, or give this job another URL")
    return None


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

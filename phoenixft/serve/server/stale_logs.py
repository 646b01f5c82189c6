"""Recovery logs left in host memory by serving fronts that are gone.

A front started with `--run-dir` keeps its recovery log in `/dev/shm` when it dies (a
restarted server with the same run directory resumes the in-flight requests from it), so
a front that is never restarted leaves the log holding host memory for good. Each front
writes who owns its log (`owner.json`: its pid, that process's start time, the run
directory) before any engine starts; `phoenixft serve` names every log whose owner is no
longer running, what it holds, and the two ways out: resume it, or remove it. Nothing is
removed here: the user decides. A log without an owner record (a front still starting,
or one of phoenixft before this file) is passed over.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from phoenixft.platform import process_start

OWNER = "owner.json"
PREFIX = "phoenixft-serve-"


def claim(log_dir: str | Path, run_dir: str | Path | None) -> None:
    """Record this process as the log's owner (before its engines start)."""
    d = Path(log_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{OWNER}.{os.getpid()}"
    tmp.write_text(json.dumps({"front_pid": os.getpid(), "start": process_start(os.getpid()),
                               "run_dir": str(Path(run_dir).resolve()) if run_dir else None}))
    os.replace(tmp, d / OWNER)


@dataclass(frozen=True)
class StaleLog:
    path: Path
    run_dir: str | None
    nbytes: int

    def advice(self) -> str:
        size = f"{self.nbytes / 2**20:.0f} MiB" if self.nbytes >= 2**20 else f"{self.nbytes} bytes"
        resume = (f"`phoenixft serve MODEL_DIR --run-dir {self.run_dir}` resumes its requests; "
                  if self.run_dir else "")
        return (f"the recovery log {self.path} of a server that is gone holds {size} of host "
                f"memory: {resume}`rm -rf {self.path}` frees it")


def stale_logs(root: str | Path = "/dev/shm", exclude: str | Path | None = None) -> list[StaleLog]:
    """The logs under `root` whose owning front no longer runs."""
    out = []
    skip = Path(exclude).resolve() if exclude else None
    for d in sorted(Path(root).glob(f"{PREFIX}*")):
        try:
            owner = json.loads((d / OWNER).read_text())
            pid, start = int(owner["front_pid"]), owner["start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no owner record (yet): nothing to say of it
        if d.resolve() == skip or (start is not None and process_start(pid) == start):
            continue  # ours, or its front still runs
        nbytes = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out.append(StaleLog(d, owner.get("run_dir"), nbytes))
    return out

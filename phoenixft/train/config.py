"""Worker-side configuration: what the launcher tells a worker, with its defaults."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SessionConfig:
    """Set by `phoenixft run` through the environment; defaults give a standalone
    single-process session (handy in notebooks and unit tests)."""

    store: str | None = None  # HOST:PORT of the job's TCPStore; None = standalone
    local_addr: str = "127.0.0.1"  # this host's address, where process groups listen
    worker_id: str = "n0w0"
    node: int = 0
    run_dir: str | None = None
    shm_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="phoenixft-shm-"))
    inject: str = ""
    agent_pid: int | None = None  # the node's agent (for `node:` fault injection)
    heartbeat_interval_s: float = 0.2
    collective_timeout_s: float = 60.0  # backstop for one collective; hangs are caught sooner
    join_timeout_s: float = 60.0  # waiting for a plan, building a generation's groups
    spare_wait_s: float = 24 * 3600.0  # how long a spare waits to be activated
    # peers that hold a copy of each rank's snapshot; None: one on another node (none in a
    # one-node job), K: K peers, on other nodes first, then on this node
    replicas: int | None = None
    snapshots: bool = True  # off only to measure what snapshots cost (no recovery then)
    # benchmark only: snapshots on for K steps, then off for K, ... (K even: a snapshot must
    # not land in the slot of the newest committed one, see checkpoint/snapshot.py)
    snapshot_blocks: int = 0
    policy: str = "constant"  # microbatches per step when the world shrinks: constant | shrink-batch
    persist_url: str | None = None  # a directory or s3://bucket/prefix for persistent records
    persist_every: int = 10  # a base record every K records, deltas between
    persist_keep: int = 2  # bases kept in persistent storage
    persist_cpu_share: float = 0.05  # of one core, the persister's average (checkpoint/persist.py)
    resume: bool = False  # `--resume`: the job must start from a persisted step, never afresh

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "collective_timeout_s", "join_timeout_s",
                     "spare_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SessionConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.policy not in ("constant", "shrink-batch"):
            raise ValueError(f"SessionConfig.policy must be 'constant' or 'shrink-batch', "
                             f"got {self.policy!r}")
        if self.replicas is not None and self.replicas < 0:
            raise ValueError(f"SessionConfig.replicas must be >= 0, got {self.replicas}")
        if self.snapshot_blocks < 0 or self.snapshot_blocks % 2:
            raise ValueError(f"SessionConfig.snapshot_blocks must be 0 or even, got "
                             f"{self.snapshot_blocks} (an odd gap between snapshots would "
                             f"overwrite the newest committed one)")
        if self.persist_every < 1 or self.persist_keep < 1:
            raise ValueError("SessionConfig.persist_every and persist_keep must be >= 1")
        if not 0 < self.persist_cpu_share <= 1:  # NaN fails too
            raise ValueError(f"SessionConfig.persist_cpu_share must be in (0, 1], got "
                             f"{self.persist_cpu_share}")

    @classmethod
    def from_env(cls) -> SessionConfig:
        env = os.environ
        if "PHOENIXFT_STORE" not in env:
            return cls()
        extra = json.loads(env.get("PHOENIXFT_CONFIG", "{}"))
        return cls(store=env["PHOENIXFT_STORE"], worker_id=env["PHOENIXFT_WORKER_ID"],
                   node=int(env.get("PHOENIXFT_NODE", "0")), run_dir=env.get("PHOENIXFT_RUN_DIR"),
                   shm_dir=env["PHOENIXFT_SHM_DIR"], inject=env.get("PHOENIXFT_INJECT", ""),
                   agent_pid=int(env["PHOENIXFT_AGENT_PID"]) if "PHOENIXFT_AGENT_PID" in env else None,
                   **extra)

"""Worker-side configuration: what the launcher tells a worker, with its defaults."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

from phoenixft.config import (
    Fingerprints,
    Groups,
    Persistence,
    Policy,
    Snapshots,
    Stragglers,
    Timeouts,
    build,
)


@dataclass(kw_only=True)
class SessionConfig:
    """Set by `phoenixft run` through the environment; defaults give a standalone
    single-process session (handy in notebooks and unit tests). The branches
    (`timeouts`, `snapshots`, `persistence`, `policy`) are the agent's own, handed over
    whole (phoenixft/config.py); the rest says who and where this worker is."""

    store: str | None = None  # HOST:PORT of the job's TCPStore; None = standalone
    local_addr: str = "127.0.0.1"  # this host's address, where process groups listen
    worker_id: str = "n0w0"
    node: int = 0
    run_dir: str | None = None
    shm_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="phoenixft-shm-"))
    inject: str = ""
    agent_pid: int | None = None  # the node's agent (for `node:` fault injection)
    node_plans: str | None = None  # where its agent hands the node the plans (else: the store)
    timeouts: Timeouts = field(default_factory=Timeouts)
    snapshots: Snapshots = field(default_factory=Snapshots)
    persistence: Persistence = field(default_factory=Persistence)
    policy: Policy = Policy.CONSTANT
    stragglers: Stragglers = field(default_factory=Stragglers)
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    groups: Groups = field(default_factory=Groups)

    def __post_init__(self) -> None:
        self.policy = Policy(self.policy)

    @classmethod
    def from_env(cls) -> SessionConfig:
        env = os.environ
        if "PHOENIXFT_STORE" not in env:
            return cls()
        return build(cls, {
            "store": env["PHOENIXFT_STORE"], "worker_id": env["PHOENIXFT_WORKER_ID"],
            "node": int(env.get("PHOENIXFT_NODE", "0")), "run_dir": env.get("PHOENIXFT_RUN_DIR"),
            "shm_dir": env["PHOENIXFT_SHM_DIR"], "inject": env.get("PHOENIXFT_INJECT", ""),
            "agent_pid": int(env["PHOENIXFT_AGENT_PID"]) if "PHOENIXFT_AGENT_PID" in env else None,
            "node_plans": env.get("PHOENIXFT_NODE_PLANS"),
            **json.loads(env.get("PHOENIXFT_CONFIG", "{}"))})

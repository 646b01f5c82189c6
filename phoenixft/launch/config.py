"""`phoenixft run`'s configuration: every field checked when it is built, so bad input is
one clear line and a non-zero exit before anything starts."""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from phoenixft.config import (
    ConfigError,
    Fingerprints,
    Groups,
    Persistence,
    Policy,
    Snapshots,
    Stragglers,
    Timeouts,
    seconds,
    to_dict,
)
from phoenixft.faults.inject import InjectSpec


class LaunchError(ValueError):
    """Bad launcher input; the message says what to change."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    host: str  # without brackets, also for IPv6
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def parse_store(text: str, *, allow_port_zero: bool = False) -> StoreAddress:
    """HOST:PORT, [IPV6]:PORT. Port 0 (pick a free one) only where we host the store."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise LaunchError(f"--store must be HOST:PORT (or [IPv6]:PORT), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise LaunchError(f"--store: write an IPv6 address in brackets, [{host}]:{port}")
    if not port.isdigit() or not (0 if allow_port_zero else 1) <= int(port) <= 65535:
        raise LaunchError(f"--store port must be an integer in 1..65535, got {port!r}")
    return StoreAddress(host, int(port))


def resolve(addr: StoreAddress, timeout_s: float = 5.0) -> str:
    """The IP address of the store host, or a LaunchError within `timeout_s`."""
    box: dict = {}

    def look() -> None:
        try:
            box["ip"] = socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            box["err"] = exc

    t = threading.Thread(target=look, daemon=True)
    t.start()
    t.join(timeout_s)
    if "ip" in box:
        return box["ip"]
    why = box.get("err", f"no answer within {timeout_s:.0f}s")
    raise LaunchError(f"cannot resolve the store host {addr.host!r}: {why}")


def local_address_towards(ip: str) -> str:
    """The address of this host that the kernel would use to reach `ip` (no packet is
    sent: connecting a UDP socket only picks a route)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
        except OSError as exc:
            raise LaunchError(f"no route from this host to the store at {ip}: {exc}") from None
        return s.getsockname()[0]


WORKERS_PER_CORE = 32  # far past any sensible oversubscription, yet finite
WORKER_MEMORY = 64 << 20  # bytes a forked worker needs at least (a tiny model's worker: 30-45 MB
                           # of its own pages after the fork, measured)


def local_worker_limit() -> tuple[int, str]:
    """The most workers (actives + spares) one node may start unless told otherwise, and
    why: WORKERS_PER_CORE per core, and no more than its available memory holds at
    WORKER_MEMORY each."""
    cores = os.cpu_count() or 1
    by_cores = WORKERS_PER_CORE * cores
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return by_cores, f"{WORKERS_PER_CORE} per core on {cores} cores"
    by_mem = max(1, avail // WORKER_MEMORY)
    why = (f"{WORKERS_PER_CORE} per core on {cores} cores, and {avail / 2**30:.1f} GiB "
           f"available at >= {WORKER_MEMORY >> 20} MiB each")
    return max(1, min(by_cores, by_mem)), why


@dataclass(kw_only=True)
class AgentConfig:
    """One node's agent: where and how many workers, the store, and the branches of the
    shared tree (phoenixft/config.py) it hands to every worker whole. Checked when built;
    errors name settings as `{path}` (the run CLI renders its flags)."""

    script: str  # a path, or a module name with `module`
    script_args: list[str] = field(default_factory=list)
    module: bool = False  # `-m`: run `script` as a module (python -m), like torchrun -m
    nproc: int = 1
    spares: int = 0
    nnodes: int = 1
    node_rank: int = 0
    store: str | None = None  # HOST:PORT; node 0 hosts it (port 0 or None: pick a free one)
    external_store: bool = False  # the store runs on its own (`phoenixft store`); any agent leads
    auth_token: str | None = None  # shared secret for a store reachable from other hosts
    local_addr: str | None = None  # this host's address for the workers' groups
    run_dir: str = "runs/latest"
    inject: list[InjectSpec] = field(default_factory=list)
    timeouts: Timeouts = field(default_factory=Timeouts)
    snapshots: Snapshots = field(default_factory=Snapshots)
    stragglers: Stragglers = field(default_factory=Stragglers)
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    groups: Groups = field(default_factory=Groups)
    persistence: Persistence = field(default_factory=Persistence)
    policy: Policy = Policy.CONSTANT  # microbatches per step after a shrink
    min_nproc: int | None = None  # ReCoVer: shrink down to this many ranks without spares
    respawn: int = 0  # replacement workers this agent may start for dead ones (they grow
                      # the job back at a step boundary)
    metrics_port: int | None = None  # serve Prometheus metrics of the run here
    metrics_host: str = "127.0.0.1"
    tick_s: float = 0.02
    shutdown_grace_s: float = 5.0  # workers' time to leave on their own at the end
    python: str = sys.executable
    start_method: str = "forkserver"  # workers are forks of a server that imported torch
                                      # once (forkserver.py), or fresh interpreters (spawn)
    max_local_workers: int | None = None  # cap on nproc + spares here (None: local_worker_limit)
    echo: bool = True  # print progress and recovery lines (failures and the summary always)
    log_every: str = "10"  # progress lines every N steps ("10") or every N seconds ("30s")

    def __post_init__(self) -> None:
        self.policy = Policy(self.policy)
        if self.nproc < 1:
            raise ConfigError(f"{{nproc}} must be >= 1, got {self.nproc}")
        if self.spares < 0:
            raise ConfigError(f"{{spares}} must be >= 0, got {self.spares}")
        self._check_local_workers()
        if self.nnodes < 1:
            raise ConfigError(f"{{nnodes}} must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"{{node_rank}} must be in [0, {{nnodes}}={self.nnodes}), got "
                              f"{self.node_rank}")
        if (self.nnodes > 1 or self.external_store) and not self.store:
            raise ConfigError("{nnodes} > 1 and {external_store} need {store} HOST:PORT")
        self._check_script()
        for name in ("tick_s", "shutdown_grace_s"):
            seconds(name, getattr(self, name))
        if self.store:
            try:
                parse_store(self.store, allow_port_zero=self.hosts_store and self.nnodes == 1)
            except LaunchError as exc:
                raise ConfigError(str(exc).replace("--store", "{store}", 1)) from None
        if self.auth_token is not None and len(self.auth_token) < 16:
            raise ConfigError("{auth_token} must be at least 16 characters (a shared secret)")
        self._check_world()
        if self.start_method not in ("forkserver", "spawn"):
            raise ConfigError("{start_method} must be 'forkserver' or 'spawn', got "
                              f"{self.start_method!r}")
        if self.respawn < 0:
            raise ConfigError(f"{{respawn}} must be >= 0, got {self.respawn}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError(f"{{metrics_port}} must be in 1..65535, got {self.metrics_port}")
        self.cadence  # noqa: B018 - checks log_every
        self._check_dirs()

    def worker_settings(self) -> dict:
        """What every worker's SessionConfig takes over whole (as JSON)."""
        return {"timeouts": to_dict(self.timeouts), "snapshots": to_dict(self.snapshots),
                "persistence": to_dict(self.persistence), "policy": self.policy.value,
                "stragglers": to_dict(self.stragglers),
                "fingerprints": to_dict(self.fingerprints), "groups": to_dict(self.groups)}

    @property
    def cadence(self) -> tuple[int | None, float | None]:
        """(steps, seconds) between progress lines: one of them is set."""
        text = str(self.log_every).strip()
        try:
            if text.endswith("s"):
                secs = float(text[:-1])
                if math.isfinite(secs) and secs > 0:
                    return None, secs
            elif int(text) >= 1:
                return int(text), None
        except ValueError:
            pass
        raise ConfigError("{log_every} must be a number of steps >= 1 (e.g. 10) or of seconds "
                          f"(e.g. 30s), got {self.log_every!r}")

    def _check_script(self) -> None:
        if self.module:
            import importlib.util
            try:
                found = importlib.util.find_spec(self.script) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ConfigError(f"module {self.script!r} cannot be found (-m takes a module "
                                  "name importable from here, e.g. mypkg.train)")
        elif not Path(self.script).is_file():
            raise ConfigError(f"script {self.script!r} does not exist")

    def _check_world(self) -> None:
        """Settings whose bounds are the job's world size."""
        world = self.nproc * self.nnodes
        if self.min_nproc is not None and not 1 <= self.min_nproc <= world:
            raise ConfigError(f"{{min_nproc}} must be in [1, {world}], got {self.min_nproc}")
        k = self.snapshots.replicas
        if k is not None and not 0 <= k < world:
            raise ConfigError(f"{{snapshots.replicas}} must be in [0, {world - 1}]: a job of "
                              f"{world} rank{'s' if world > 1 else ''} has {world - 1} "
                              f"peer{'s' if world != 2 else ''} to hold copies, got {k}")
        for spec in self.inject:
            if spec.rank >= world:
                raise ConfigError(f"{{inject}} {spec} can never fire: rank {spec.rank} does "
                                  f"not exist in a job of {world} ranks")

    def _check_local_workers(self) -> None:
        """Refuse more workers than this node can hold before forking any of them (a typo
        of --nproc would fork until memory runs out)."""
        n = self.nproc + self.spares
        if self.max_local_workers is not None:
            if self.max_local_workers < 1:
                raise ConfigError("{max_local_workers} must be >= 1, got "
                                  f"{self.max_local_workers}")
            if n > self.max_local_workers:
                raise ConfigError(f"{{nproc}} {self.nproc} + {{spares}} {self.spares} = {n} "
                                  "workers on this node, above {max_local_workers} "
                                  f"{self.max_local_workers}")
            return
        limit, why = local_worker_limit()
        if n > limit:
            raise ConfigError(f"{{nproc}} {self.nproc} + {{spares}} {self.spares} = {n} "
                              f"workers on this node is more than it can hold ({limit}: "
                              f"{why}); pass {{max_local_workers}} N to allow more")

    @property
    def hosts_store(self) -> bool:
        """This agent runs the job's store (node 0, unless the store is external)."""
        return self.node_rank == 0 and not self.external_store

    def _check_dirs(self) -> None:
        _check_dir("run_dir", self.run_dir)
        url = self.persistence.url
        if url and "://" not in url.removeprefix("file://"):
            # a local --persist path: a file there used to surface as the script's error
            _check_dir("persistence.url", url.removeprefix("file://"))


def _check_dir(name: str, path: str) -> None:
    """`path` is a directory, or can be made one: its nearest existing ancestor is a
    writable directory."""
    p = Path(path)
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{{{name}}} {path!r}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"{{{name}}} {path!r}: {parent} is not writable")
            return

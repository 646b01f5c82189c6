"""The job's coordination store: a c10d TCPStore and the key names every part uses.

One TCPStore per job, hosted by the node-0 agent. Keys are written by exactly one
role each (see `Keys`), so no two writers race on a value except through atomic
`add` counters and `compare_set`. Each thread that blocks on the store (heartbeats,
the plan watcher, the snapshot thread) opens its own client: a TCPStore client
serialises its calls, so a blocking `wait` would stall every other caller.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT, got {addr!r}")
    return host, int(port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str, port: int, timeout_s: float = 60.0) -> dist.TCPStore:
    """Start the job's store server in this process (the node-0 agent)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=True)


def connect(addr: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """A new client connection to the job's store (one per blocking thread)."""
    host, port = parse_addr(addr)
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


class Keys:
    """Key names, with the role that writes each."""

    @staticmethod
    def node(k: int) -> str:  # agent k: {"nproc", "spares", "pid"}
        return f"node/{k}"

    @staticmethod
    def worker(wid: str) -> str:  # the worker: {"pid", "node", "local"}
        return f"worker/{wid}"

    REGISTERED = "registered"  # add-counter, one per worker registration
    REPORTS = "reports"  # add-counter of failure reports

    @staticmethod
    def report(i: int) -> str:  # agents and workers: failure reports
        return f"report/{i}"

    @staticmethod
    def heartbeat(wid: str) -> str:  # the worker's heartbeat thread (add-counter)
        return f"hb/{wid}"

    @staticmethod
    def plan(g: int) -> str:  # the leader: generation g's plan, written once
        return f"gen/{g}/plan"

    @staticmethod
    def fence(wid: str) -> str:  # the leader: this worker must be killed by its agent
        return f"fence/{wid}"

    @staticmethod
    def exit(wid: str) -> str:  # the worker, at a clean exit
        return f"exit/{wid}"

    @staticmethod
    def error(wid: str) -> str:  # the worker: a Python exception in the user's script
        return f"error/{wid}"

    @staticmethod
    def ack(g: int, step: int) -> str:  # snapshot threads: local copies + replicas done
        return f"ack/{g}/{step}"

    MB_COUNT = "mb_count"  # add-counter: microbatch forward+backward passes, all ranks
    COMMITTED = "committed"  # the newest committed snapshot step (monotonic)
    PROGRESS = "progress"  # rank 0: last completed step

    @staticmethod
    def loss(step: int) -> str:  # rank 0: global mean loss of a step
        return f"loss/{step}"

    @staticmethod
    def audit(step: int) -> str:  # rank 0: microbatch ids that contributed to a step
        return f"audit/{step}"

    @staticmethod
    def grow(g: int) -> str:  # the leader: generation g should admit waiting spares
        return f"grow/{g}"

    @staticmethod
    def grow_ready(g: int) -> str:  # rank 0: generation g stopped at a committed step
        return f"grow_ready/{g}"

    @staticmethod
    def inject(spec: str) -> str:  # a fault injection fired (add-counter claims it once)
        return f"inject/{spec}"

    @staticmethod
    def result(name: str) -> str:  # rank 0 at the end: digest, final step
        return f"result/{name}"


def get_json(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key).decode())


def set_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get_int(store: dist.Store, key: str, default: int) -> int:
    if not store.check([key]):
        return default
    return int(store.get(key).decode())


def raise_to(store: dist.Store, key: str, value: int) -> int:
    """Monotonically raise an integer key to `value`; returns the value it now holds."""
    cur = store.get(key).decode() if store.check([key]) else ""
    while True:
        if cur and int(cur) >= value:
            return int(cur)
        got = store.compare_set(key, cur, str(value)).decode()
        if got == str(value):
            return value
        cur = got

"""The job's coordination store: a c10d TCPStore, its connections and small typed reads.

One TCPStore per job, hosted by the node-0 agent. Its keys are named in `keys.py`, each
written by exactly one role, so no two writers race on a value except through atomic
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
    """HOST:PORT or [IPV6]:PORT -> (host without brackets, port)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address must be HOST:PORT, got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def host_store(host: str, port: int = 0, timeout_s: float = 60.0) -> tuple[dist.TCPStore, int]:
    """Start a store server in this process, listening on exactly (host, port) (port 0:
    a free one); returns it and its port. c10d's own listener would bind every interface
    whatever `host` says, so it is handed a socket bound here. Raises OSError when the
    address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    port = sock.getsockname()[1]
    # detach: the descriptor now belongs to the server (a collected socket object would
    # close it under the server)
    server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout_s), use_libuv=True,
                           master_listen_fd=sock.detach())
    return server, port


def connect(addr: str, timeout_s: float = 60.0) -> dist.TCPStore:
    """A new client connection to the job's store (one per blocking thread)."""
    host, port = parse_addr(addr)
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


class StoreGone(RuntimeError):
    """The job store cannot be reached: its host died, or the job ended."""


# what a call on a store whose server is gone raises
STORE_LOST = (StoreGone, dist.DistNetworkError)


def wait_for(store: dist.Store, keys: list[str], timeout_s: float) -> bool:
    """Wait until every key is set: True, or False when `timeout_s` passed. A lost
    connection raises `StoreGone` at once (retrying a dead store would spin)."""
    try:
        store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        return True
    except dist.DistNetworkError as exc:
        raise StoreGone(f"lost the connection to the job store ({exc})") from None
    except dist.DistStoreError:  # the wait timed out
        return False


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

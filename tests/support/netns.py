"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair, made and
removed by the test itself. Each host has its own address (10.77.0.1 and 10.77.0.2, which
exist only inside these namespaces) and its own loopback, so an address bug that loopback
"hosts" hide (every 127.x address is local to every process) shows up here."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosts:
    ns: tuple[str, str]
    addr: tuple[str, str]

    def cmd(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run on host 0 or 1 (ip netns exec replaces itself with argv: one PID)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]


def can_make_namespaces() -> str | None:
    """None when this machine lets the test make namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


@contextmanager
def two_hosts() -> Iterator[Hosts]:
    tag = f"phx{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    va, vb = f"v{tag}a", f"v{tag}b"
    hosts = Hosts((a, b), ("10.77.0.1", "10.77.0.2"))
    steps = [
        ["ip", "netns", "add", a], ["ip", "netns", "add", b],
        ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
        ["ip", "link", "set", va, "netns", a], ["ip", "link", "set", vb, "netns", b],
        ["ip", "-n", a, "addr", "add", f"{hosts.addr[0]}/24", "dev", va],
        ["ip", "-n", b, "addr", "add", f"{hosts.addr[1]}/24", "dev", vb],
        ["ip", "-n", a, "link", "set", va, "up"], ["ip", "-n", b, "link", "set", vb, "up"],
        ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"],
    ]
    try:
        for argv in steps:
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)
        yield hosts
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair, and so both
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

"""How an agent and its workers reach the job store, and where workers bind their groups.

- Single-host job, node 0: the agent hosts the TCPStore on the `--store` address, which
  must be a loopback one (127.0.0.1 by default): nothing off the host can reach it.
- A store other hosts reach: the TCPStore listens on this host's loopback only, and an
  `AuthFront` on the `--store` address admits holders of the auth token; every other
  host's agent runs an `AuthTunnel` on its own loopback that its workers connect to.
  Without a token such a job is refused: the store would be open to the network.
- Workers bind their process groups to this host's address: `--local-addr`, the
  interface named by GLOO_SOCKET_IFNAME, or the address the kernel routes towards the
  store host (what makes a second host work: the store host's address is not local there).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from phoenixft.cluster import store as kv
from phoenixft.cluster.auth import AuthError, AuthFront, AuthTunnel
from phoenixft.launch.config import (
    AgentConfig,
    LaunchError,
    StoreAddress,
    local_address_towards,
    parse_store,
    resolve,
)


@dataclass
class StoreAccess:
    public: StoreAddress  # the job's store address, as other hosts see it
    worker_addr: str  # what this node's agent and workers connect to
    local_addr: str  # this host's address for the workers' process groups
    server: dist.TCPStore | None = None
    relay: AuthFront | AuthTunnel | None = None

    @classmethod
    def open(cls, cfg: AgentConfig) -> StoreAccess:
        token = cfg.auth_token or os.environ.get("PHOENIXFT_AUTH_TOKEN") or None
        if token is not None and len(token) < 16:
            raise LaunchError("the auth token must be at least 16 characters")
        if cfg.hosts_store:
            return cls._host(cfg, token)
        return cls._join(cfg, token)

    @classmethod
    def _host(cls, cfg: AgentConfig, token: str | None) -> StoreAccess:
        public = parse_store(cfg.store, allow_port_zero=True) if cfg.store else StoreAddress("127.0.0.1", 0)
        access = serve(public, token)
        access.local_addr = cfg.local_addr or access.local_addr
        return access

    @classmethod
    def _join(cls, cfg: AgentConfig, token: str | None) -> StoreAccess:
        public = parse_store(cfg.store)
        ip = resolve(public)
        local = cfg.local_addr or local_address_towards(ip)
        _await_listener(ip, public.port, cfg.timeouts.startup_timeout_s)
        if public.is_loopback:  # a loopback store has no front (`serve`), token or not
            return cls(public, str(public), local)
        if token is None:
            raise LaunchError(f"--store {public} is on another host: give every agent the same "
                              "--auth-token (or PHOENIXFT_AUTH_TOKEN)")
        tunnel = AuthTunnel(ip, public.port, token=token)
        try:
            tunnel.check()
        except OSError as exc:
            tunnel.close()
            why = ("it refused this agent's auth token: give every agent and the store the "
                   "same --auth-token (or PHOENIXFT_AUTH_TOKEN)" if isinstance(exc, AuthError)
                   else f"the token handshake failed ({exc})")
            raise LaunchError(f"cannot join the job store at {public}: {why}") from None
        return cls(public, f"127.0.0.1:{tunnel.port}", local, relay=tunnel)

    def connect(self, timeout_s: float = 60.0) -> dist.TCPStore:
        try:
            return kv.connect(self.worker_addr, timeout_s=timeout_s)
        except dist.DistNetworkError as exc:
            raise LaunchError(f"cannot connect to the job store at {self.public}: {exc}") from None

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()


def serve(public: StoreAddress, token: str | None) -> StoreAccess:
    """Host a job store at `public`: on loopback as it is; reachable from other hosts
    only behind an `AuthFront` (a token is required)."""
    ip = resolve(public)
    if public.is_loopback:
        server, port = _host_on(ip, public.port)
        addr = StoreAddress(public.host, port)
        return StoreAccess(addr, str(addr), "127.0.0.1", server=server)
    if token is None:
        raise LaunchError(f"--store {public} is reachable from other hosts: give every agent "
                          "the same --auth-token (or PHOENIXFT_AUTH_TOKEN), or use a loopback "
                          "address for a single-host job")
    server, port = _host_on("127.0.0.1", 0)
    try:
        front = AuthFront(ip, public.port, store_port=port, token=token)
    except OSError as exc:
        raise LaunchError(f"cannot listen on --store {public}: {exc}") from None
    return StoreAccess(StoreAddress(public.host, front.port), f"127.0.0.1:{port}", ip,
                       server=server, relay=front)


def _host_on(host: str, port: int) -> tuple[dist.TCPStore, int]:
    try:
        return kv.host_store(host, port)
    except OSError as exc:
        raise LaunchError(f"cannot listen on {host}:{port} for the job store: {exc}") from None


def _await_listener(ip: str, port: int, timeout_s: float) -> None:
    """Wait until something listens at (ip, port): node 0 may start after us. Refusals are
    retried quietly until `timeout_s`; an unreachable network fails at once."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            socket.create_connection((ip, port), timeout=2.0).close()
            return
        except ConnectionRefusedError:
            if not said:
                print(f"phoenixft: waiting for the job store at {ip}:{port} (connection refused; "
                      f"up to {timeout_s:.0f}s)", flush=True)
                said = True
        except OSError as exc:
            if time.monotonic() > deadline or exc.errno in (101, 113):  # ENETUNREACH, EHOSTUNREACH
                raise LaunchError(f"cannot reach the job store at {ip}:{port}: {exc}") from None
        if time.monotonic() > deadline:
            raise LaunchError(f"nothing listens at the job store address {ip}:{port} after "
                              f"{timeout_s:.0f}s: is node 0's agent (or `phoenixft store`) running?")
        time.sleep(0.2)  # retry back-off while the store's host starts

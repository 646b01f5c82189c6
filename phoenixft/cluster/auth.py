"""A closed job store for jobs that span hosts: a token-checking front before the store,
and a tunnel on every other host.

The c10d TCPStore has no authentication, and whoever can write it can fence workers and
write plans. So a store reachable from other hosts is never exposed directly:

    worker ──> tunnel (127.0.0.1 on its host) ══ network ══> front (--store address)
                                                               └──> TCPStore (127.0.0.1)

Each connection starts with a mutual challenge-response over the shared secret (the
token, `--auth-token` or PHOENIXFT_AUTH_TOKEN), then carries the store's own protocol
unchanged:

    front  -> tunnel: b"PHXAUTH1" + nonce_f (32 random bytes)
    tunnel -> front : HMAC-SHA256(token, b"tunnel" + nonce_f) + nonce_t (32 random bytes)
    front  -> tunnel: b"OK" + HMAC-SHA256(token, b"front" + nonce_t)

The front closes a connection whose answer is wrong or late (`handshake_s`), so a client
without the token can neither read nor write a single key; the tunnel closes one whose
front cannot prove the token either (a rogue store). Nonces are fresh per connection, so
a recorded handshake cannot be replayed. The bytes after the handshake are not encrypted:
run jobs on a network you trust against eavesdropping, or over an encrypted overlay.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import threading

MAGIC = b"PHXAUTH1"
_NONCE = 32
_MAC = 32
_REFUSED = b"NO"  # the front's answer to a wrong token, before it closes the connection


def _mac(token: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, label + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed during the handshake")
        buf += chunk
    return buf


class AuthError(ConnectionError):
    """A peer failed the challenge-response (wrong or missing token)."""


def server_handshake(sock: socket.socket, token: bytes) -> None:
    nonce_f = os.urandom(_NONCE)
    sock.sendall(MAGIC + nonce_f)
    answer = _recv_exact(sock, _MAC + _NONCE)
    if not hmac.compare_digest(answer[:_MAC], _mac(token, b"tunnel", nonce_f)):
        try:
            sock.sendall(_REFUSED)  # so a client with the wrong token knows, at once
        except OSError:
            pass
        raise AuthError("client failed the store's challenge (wrong or missing auth token)")
    sock.sendall(b"OK" + _mac(token, b"front", answer[_MAC:]))


def client_handshake(sock: socket.socket, token: bytes) -> None:
    hello = _recv_exact(sock, len(MAGIC) + _NONCE)
    if hello[:len(MAGIC)] != MAGIC:
        raise AuthError("the store did not start a phoenixft handshake: is it a phoenixft "
                        "store front, and does it run with an auth token?")
    nonce_t = os.urandom(_NONCE)
    sock.sendall(_mac(token, b"tunnel", hello[len(MAGIC):]) + nonce_t)
    verdict = _recv_exact(sock, 2)
    if verdict == _REFUSED:
        raise AuthError("the store refused this agent's auth token (it holds another one)")
    reply = verdict + _recv_exact(sock, _MAC)
    if reply[:2] != b"OK" or not hmac.compare_digest(reply[2:], _mac(token, b"front", nonce_t)):
        raise AuthError("the store front could not prove the auth token (wrong token on "
                        "one side, or not our store)")


class _Pump:
    """Copies bytes both ways between socket pairs, all pairs on one thread."""

    def __init__(self, name: str) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[tuple[socket.socket, socket.socket]] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, a: socket.socket, b: socket.socket) -> None:
        """Hand a pair to the pump thread (which alone touches the selector)."""
        for s in (a, b):
            s.settimeout(10.0)  # a send blocked this long means the peer is gone
        with self._lock:
            self._pending.append((a, b))
        self._wake_w.send(b"x")

    def _register_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for a, b in pending:
            self._sel.register(a, selectors.EVENT_READ, b)
            self._sel.register(b, selectors.EVENT_READ, a)

    def _close_pair(self, a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()

    def _run(self) -> None:
        while not self._stopped:
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    self._wake_r.recv(4096)
                    self._register_pending()
                    continue
                src, dst = key.fileobj, key.data
                try:
                    data = src.recv(65536)
                    if not data:
                        raise ConnectionError
                    dst.sendall(data)
                except OSError:
                    self._close_pair(src, dst)

    def stop(self) -> None:
        self._stopped = True
        self._wake_w.send(b"x")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(256)
    return s


class _Relay:
    """Accepts connections on (host, port), runs `prepare(conn) -> upstream socket` for
    each on a short-lived thread, then pumps bytes between the two."""

    def __init__(self, host: str, port: int, name: str, handshake_s: float) -> None:
        self.sock = _listen(host, port)
        self.port = self.sock.getsockname()[1]
        self.handshake_s = handshake_s
        self.rejected = 0
        self._pump = _Pump(f"phoenixft-{name}-pump")
        self._stopped = False
        threading.Thread(target=self._accept, name=f"phoenixft-{name}", daemon=True).start()

    def _prepare(self, conn: socket.socket) -> socket.socket:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        up = None
        try:
            conn.settimeout(self.handshake_s)
            up = self._prepare(conn)
            conn.settimeout(None)
            up.settimeout(None)
            self._pump.add(conn, up)
        except OSError:
            self.rejected += 1
            conn.close()
            if up is not None:
                up.close()

    def close(self) -> None:
        self._stopped = True
        self.sock.close()
        self._pump.stop()


class AuthFront(_Relay):
    """Listens where other hosts reach the store; admits only holders of the token and
    relays them to the real store on this host's loopback."""

    def __init__(self, host: str, port: int, *, store_port: int, token: str,
                 handshake_s: float = 5.0) -> None:
        self._token = token.encode()
        self._store_port = store_port
        super().__init__(host, port, "store-front", handshake_s)

    def _prepare(self, conn: socket.socket) -> socket.socket:
        server_handshake(conn, self._token)
        return socket.create_connection(("127.0.0.1", self._store_port), timeout=5.0)


class AuthTunnel(_Relay):
    """Listens on this host's loopback for the agent's and workers' store clients, and
    carries each connection to the remote front after proving the token."""

    def __init__(self, front_host: str, front_port: int, *, token: str,
                 handshake_s: float = 10.0) -> None:
        self._token = token.encode()
        self._front = (front_host, front_port)
        super().__init__("127.0.0.1", 0, "store-tunnel", handshake_s)

    def check(self) -> None:
        """Prove the token to the front once (raises AuthError if it is refused): a store
        client behind a refused tunnel would only see closed connections and retry."""
        self._prepare(None).close()

    def _prepare(self, conn: socket.socket | None) -> socket.socket:
        up = socket.create_connection(self._front, timeout=self.handshake_s)
        try:
            client_handshake(up, self._token)
        except OSError:
            up.close()
            raise
        return up

"""The connection between the HTTP front and an engine process: length-prefixed messages
(`messages.py`: typed, JSON, never pickle) over a Unix socket. One writer lock per
connection; `recv` returns None when the peer is gone or sent what is not a message (a
peer that breaks the protocol is treated as gone)."""

from __future__ import annotations

import socket
import struct
import threading

from .messages import Message, decode, encode

_LEN = struct.Struct(">I")
MAX_MESSAGE = 256 << 20


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()
        self._rfile = sock.makefile("rb")

    def send(self, msg: Message) -> bool:
        data = encode(msg)
        try:
            with self._lock:
                self.sock.sendall(_LEN.pack(len(data)) + data)
            return True
        except OSError:
            return False

    def recv(self) -> Message | None:
        try:
            head = self._rfile.read(_LEN.size)
            if len(head) < _LEN.size:
                return None
            (n,) = _LEN.unpack(head)
            if n > MAX_MESSAGE:
                raise ValueError(f"message of {n} bytes is over the {MAX_MESSAGE} limit")
            body = self._rfile.read(n)
            return decode(body) if len(body) == n else None
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(path: str) -> Channel:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return Channel(s)

"""`phoenixft serve`'s process: claim the port, start the engines, say where it serves,
serve, and clean up however it ends.

The order is what makes failures one clear line: the port is bound first (a port in use
or out of range is refused before the engines spend seconds loading), the engines are
started and awaited next (a model they cannot load is reported with the engine's own
cause), and only then is "serving ..." printed, so that line is never followed by an
error. Everything the front made is removed when it returns, and by its janitor
(`janitor.py`) if it is killed.
"""

from __future__ import annotations

import errno
import socket
import sys

from .limits import timed_h11


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or ValueError naming the cause and the fix."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port: give 1-65535 (or 0 for any free "
                         "port)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another server?): stop "
                             "it or choose another --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another "
                         "--host or --port") from None
    return sock


def run(app, sock: socket.socket, *, model_dir: str, log_level: str,
        read_timeout_s: float) -> int:
    """Start the engines, announce, serve until stopped (SIGINT/SIGTERM); 0, or 1 with one
    line on stderr when the engines could not start."""
    import uvicorn

    try:
        try:
            app.state.supervisor.start()
        except RuntimeError as exc:
            print(f"phoenixft serve: {exc}", file=sys.stderr)
            return 1
        spec, sup = app.state.spec, app.state.supervisor
        host, port = sock.getsockname()[:2]
        how = (f"an engine process and a warm standby, recovery log in {sup.log_dir}"
               if sup.recovery else "one engine process, no recovery log and no standby "
               "(--no-recovery: a crash fails its requests)")
        print(f"serving {model_dir} ({spec.model_config.model_type}, max_model_len "
              f"{spec.max_model_len}, {spec.config.num_blocks} KV blocks of "
              f"{spec.config.block_size}) on http://{host}:{port}; {how}", flush=True)
        config = uvicorn.Config(app, log_level=log_level, http=timed_h11(read_timeout_s),
                                timeout_keep_alive=5)
        uvicorn.Server(config).run(sockets=[sock])
        return 0
    except KeyboardInterrupt:  # while the engines were starting
        return 130
    finally:
        app.state.cleanup()
        sock.close()

"""`phoenixft store`: the job store on its own, on a host that outlives the job's nodes
(as torchft's lighthouse or an etcd rendezvous would). Agents started with
`--external-store` join it; none of them hosts it, so the leader's node may die and
another agent takes over the lead. One store serves one job."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from phoenixft.launch.config import LaunchError, parse_store


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="run a job store on its own (agents: --external-store)",
                       description=__doc__)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; one other hosts reach needs --auth-token")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--auth-token", default=None,
                   help="shared secret clients must prove (or set PHOENIXFT_AUTH_TOKEN)")
    p.set_defaults(func=cmd_store)


def cmd_store(args) -> int:
    from phoenixft.launch.store_access import serve

    token = args.auth_token or os.environ.get("PHOENIXFT_AUTH_TOKEN") or None
    try:
        if token is not None and len(token) < 16:
            raise LaunchError("--auth-token must be at least 16 characters (a shared secret)")
        host = f"[{args.host}]" if ":" in args.host else args.host
        access = serve(parse_store(f"{host}:{args.port}", allow_port_zero=True), token)
    except LaunchError as exc:
        print(f"phoenixft store: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: stop.set())
    print(f"phoenixft store: listening on {access.public}"
          f"{' (auth token required)' if access.relay is not None else ' (loopback only)'}",
          flush=True)
    stop.wait()
    access.close()
    return 0

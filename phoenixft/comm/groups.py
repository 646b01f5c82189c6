"""One process group per generation, on its own store prefix.

Re-using a prefix makes peers read a dead member's stale address (the torchrun failure
in docs/notes.md), so generation g's groups live under ``gen/{g}/…`` and are never reused.
gloo on CPU (bound to the store's interface, loopback by default), NCCL when the
model lives on a GPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from phoenixft.torch_internals import gloo_options, nccl_options


def _gloo_options(bind_host: str, timeout: timedelta):
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    device = (dist.ProcessGroupGloo.create_device(interface=iface) if iface
              else dist.ProcessGroupGloo.create_device(hostname=bind_host))
    return gloo_options(timeout, device)


def new_group(store: dist.Store, prefix: str, rank: int, size: int, *, device: torch.device,
              bind_host: str = "127.0.0.1", timeout_s: float = 120.0) -> dist.ProcessGroup:
    """Build a process group over ``PrefixStore(prefix, store)``; blocks until all
    `size` members joined (callers wrap this in `call_with_deadline`)."""
    pstore = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(pstore, rank, size, nccl_options(timeout))
    return dist.ProcessGroupGloo(pstore, rank, size, _gloo_options(bind_host, timeout))


def abort_group(pg: dist.ProcessGroup | None) -> None:
    """Best-effort abort of a dead generation's group: NCCL frees its communicators;
    gloo (torch >= 2.8 has `abort` for it) releases the worker threads still inside an
    abandoned collective, so the group can be destroyed without waiting out its timeout."""
    if pg is None:
        return
    abort = getattr(pg, "abort", None)
    if abort is not None:
        try:
            abort()
        except Exception:
            pass

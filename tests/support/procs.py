"""Processes as ranks, for a unit test whose subject needs one process per rank (a layout
that makes torch.distributed's default group its own: FSDP2)."""

from __future__ import annotations

import io
import multiprocessing as mp
import queue as queue_mod
import traceback

import torch


def _pack(obj) -> bytes:
    """Tensors cross as bytes: torch's multiprocessing reducers would send them as
    shared-memory handles, which die with a child that exits right after sending."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def _child(fn, rank: int, args: bytes, out) -> None:
    try:
        out.put((rank, True, _pack(fn(rank, *_unpack(args)))))
    except BaseException:  # noqa: BLE001 - handed to the parent
        out.put((rank, False, traceback.format_exc()))


def ranks_in_processes(fn, n: int, *args, timeout_s: float = 120.0) -> list:
    """fn(rank, *args) in n fresh (spawned) processes; their results in rank order. `fn`
    must be importable (a module-level function). A child's exception fails the call with
    its traceback; every child is killed by PID at the end, whatever happened."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    packed = _pack(list(args))
    procs = [ctx.Process(target=_child, args=(fn, r, packed, out), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(n):
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise TimeoutError(f"{n - len(results)} of {n} ranks gave no result within "
                                   f"{timeout_s:.0f}s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = _unpack(value)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(n)]

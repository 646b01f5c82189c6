"""Snapshot copies of tensors that live on a CUDA device.

The training thread records an event on its current stream right after the optimizer
step (`ready_event`); the snapshot thread makes its own side stream wait for that event
and copies device-to-host there, into the slot's shared memory, which is page-locked
once per mapping (``cudaHostRegister``) so the copies are real DMA that overlap the next
forward/backward instead of serialising with it. The thread then synchronises its stream
before it checksums the slot, and the session's optimizer pre-hook waits for that
(`Snapshotter.wait_copied`), so no parameter changes while it is being copied.

Host tensors take the plain `copy_` path and none of this runs; `scripts/gpu-check`
exercises it on a GPU.
"""

from __future__ import annotations

import torch


def ready_event(tensors: dict[str, torch.Tensor]) -> torch.cuda.Event | None:
    """An event on the training thread's stream after the step, if anything is on CUDA."""
    dev = next((t.device for t in tensors.values() if t.is_cuda), None)
    if dev is None:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev


class DeviceCopier:
    """The snapshot thread's side: one stream per device, page-locked slot mappings."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pinned: dict[int, int] = {}  # id(slot) -> the base address registered for it
        self.pinned_ok = True  # False once registration failed (pageable copies then)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pin(self, slot) -> None:
        """Page-lock the slot's current mapping (again after it was re-mapped)."""
        if not self.pinned_ok:
            return
        base = slot.tensor.data_ptr()
        if self._pinned.get(id(slot)) == base:
            return
        cudart = torch.cuda.cudart()
        old = self._pinned.pop(id(slot), None)
        if old is not None:
            cudart.cudaHostUnregister(old)
        if int(cudart.cudaHostRegister(base, slot.capacity, 0)) != 0:
            self.pinned_ok = False  # e.g. a locked-memory limit: copies stay correct, slower
            return
        self._pinned[id(slot)] = base

    def copy(self, dst: torch.Tensor, src: torch.Tensor, ready: torch.cuda.Event) -> None:
        """Enqueue one device-to-host copy on the side stream, after `ready`."""
        s = self.stream(src.device)
        with torch.cuda.stream(s):
            s.wait_event(ready)
            dst.copy_(src, non_blocking=self.pinned_ok)

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.synchronize()

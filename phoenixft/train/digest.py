"""`state_digest`: one sha256 over a training state, to compare runs bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def _flatten(prefix: str, obj, out: dict[str, torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}" if prefix else str(i), v, out)
    elif isinstance(obj, (int, float, bool)) or obj is None:
        out[prefix] = torch.tensor(float("nan") if obj is None else float(obj), dtype=torch.float64)


def state_digest(state: Mapping) -> str:
    """sha256 over a (nested) mapping of tensors and numbers in canonical order: keys
    sorted, each contributing its name, dtype, shape and raw bytes. Two states have the
    same digest iff they are bitwise equal (up to sha256 collisions)."""
    flat: dict[str, torch.Tensor] = {}
    _flatten("", state, flat)
    h = hashlib.sha256()
    for name in sorted(flat):
        t = flat[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()

"""LoRA-style adapters that can be loaded or replaced while serving.

An adapter file is safetensors with, for each layer ``i`` and projection ``p`` in ``q``
and ``v``: ``layers.{i}.{p}.lora_A`` ``[rank, hidden]`` and ``layers.{i}.{p}.lora_B``
``[out, rank]`` (out: the projection's width), and a ``scale`` in its metadata (default
1.0). The projection's output becomes ``W x + scale * B (A x)`` for the tokens of the
requests that use the adapter.

Names: 1 to 64 letters, digits, ".", "_" or "-", starting with a letter or a digit (a name
is what clients send as `model`, and it reaches logs and file names: no path separators,
no control characters, nothing unbounded). A name the server already serves (the base
model's, or a loaded adapter's) is refused unless the load is an explicit replacement.

Versions: replacing an adapter (an explicit reload of a name that exists) makes a new
version. A request uses
the version that is current when it is admitted, to its end (also after a crash: the
recovery log keeps every version a live request uses); versions no live request uses are
dropped when a newer one exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from .config import ModelConfig

PROJECTIONS = ("q", "v")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE_TEXT = ("1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a "
                  "digit")


def check_adapter_name(name: str) -> None:
    """ValueError naming the rule when `name` cannot be an adapter's name."""
    if not NAME_RULE.fullmatch(name):
        shown = name if len(name) <= 40 else name[:40] + f"... ({len(name)} characters)"
        raise ValueError(f"adapter name {shown!r} is not allowed: a name is {NAME_RULE_TEXT}")


@dataclass(frozen=True)
class Adapter:
    name: str
    version: int
    scale: float
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{p}.lora_A" / "_B"

    def pair(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.tensors[f"layers.{layer}.{proj}.lora_A"],
                self.tensors[f"layers.{layer}.{proj}.lora_B"])

    def to_bytes(self) -> bytes:
        return save_bytes(self.tensors, metadata={"name": self.name, "version": str(self.version),
                                                  "scale": str(self.scale)})

    @classmethod
    def from_bytes(cls, data: bytes, meta: dict) -> Adapter:
        return cls(meta["name"], int(meta["version"]), float(meta["scale"]), load_bytes(data))


def read_adapter_file(path: str | Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], float]:
    """The tensors and scale of an adapter file, checked against the model's shapes
    (ValueError naming the first mismatch)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"adapter file {p} does not exist")
    try:
        with safe_open(str(p), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - a bad file is the client's error
        raise ValueError(f"adapter file {p} is not a readable safetensors file: {exc}") from None
    width = {"q": cfg.num_attention_heads * cfg.head_dim, "v": cfg.num_key_value_heads * cfg.head_dim}
    rank = None
    for i in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            a, b = tensors.get(f"layers.{i}.{proj}.lora_A"), tensors.get(f"layers.{i}.{proj}.lora_B")
            if a is None or b is None:
                raise ValueError(f"adapter {p}: layers.{i}.{proj}.lora_A/lora_B missing")
            rank = rank or a.shape[0]
            if a.shape != (rank, cfg.hidden_size) or b.shape != (width[proj], rank):
                raise ValueError(f"adapter {p}: layers.{i}.{proj} has shapes {tuple(a.shape)}, "
                                 f"{tuple(b.shape)}; the model needs ({rank}, {cfg.hidden_size}), "
                                 f"({width[proj]}, {rank})")
    return tensors, float(meta.get("scale", 1.0))


class AdapterStore:
    def __init__(self) -> None:
        self.versions: dict[tuple[str, int], Adapter] = {}
        self.current: dict[str, int] = {}

    def next_version(self, name: str, tensors: dict[str, torch.Tensor], scale: float
                     ) -> Adapter:
        """The adapter that loading these tensors under `name` would install (not yet
        installed: the caller checks it can be logged first)."""
        return Adapter(name, self.current.get(name, 0) + 1, scale, tensors)

    def load(self, name: str, tensors: dict[str, torch.Tensor], scale: float) -> Adapter:
        return self.install(self.next_version(name, tensors, scale))

    def install(self, adapter: Adapter) -> Adapter:
        self.versions[adapter.name, adapter.version] = adapter
        if adapter.version >= self.current.get(adapter.name, 0):
            self.current[adapter.name] = adapter.version
        return adapter

    def get(self, name: str, version: int) -> Adapter:
        return self.versions[name, version]

    def prune(self, in_use: set[tuple[str, int]]) -> None:
        """Drop versions no request uses and that are not current."""
        for key in list(self.versions):
            if key not in in_use and self.current.get(key[0]) != key[1]:
                del self.versions[key]

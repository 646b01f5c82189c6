"""Per-rank state the user registers beside model and optimizer: data samplers,
`torch.Generator`s, LR schedulers. Snapshotted every step and restored with the rank.

An object is tracked if it is a `torch.Generator`, or has ``state_dict()`` /
``load_state_dict()`` whose values are tensors or JSON-serialisable (ints, floats,
strings, lists, dicts) - no pickle, so a snapshot from a peer cannot run code.
"""

from __future__ import annotations

import json

import torch


class Tracked:
    def __init__(self) -> None:
        self._objs: dict[str, object] = {}

    def add(self, name: str, obj: object) -> None:
        if not isinstance(obj, torch.Generator) and not (
                hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"cannot track {name!r}: pass a torch.Generator or an object with "
                            "state_dict()/load_state_dict()")
        if "." in name:
            raise ValueError(f"tracked name {name!r} must not contain '.'")
        self._objs[name] = obj

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, obj in self._objs.items():
            if isinstance(obj, torch.Generator):
                out[f"track.{name}"] = obj.get_state()
                continue
            for k, v in obj.state_dict().items():
                if torch.is_tensor(v):
                    out[f"track.{name}.{k}"] = v.detach().clone()
        return out

    def meta(self) -> dict:
        out = {}
        for name, obj in self._objs.items():
            if isinstance(obj, torch.Generator):
                continue
            plain = {k: v for k, v in obj.state_dict().items() if not torch.is_tensor(v)}
            try:
                json.dumps(plain)
            except TypeError as exc:
                raise TypeError(f"tracked {name!r}: state_dict values must be tensors or "
                                f"JSON-serialisable ({exc})") from None
            out[name] = plain
        return out

    def load(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        for name, obj in self._objs.items():
            if isinstance(obj, torch.Generator):
                obj.set_state(tensors[f"track.{name}"].clone())
                continue
            prefix = f"track.{name}."
            state = dict(meta.get(name, {}))
            state.update({k[len(prefix):]: v.clone() for k, v in tensors.items()
                          if k.startswith(prefix)})
            obj.load_state_dict(state)

"""A model in and out of a training session, in the Hugging Face layout: `save_pretrained`
writes config.json (when the model has a config), model.safetensors and the tokenizer's
files; `load_weights` reads such a directory (one file or a sharded index), a single
.safetensors file or a state dict. Safetensors only: nothing loaded here can run code."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from phoenixft.checkpoint.hf_dir import write_hf_dir


def _config_dict(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    for name in ("to_hf_dict", "to_dict"):
        if hasattr(cfg, name):
            return getattr(cfg, name)()
    return None


def save_pretrained(model: nn.Module, out_dir: str | Path, *, tokenizer=None,
                    aliases: Mapping[str, str] | None = None) -> Path:
    """Write `model` (tied weights once, as transformers does) and, if given, `tokenizer`
    (anything with `save_pretrained(dir)`) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):  # a transformers model writes itself
        model.save_pretrained(str(out), safe_serialization=True)
    else:
        skip = set(aliases or {})
        write_hf_dir(out, {k: v for k, v in model.state_dict().items() if k not in skip},
                     _config_dict(model))
    if tokenizer is not None:
        if not hasattr(tokenizer, "save_pretrained"):
            raise TypeError("tokenizer must have save_pretrained(dir) (a transformers tokenizer)")
        tokenizer.save_pretrained(str(out))
    return out


def _read(source: str | Path) -> dict[str, torch.Tensor]:
    p = Path(source)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p}: only .safetensors files are loaded (no pickle); convert it "
                             "with safetensors.torch.save_file")
        return load_file(str(p))
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if (p / "model.safetensors").is_file():
        return load_file(str(p / "model.safetensors"))
    index = p / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(str(p / name)))
        return out
    raise FileNotFoundError(f"{p}: no model.safetensors or model.safetensors.index.json "
                            "(a Hugging Face directory saved with safetensors)")


def load_weights(model: nn.Module, source, *, strict: bool = True) -> None:
    """Copy weights into `model`'s parameters in place (they may be views of a flat
    buffer). Tied weights saved once are accepted."""
    state = dict(source) if isinstance(source, Mapping) else _read(source)
    own = model.state_dict()
    seen: dict[int, str] = {}
    for name, t in own.items():  # a tied name missing from the file takes its twin's tensor
        first = seen.setdefault(t.data_ptr(), name)
        if name not in state and first in state and t.numel():
            state[name] = state[first]
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''} (pass strict=False to load "
                         "what fits)")
    with torch.no_grad():
        for name, t in own.items():
            if name in state:
                src = state[name]
                if src.shape != t.shape:
                    raise ValueError(f"{name}: shape {tuple(src.shape)} in the weights, "
                                     f"{tuple(t.shape)} in the model")
                t.copy_(src)

"""A Hugging Face model directory: config.json + model.safetensors, written one way for
`sess.save_pretrained` and `ckpt export` (the example model's `models.llama.save_hf` keeps
its own: the training library must not depend on the example model, nor it on us)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_hf_dir(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict | None,
                 metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (copied to contiguous CPU tensors) and, when given, `config`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(flat, str(out / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

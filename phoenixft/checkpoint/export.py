"""A persisted step as a model: the trainable parameters gathered from every rank's shard,
the untrained tensors (frozen parameters, buffers) written once per generation, and the
job's Hugging Face config, as a directory `transformers` loads and `phoenixft serve`
serves (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from phoenixft.checkpoint.hf_dir import write_hf_dir
from phoenixft.checkpoint.slots import blob_tensors
from phoenixft.checkpoint.tiers import FsspecTier


def model_state(tier: FsspecTier, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model state dict of a committed step, and its manifest."""
    manifest = tier.read_manifest(step)
    meta = manifest["model"]["meta"]
    shards = []
    for r in range(manifest["world_size"]):
        _, tensors = blob_tensors(tier.get(step, r, manifest), step, f"{tier.url} rank {r} step {step}")
        shards.append(tensors["param_shard"])
    flat = torch.cat(shards)[:meta["numel"]]
    state: dict[str, torch.Tensor] = {}
    flat = flat.to(getattr(torch, meta["dtype"]))  # master shards may be fp32 (mixed precision)
    for name, shape, off in meta["params"]:
        n = 1
        for d in shape:
            n *= d
        state[name] = flat[off:off + n].view(shape).clone()
    fixed = manifest["model"].get("fixed")
    if fixed:
        state.update(load_safetensors(tier.read_object(fixed)))
    for alias in meta.get("aliases", {}):
        state.pop(alias, None)  # tied weights are saved once, as transformers does
    return state, manifest


def export_hf(tier: FsspecTier, step: int, out_dir: str | Path) -> Path:
    state, manifest = model_state(tier, step)
    config = manifest["model"]["meta"].get("config")
    if config is None:
        raise ValueError(f"step {step} of {tier.url} has no model config (the job's model has no "
                         "Hugging Face config), so it cannot be written as a Hugging Face model")
    return write_hf_dir(out_dir, state, config, {"phoenixft_step": str(step),
                                                 "phoenixft_job": manifest["job_id"]})

"""Hugging Face model directory (config.json + *.safetensors) -> ``PagedCausalLM``.

Only safetensors are read (never pickle). The module is built on the meta device and the
checkpoint tensors are assigned to it, so loading does no wasted random init. Weights are
converted to float32: the engine runs on CPU and its correctness oracle is transformers'
float32 output.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .config import ModelConfig
from .model import PagedCausalLM


def weight_files(model_dir: str | Path) -> list[Path]:
    """The model's safetensors files, each checked readable (its header parses and its
    tensors fit the file), so a damaged download fails here, in one line naming the file
    and the cause (ValueError), not as a traceback when the engine loads it."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir} (pickle checkpoints such as "
                         "pytorch_model.bin are not loaded)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                list(st.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise _unreadable(f, exc) from None
    return files


def _unreadable(f: Path, exc: BaseException) -> ValueError:
    return ValueError(f"weights file {f} is not a readable safetensors file "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                      "re-save or re-download it")


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            tensors.update(load_file(str(f), device="cpu"))
        except Exception as exc:  # noqa: BLE001 - as in weight_files
            raise _unreadable(f, exc) from None
    return tensors


def fuse_hf_state(tensors: dict[str, torch.Tensor], num_layers: int
                  ) -> dict[str, torch.Tensor]:
    """transformers names -> ours: q/k/v stacked into qkv_proj.

    Leaves the dict unchanged where a layer lacks one of the parts, so the name check in
    ``load_model`` reports the missing tensor by its Hugging Face name.
    """
    out = dict(tensors)
    for i in range(num_layers):
        pre = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            names = [f"{pre}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if all(n in out for n in names):
                out[f"{pre}self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32
               ) -> tuple[ModelConfig, PagedCausalLM]:
    """Build the model described by ``model_dir`` and load its weights.

    Raises ``ValueError`` naming the missing or unexpected tensors when the checkpoint
    does not match the architecture in config.json.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_hf(path)
    tensors = {k: v.to(dtype) for k, v in _read_tensors(path).items()}
    tensors = fuse_hf_state(tensors, cfg.num_hidden_layers)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = PagedCausalLM(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(f"checkpoint in {path} does not match config.json: missing "
                         f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    model.load_state_dict({k: tensors[k] for k in expected}, strict=False, assign=True)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return cfg, model

"""A small Llama-family decoder in plain PyTorch, laid out like Hugging Face's.

Parameter names match `transformers.LlamaForCausalLM` (``model.layers.0.self_attn.q_proj.weight``
...), so a model trained here is saved as a Hugging Face directory (config.json +
model.safetensors) that transformers and our serving engine both load. The training
forward uses full causal attention; the serving engine has its own model with paged
attention (it covers Qwen2/Qwen3 too) and takes only the rotary tables from here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257


@dataclass(kw_only=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama config.json that the architecture needs."""

    vocab_size: int = BYTE_VOCAB + 2
    hidden_size: int = 128
    intermediate_size: int = 344
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int | None = None
    max_position_embeddings: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = BOS_ID
    eos_token_id: int | None = EOS_ID

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("LlamaConfig.num_attention_heads must be a multiple of "
                             "num_key_value_heads (grouped-query attention)")

    def to_hf_dict(self) -> dict:
        d = asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 torch_dtype="float32", attention_dropout=0.0, mlp_bias=False,
                 phoenixft_tokenizer="bytes")
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (len(positions), head_dim), Hugging Face's (non-interleaved) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (..., T, head_dim); cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)  # fp32 tables keep a bf16 model bf16


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Training-side model: ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = rope_tables(self.config.head_dim, torch.arange(t), self.config.rope_theta)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class LlamaStage(nn.Module):
    """One pipeline stage of a `LlamaForCausalLM`, split the way torchtitan splits one: the
    first stage holds the embedding, each stage a contiguous run of decoder layers, the last
    the final norm and the output head. Its modules are the full model's own (no copy), and
    its state-dict keys are the full model's (`model.layers.5.mlp.up_proj.weight` keeps its
    5), so the stages' state dicts together are the model's and a checkpoint can be
    resharded onto another number of stages. Its input is token ids (first stage) or the
    previous stage's hidden states; its output hidden states, or logits (last stage)."""

    def __init__(self, model: LlamaForCausalLM, stage: int, num_stages: int) -> None:
        super().__init__()
        cfg = model.config
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} of {num_stages}: a stage is 0 .. {num_stages - 1}")
        if num_stages > cfg.num_hidden_layers:
            raise ValueError(f"{num_stages} pipeline stages for {cfg.num_hidden_layers} decoder "
                             "layers: each stage needs a layer at least (lower --pp)")
        if cfg.tie_word_embeddings and num_stages > 1:
            raise ValueError("tied word embeddings live on the first and the last stage at "
                             "once: untie them (tie_word_embeddings=False) to pipeline the model")
        self.config, self.stage, self.num_stages = cfg, stage, num_stages
        self.layer_ids = stage_layers(cfg.num_hidden_layers, stage, num_stages)
        first, last = stage == 0, stage == num_stages - 1
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in self.layer_ids})
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        cos, sin = rope_tables(self.config.head_dim, torch.arange(t), self.config.rope_theta)
        if self.stage == 0:
            x = self.model.embed_tokens(x)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin)
        if self.stage == self.num_stages - 1:
            x = self.lm_head(self.model.norm(x))
        return x


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers stage `stage` of `num_stages` holds: contiguous, as even as they
    divide (the first stages take none of the remainder: they hold the embedding)."""
    return range(stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages)


def save_hf(model: LlamaForCausalLM, out_dir: str | Path,
            state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors that `transformers` and `phoenixft serve` load."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(state if state is not None else model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    return out


def preset(name: str) -> LlamaConfig:
    """Model sizes for the example: `tiny` for tests, `small` for the demo, `ref` the
    reference workload of docs/notes.md (10.8M parameters)."""
    presets = {
        "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128),
        "ref": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=128),
    }
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(presets)}")
    return LlamaConfig(**presets[name])


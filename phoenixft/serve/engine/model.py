"""Llama-family decoder whose attention reads and writes a paged KV cache.

The forward takes the tokens of a whole batch flattened to one dimension (no padding in
the projections and MLP), writes each token's K and V into its cache slot, then attends
per sequence over K/V gathered through the sequence's block table. Parameter names follow
transformers except one fusion that saves two small matmuls per layer (on CPU a step of a
small model is dominated by per-call overhead): ``self_attn.qkv_proj`` is q/k/v stacked
(``loader.fuse_hf_state``; as fast as the three apart for a 52M model, with fewer calls).
Covers Llama (optional q/k/v/o bias), Qwen2 (q/k/v bias) and Qwen3 (per-head RMSNorm on
q and k before RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from phoenixft.models.llama import apply_rope

from .config import ModelConfig


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together: flat tokens [start, end) of the batch.

    Attention runs on a padded [batch, max_query_len] layout: ``query_index`` maps the
    group's flat tokens into it (None when every sequence has one query: decode),
    ``mask`` is [batch, 1, max_query_len, kv_len] (True = attend; for a decode group an
    additive float mask of 0 / -inf), and ``block_tables``
    [batch, max_blocks] lists each sequence's blocks (padding entries point at block 0
    and are masked out). Decodes and prefills form separate groups so one long prompt
    does not pad every decode row to its length.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    mask: torch.Tensor
    query_index: torch.Tensor | None
    max_query_len: int
    kv_len: int
    q_lens: list[int] = field(default_factory=list)  # each sequence's new tokens
    ctx_lens: list[int] = field(default_factory=list)  # and its length with them


@dataclass(slots=True)
class AttentionMetadata:
    """Where a batch's tokens sit, built once per step by the runner and shared by layers.

    ``slot_mapping[i]`` is the flat cache slot (block * block_size + offset) that token
    ``i`` writes; ``cos``/``sin`` are its rotary factors.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    groups: list[AttentionGroup]
    adapters: list = field(default_factory=list)  # (Adapter, token rows) per adapter version


class RMSNorm(nn.Module):
    """Same math as transformers' (float32 statistics), as one fused ``F.rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU. Gate and up stay two matmuls: stacked into one they were slower on this
    CPU at every size measured (1.04-1.43x for 1-32 rows, hidden 256-1024; 12% of a
    decode step of a 52M-parameter model), though it saves a call."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PagedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        hd = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        for adapter, rows in meta.adapters:  # LoRA on q and v, for the rows that use it
            xa = x.index_select(0, rows)
            aq, bq = adapter.pair(self.layer, "q")
            av, bv = adapter.pair(self.layer, "v")
            qkv[rows, :self.q_size] += adapter.scale * ((xa @ aq.T) @ bq.T)
            qkv[rows, self.q_size + self.kv_size:] += adapter.scale * ((xa @ av.T) @ bv.T)
        qkv = qkv.view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = apply_rope(qk, meta.cos, meta.sin)  # q and k heads rotated in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.contiguous()
        # Write first, then gather: a sequence sharing a prefix block written by another
        # sequence in this same step reads the freshly written values.
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        outs = [self._attend(q[g.start:g.end], g, k_cache, v_cache) for g in meta.groups]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o_proj(out)


    def _attend(self, q: torch.Tensor, g: AttentionGroup, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        b, nb = g.block_tables.shape
        bs = k_cache.shape[1]
        flat_tables = g.block_tables.view(-1)
        keys = k_cache.index_select(0, flat_tables).view(b, nb * bs, self.num_kv_heads,
                                                         self.head_dim)
        vals = v_cache.index_select(0, flat_tables).view(b, nb * bs, self.num_kv_heads,
                                                         self.head_dim)
        keys = keys[:, :g.kv_len].transpose(1, 2)
        vals = vals[:, :g.kv_len].transpose(1, 2)
        # In bfloat16 (float16), SDPA's CPU kernel gives a sequence other results beside a
        # longer one (its padding), where an engine resumed after a crash, batched
        # otherwise, must compute what the first one did. So a decode attends in float32
        # (scores rounded to bfloat16 would also drift from transformers, whose kernels
        # keep them in float32) and a prefill one sequence at a time, without padding.
        if g.query_index is None:  # one query per sequence (decode): no padding
            # Plain matmuls with the query heads grouped per KV head: about twice as fast
            # as SDPA's CPU kernel for a single query, and no K/V repeat for GQA.
            qg = q.view(b, self.num_kv_heads, -1, self.head_dim).float()
            scores = torch.matmul(qg, keys.float().transpose(-1, -2)) * self.head_dim ** -0.5
            probs = (scores + g.mask.view(b, 1, 1, -1)).softmax(dim=-1)
            out = torch.matmul(probs, vals.float()).reshape(b, self.num_heads * self.head_dim)
            return out.to(q.dtype)
        if q.dtype != torch.float32:
            return self._prefill_each(q, g, keys, vals)
        mq = g.max_query_len
        qp = q.new_zeros(b * mq, self.num_heads, self.head_dim)
        qp[g.query_index] = q
        qp = qp.view(b, mq, self.num_heads, self.head_dim)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, vals,
                                             attn_mask=g.mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b * mq, self.num_heads * self.head_dim)
        return out[g.query_index]

    def _prefill_each(self, q: torch.Tensor, g: AttentionGroup, keys: torch.Tensor,
                      vals: torch.Tensor) -> torch.Tensor:
        """Prefill attention one sequence at a time, over exactly its own tokens."""
        outs, s0 = [], 0
        for i, (ql, cl) in enumerate(zip(g.q_lens, g.ctx_lens)):
            qi = q[s0:s0 + ql].transpose(0, 1).unsqueeze(0)
            causal = ql == cl  # no cached prefix: the kernel's own causal mask
            o = F.scaled_dot_product_attention(
                qi, keys[i:i + 1, :, :cl], vals[i:i + 1, :, :cl], is_causal=causal,
                attn_mask=None if causal else g.mask[i:i + 1, :, :ql, :cl], enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(ql, self.num_heads * self.head_dim))
            s0 += ql
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = PagedAttention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class PagedCausalLM(nn.Module):
    """Flat token ids -> final hidden states; ``compute_logits`` on the rows that need them.

    Separating the two lets a step compute the vocabulary projection only for each
    sequence's last token.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """input_ids [N]; k/v_caches [layers, blocks, block_size, kv_heads, head_dim]."""
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, meta, k_caches[i], v_caches[i])
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

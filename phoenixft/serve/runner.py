"""Owns the model and the preallocated KV cache; turns a scheduled batch into logits.

The cache is two tensors ``[layers, num_blocks, block_size, kv_heads, head_dim]`` (K and
V) allocated once, so a block is a fixed slice that a recovery log can copy by index
(``kv_block(layer, block)``) and that never moves while the engine runs.
"""

from __future__ import annotations

import torch

from phoenixft.models.llama import rope_tables

from .config import EngineConfig, ModelConfig
from .model import AttentionMetadata, PagedCausalLM
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: PagedCausalLM, model_config: ModelConfig,
                 config: EngineConfig) -> None:
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved EngineConfig (call .resolve(model))")
        self.model, self.model_config, self.config = model, model_config, config
        mc = model_config
        shape = (mc.num_hidden_layers, config.num_blocks, config.block_size,
                 mc.num_key_value_heads, mc.head_dim)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self.cos, self.sin = rope_tables(mc.head_dim, torch.arange(config.max_model_len),
                                         mc.rope_theta)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_bytes_per_token

    def prepare(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionMetadata,
                                                     torch.Tensor]:
        """Flat input ids, attention metadata and the flat index of each sequence's last
        token, for computing ``token_ids[num_computed_tokens:]`` of every sequence."""
        bs = self.config.block_size
        ids: list[int] = []
        starts, q_lens, ctx_lens = [], [], []
        for s in seqs:
            start = s.num_computed_tokens
            ids.extend(s.token_ids[start:])
            starts.append(start)
            q_lens.append(len(s) - start)
            ctx_lens.append(len(s))
        b, kv_len, mq = len(seqs), max(ctx_lens), max(q_lens)
        nb = -(-kv_len // bs)
        tables = torch.zeros(b, nb, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table[:nb], dtype=torch.long)
        q_lens_t = torch.tensor(q_lens)
        row = torch.repeat_interleave(torch.arange(b), q_lens_t)
        offset_in_row = torch.arange(len(ids)) - torch.repeat_interleave(
            torch.cumsum(q_lens_t, 0) - q_lens_t, q_lens_t)
        positions = torch.tensor(starts)[row] + offset_in_row
        slots = tables[row, positions // bs] * bs + positions % bs
        kv_pos = torch.arange(kv_len)
        if mq == 1:
            query_index = None
            mask = (kv_pos[None, :] < torch.tensor(ctx_lens)[:, None]).view(b, 1, 1, kv_len)
        else:
            query_index = row * mq + offset_in_row
            qpos = torch.zeros(b * mq, dtype=torch.long)
            qpos[query_index] = positions
            mask = (kv_pos[None, None, :] <= qpos.view(b, mq, 1)).view(b, 1, mq, kv_len)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, block_tables=tables, mask=mask,
            query_index=query_index, max_query_len=mq, kv_len=kv_len,
            cos=self.cos[positions][:, None, :], sin=self.sin[positions][:, None, :])
        last = torch.cumsum(q_lens_t, 0) - 1
        return torch.tensor(ids, dtype=torch.long), meta, last

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], all_logits: bool = False) -> torch.Tensor:
        """Logits [batch, vocab] for each sequence's last token (or [tokens, vocab] for all
        computed tokens when ``all_logits``, used by the tests against transformers)."""
        ids, meta, last = self.prepare(seqs)
        hidden = self.model(ids, meta, self.k_cache, self.v_cache)
        return self.model.compute_logits(hidden if all_logits else hidden[last])

    def kv_block(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (not copies) of one block's K and V in one layer: the unit of logging."""
        return self.k_cache[layer, block], self.v_cache[layer, block]

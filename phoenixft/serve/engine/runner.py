"""Owns the model and the preallocated KV cache; turns a scheduled batch into logits.

The cache is two tensors ``[layers, num_blocks, block_size, kv_heads, head_dim]`` (K and
V) allocated once, so a block is a fixed slice that a recovery log can copy by index and
that never moves while the engine runs.
"""

from __future__ import annotations

import mmap
import os

import torch

from phoenixft.models.llama import rope_tables

from .config import EngineConfig, ModelConfig
from .model import AttentionGroup, AttentionMetadata, PagedCausalLM
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: PagedCausalLM, model_config: ModelConfig,
                 config: EngineConfig) -> None:
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved EngineConfig (call .resolve(model))")
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: no CUDA device is visible here")
        self.model, self.model_config, self.config = model.to(self.device), model_config, config
        mc = model_config
        shape = (mc.num_hidden_layers, config.num_blocks, config.block_size,
                 mc.num_key_value_heads, mc.head_dim)
        self.dtype = config.torch_dtype  # weights, activations, KV cache
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.kv_fd: int | None = None  # the memfd holding K then V, once shared
        # rotary factors computed in float32, then rounded once to the model's dtype
        self.cos, self.sin = (t.to(self.device, self.dtype) for t in rope_tables(
            mc.head_dim, torch.arange(config.max_model_len), mc.rope_theta))
        self.adapters = None  # the engine's AdapterStore

    def share_kv(self) -> int:
        """Move the host KV cache into one shared-memory file (a memfd: K, then V) that the
        recovery log's executor process maps to read the slots it logs; returns its fd.
        Done once, when the engine is loaded (it copies the cache)."""
        if self.kv_fd is not None:
            return self.kv_fd
        if self.k_cache.device.type != "cpu":
            raise ValueError("only a host KV cache can be shared with an executor process")
        nbytes = self.k_cache.numel() * self.k_cache.element_size()
        fd = os.memfd_create("phoenixft-kv-cache", 0)
        os.ftruncate(fd, 2 * nbytes)
        self._kv_map = mmap.mmap(fd, 2 * nbytes)
        flat = torch.frombuffer(self._kv_map, dtype=self.k_cache.dtype)
        shape = self.k_cache.shape
        k, v = flat[:self.k_cache.numel()].view(shape), flat[self.k_cache.numel():].view(shape)
        k.copy_(self.k_cache)
        v.copy_(self.v_cache)
        self.k_cache, self.v_cache, self.kv_fd = k, v, fd
        return fd

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_values_per_token * self.k_cache.element_size()

    def _group(self, seqs: list[Sequence], start: int) -> tuple[AttentionGroup, torch.Tensor,
                                                              torch.Tensor]:
        """One attention group over ``seqs`` whose tokens begin at flat index ``start``;
        also returns the group's token positions and cache slots."""
        bs = self.config.block_size
        starts = [s.num_computed_tokens for s in seqs]
        q_lens = torch.tensor([s.new_tokens for s in seqs])
        ctx_lens = [s.num_computed_tokens + s.new_tokens for s in seqs]
        b, kv_len, mq = len(seqs), max(ctx_lens), int(q_lens.max())
        nb = -(-kv_len // bs)
        tables = torch.zeros(b, nb, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table[:nb], dtype=torch.long)
        n = int(q_lens.sum())
        row = torch.repeat_interleave(torch.arange(b), q_lens)
        offset_in_row = torch.arange(n) - torch.repeat_interleave(
            torch.cumsum(q_lens, 0) - q_lens, q_lens)
        positions = torch.tensor(starts)[row] + offset_in_row
        slots = tables[row, positions // bs] * bs + positions % bs
        kv_pos = torch.arange(kv_len)
        if mq == 1:
            query_index = None
            valid = kv_pos[None, :] < torch.tensor(ctx_lens)[:, None]
            mask = torch.zeros(b, 1, 1, kv_len).masked_fill_(  # (added in float32)
                ~valid.view(b, 1, 1, kv_len), float("-inf"))
        else:
            query_index = row * mq + offset_in_row
            qpos = torch.zeros(b * mq, dtype=torch.long)  # padding rows see position 0
            qpos[query_index] = positions
            mask = (kv_pos[None, None, :] <= qpos.view(b, mq, 1)).view(b, 1, mq, kv_len)
        group = AttentionGroup(start=start, end=start + n, block_tables=tables, mask=mask,
                               query_index=query_index, max_query_len=mq, kv_len=kv_len,
                               q_lens=q_lens.tolist(), ctx_lens=ctx_lens)
        return group, positions, slots

    def prepare(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionMetadata,
                                                     torch.Tensor]:
        """Flat input ids, attention metadata and the flat index of each sequence's last
        token, for computing the next ``new_tokens`` of every sequence (from
        ``num_computed_tokens`` on).

        Sequences must come decodes first (one new token each), then prefills (whole, or
        a chunk), as the scheduler orders them; each kind forms one attention group.
        """
        n_decode = 0
        for s in seqs:
            if s.new_tokens != 1:
                break
            n_decode += 1
        parts = [p for p in (seqs[:n_decode], seqs[n_decode:]) if p]
        ids: list[int] = []
        for s in seqs:
            ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.new_tokens])
        groups, positions, slots, start = [], [], [], 0
        for part in parts:
            g, pos, sl = self._group(part, start)
            groups.append(g)
            positions.append(pos)
            slots.append(sl)
            start = g.end
        dev = self.device
        pos = (torch.cat(positions) if len(positions) > 1 else positions[0]).to(dev)
        q_lens = torch.tensor([s.new_tokens for s in seqs])
        if dev.type != "cpu":  # built on the host, moved once per step
            for g in groups:
                g.block_tables, g.mask = g.block_tables.to(dev), g.mask.to(dev)
                if g.query_index is not None:
                    g.query_index = g.query_index.to(dev)
        meta = AttentionMetadata(
            positions=pos,
            slot_mapping=(torch.cat(slots) if len(slots) > 1 else slots[0]).to(dev),
            cos=self.cos[pos][:, None, :], sin=self.sin[pos][:, None, :], groups=groups,
            adapters=self._adapter_rows(seqs, q_lens))
        last = (torch.cumsum(q_lens, 0) - 1).to(dev)
        return torch.tensor(ids, dtype=torch.long).to(dev), meta, last

    def _adapter_rows(self, seqs: list[Sequence], q_lens: torch.Tensor) -> list:
        """(adapter version, its token rows in the flat batch), for sequences using one."""
        if self.adapters is None or not any(s.adapter for s in seqs):
            return []
        if self.device.type != "cpu":
            raise ValueError("adapters are served on the CPU engine only (device cpu)")
        ends = torch.cumsum(q_lens, 0).tolist()
        rows: dict[tuple[str, int], list[int]] = {}
        start = 0
        for s, end in zip(seqs, ends):
            if s.adapter:
                rows.setdefault((s.adapter, s.adapter_version), []).extend(range(start, end))
            start = end
        return [(self.adapters.get(*key), torch.tensor(r)) for key, r in rows.items()]

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], all_logits: bool = False) -> torch.Tensor:
        """Logits [batch, vocab] for each sequence's last token (or [tokens, vocab] for all
        computed tokens when ``all_logits``, used by the tests against transformers)."""
        ids, meta, last = self.prepare(seqs)
        hidden = self.model(ids, meta, self.k_cache, self.v_cache)
        logits = self.model.compute_logits(hidden if all_logits else hidden[last])
        # sampled on the host in float32, from the model dtype's logits (as vLLM does)
        return logits.float() if self.device.type == "cpu" else logits.float().cpu()

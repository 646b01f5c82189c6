"""The random models the serving benchmarks run (`bench serve`, closed and open loop)."""

from __future__ import annotations

from pathlib import Path

SIZES = {
    # 4 layers, d=256, GQA 8/2 heads: overheads (scheduling, Python) matter as much as FLOPs
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2),
    # 12 layers, d=640, GQA 10/2 heads: compute dominates
    "medium": dict(hidden_size=640, intermediate_size=1728, num_hidden_layers=12,
                   num_attention_heads=10, num_key_value_heads=2),
}


def build_bench_model(out: Path, size: str = "tiny", max_positions: int = 512) -> str:
    """A random byte-vocab Llama of the given size (512 positions by default)."""
    import torch

    from phoenixft.models.llama import LlamaConfig, LlamaForCausalLM, save_hf

    torch.manual_seed(0)
    shape = SIZES[size]
    cfg = LlamaConfig(**shape, max_position_embeddings=max_positions)
    model = LlamaForCausalLM(cfg)
    save_hf(model, out)
    return (f"random Llama ({size}), {model.num_params() / 1e6:.1f}M params, "
            f"{shape['num_hidden_layers']}x{shape['hidden_size']}")

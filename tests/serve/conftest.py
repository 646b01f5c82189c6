"""Tiny random Hugging Face models (Llama, Qwen2, Qwen3) saved once per test session.

Parameters are perturbed after init (docs/notes.md): init leaves norms at 1 and biases at 0,
which would hide a missing bias or norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}

ARCHS = ["llama", "qwen2", "qwen3"]


def build_hf(arch: str, out: Path, tie: bool = False, seed: int = 0, **overrides):
    import transformers as tf

    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]
    extra = {"attention_bias": True} if arch == "llama" else {}
    cfg = cls_cfg(**{**TINY, **overrides}, tie_word_embeddings=tie, **extra)
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(out)
    return model


def write_chat_tokenizer(out: Path) -> None:
    """A 128-entry WordLevel tokenizer over the tiny vocab, with a jinja chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = [f"w{i}" for i in range(128 - len(specials))]
    vocab = {t: i for i, t in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok.save(str(out / "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (directory, transformers model); the Llama one is tied and has biases."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, arch in enumerate(ARCHS):
        d = root / arch
        model = build_hf(arch, d, tie=(arch == "llama"), seed=i)
        out[arch] = (d, model)
    write_chat_tokenizer(out["qwen2"][0])
    return out


@pytest.fixture(scope="session")
def long_model_bf16(tmp_path_factory) -> Path:
    """The long tiny Qwen2 saved in bfloat16 (config.json's dtype says so)."""
    root = tmp_path_factory.mktemp("long-bf16")
    model = build_hf("qwen2", root / "fp32", seed=7, max_position_embeddings=1024)
    d = root / "qwen2-long-bf16"
    model.to(torch.bfloat16).save_pretrained(d)
    write_chat_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> Path:
    """The tiny Qwen2 with a 1024-token context and the word-level chat tokenizer: prompts
    of several hundred tokens for the crash-recovery tests."""
    d = tmp_path_factory.mktemp("long") / "qwen2-long"
    build_hf("qwen2", d, seed=7, max_position_embeddings=1024)
    write_chat_tokenizer(d)
    return d

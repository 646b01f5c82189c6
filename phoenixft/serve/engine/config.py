"""Configuration of the serving engine: the model's shape, the engine's limits, sampling.

Every dataclass checks its own fields in ``__post_init__`` and raises ``ValueError`` with
a message naming the field, so a bad request parameter or a bad engine flag fails at the
edge (HTTP 400, CLI error) instead of deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")  # what the engine computes and caches in
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The architecture fields of a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3).

    Attribute names follow transformers, so ``phoenixft.models.llama.MLP`` accepts it.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    byte_tokenizer: bool = False
    torch_dtype: str = "float32"  # the checkpoint's (config.json), what --dtype auto takes

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"config.json: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("config.json: num_attention_heads must be a multiple of "
                             "num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings, "
                             f"got {self.head_dim}")

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a model directory; reject what we cannot run exactly."""
        p = Path(path)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            raise ValueError(f"no config.json in {p}")
        d = json.loads(cfg_file.read_text())
        mt = d.get("model_type", "llama")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported (only default RoPE)")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        gen = p / "generation_config.json" if p.is_dir() else None
        if gen is not None and gen.is_file():
            g_eos = json.loads(gen.read_text()).get("eos_token_id")
            if g_eos is not None:
                extra = g_eos if isinstance(g_eos, list) else [g_eos]
                eos_ids = tuple(dict.fromkeys([*eos_ids, *map(int, extra)]))
        heads = d["num_attention_heads"]
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(d.get("attention_bias", False)),
            o_bias=mt != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=mt == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            byte_tokenizer=d.get("phoenixft_tokenizer") == "bytes",
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: str = "float32") -> int:
        """Bytes of K and V one token occupies across all layers, cached in `dtype`."""
        return self.kv_values_per_token * ITEMSIZE[dtype]


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Limits of the engine. ``None`` fields are derived from the model when it loads.

    ``num_blocks`` defaults to what ``kv_cache_bytes`` holds, capped at what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever need.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    tokenizer: str | None = None  # a directory with tokenizer.json (default: the model's)
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's
    device: str = "cpu"  # where weights, KV cache and compute live: cpu, cuda, cuda:N
    # weights, activations and KV cache: float32, bfloat16, float16, or auto (the
    # checkpoint's torch_dtype); sampling and logprobs are float32 whatever it is
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"EngineConfig.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"EngineConfig.dtype must be auto or one of {', '.join(DTYPES)}, "
                             f"got {self.dtype!r}")
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")

    def resolve(self, model: ModelConfig) -> EngineConfig:
        """Fill the derived fields for ``model`` and check they are consistent."""
        dtype = self.dtype
        if dtype == "auto":
            dtype = model.torch_dtype if model.torch_dtype in DTYPES else "float32"
        max_len = self.max_model_len or min(model.max_position_embeddings, 2048)
        if max_len > model.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={max_len} exceeds the model's "
                             f"max_position_embeddings={model.max_position_embeddings}")
        blocks_per_seq = -(-max_len // self.block_size)
        num_blocks = self.num_blocks
        if num_blocks is None:
            by_memory = self.kv_cache_bytes // (model.kv_bytes_per_token(dtype) * self.block_size)
            num_blocks = max(blocks_per_seq, min(by_memory, blocks_per_seq * self.max_num_seqs))
        if num_blocks < blocks_per_seq:
            raise ValueError(f"EngineConfig.num_blocks={num_blocks} cannot hold one sequence of "
                             f"max_model_len={max_len} ({blocks_per_seq} blocks of "
                             f"{self.block_size}); lower max_model_len or add blocks")
        return EngineConfig(block_size=self.block_size, num_blocks=num_blocks,
                            kv_cache_bytes=self.kv_cache_bytes, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=max_len,
                            enable_prefix_caching=self.enable_prefix_caching,
                            tokenizer=self.tokenizer, chat_template=self.chat_template,
                            device=self.device, dtype=dtype)

    @property
    def torch_dtype(self):
        """The resolved dtype as a torch dtype (after `resolve`)."""
        import torch

        if self.dtype == "auto":
            raise ValueError("EngineConfig.dtype auto is resolved against a model first")
        return getattr(torch, self.dtype)


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` below `GREEDY_BELOW` is greedy (dividing logits by a tiny temperature
    overflows to inf/NaN; the limit of such a temperature *is* greedy). ``top_k`` 0 or -1
    disables it and a ``top_k`` beyond the vocabulary keeps the whole vocabulary. With
    ``seed`` set, sampled tokens depend only on the
    seed, the token's index and the logits: not on which other requests share the batch,
    nor on preemption (the random draw for token i is a pure function of (seed, i)).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times how often it was generated
    repetition_penalty: float = 1.0  # HF/vLLM: logits of prompt or generated tokens / by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logits
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [-1, 2^31) (0 or -1 disables it), "
                             f"got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError("at most 16 stop strings are supported")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        try:  # JSON gives the keys as strings
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to numbers") from None
        if len(self.logit_bias) > 300:
            raise ValueError("logit_bias may name at most 300 tokens")
        for k, v in self.logit_bias.items():
            if k < 0 or not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in "
                                 f"[-100, 100], got {k}: {v}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (integers >= 0)")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs/top_logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

"""What serving needs to know about a model without its weights: its configuration, its
tokenizer, the engine's resolved limits, and how to turn a request into a validated
`Sequence`. The HTTP front holds one (it validates and tokenizes requests, so bad input
is refused before it reaches an engine process); every `LLMEngine` holds one too."""

from __future__ import annotations

import secrets
from pathlib import Path

from .config import EngineConfig, ModelConfig, SamplingParams
from .sequence import Sequence
from .tokenizer import load_tokenizer


class EngineSpec:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None,
                 model_config: ModelConfig | None = None) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ValueError(f"model directory {self.model_dir} does not exist")
        self.model_config = model_config or ModelConfig.from_hf(self.model_dir)
        self.config = (config or EngineConfig()).resolve(self.model_config)
        tok_dir = Path(self.config.tokenizer) if self.config.tokenizer else self.model_dir
        if not (tok_dir / "tokenizer.json").is_file() and self.config.tokenizer:
            raise ValueError(f"--tokenizer {tok_dir}: no tokenizer.json there")
        self.tokenizer = load_tokenizer(tok_dir, self.model_config)
        if self.config.chat_template is not None:
            self.tokenizer.chat_template = self.config.chat_template

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len  # type: ignore[return-value]

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      keep_logits: bool = False, add_special_tokens: bool = True) -> Sequence:
        """Tokenize and validate a request; ValueError (a client error) when it cannot be
        served. The seed is resolved here, so a request replayed elsewhere samples the
        same tokens."""
        ids = (self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
               if isinstance(prompt, str) else list(prompt))
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        for name, toks in (("logit_bias", params.logit_bias), ("stop_token_ids",
                                                               params.stop_token_ids)):
            if any(t >= vocab for t in toks):
                raise ValueError(f"{name}: token ids must be below the vocabulary size {vocab}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + params.max_tokens} were requested ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion); shorten the prompt or lower "
                "max_tokens")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        return Sequence(seq_id=request_id, token_ids=ids, num_prompt_tokens=len(ids),
                        params=params, seed=seed, keep_logits=keep_logits)

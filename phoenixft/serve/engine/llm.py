"""Offline Python API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``.

Runs the same engine as the server, stepping it in the caller's thread until every
prompt finished; outputs come back in the order of the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import EngineConfig, SamplingParams
from .llm_engine import LLMEngine


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logits: list[torch.Tensor] = field(default_factory=list)


class LLM:
    """A model directory loaded for offline generation.

    ``config`` sets the engine's limits (KV blocks, batch size, context length); keyword
    arguments are shorthand for ``EngineConfig`` fields.
    """

    def __init__(self, model: str | Path, config: EngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError("pass either config or EngineConfig keyword arguments, not both")
        self.engine = LLMEngine(model, config or EngineConfig(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def load_adapter(self, name: str, path: str | Path, *, replace: bool = False) -> int:
        """Load a LoRA-style adapter (adapters.py) under `name` (`replace`: a new version
        of a loaded one); returns its version."""
        return self.engine.load_adapter(name, path, replace=replace)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 keep_logits: bool = False, adapter: str | None = None) -> list[CompletionOutput]:
        """Generate for every prompt (text or token ids) with continuous batching.

        ``keep_logits`` keeps each generated token's logits (what the tests compare with
        transformers); ``adapter`` names a loaded adapter to apply.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        seqs = []
        for prompt, p in zip(prompts, plist):
            self._counter += 1
            seqs.append(self.engine.add_request(f"llm-{self._counter}", prompt, p,
                                                keep_logits=keep_logits, adapter=adapter))
        while self.engine.has_unfinished():
            self.engine.step()
        return [CompletionOutput(s.prompt_token_ids, s.completion_token_ids, s.output_text,
                                 s.finish_reason, s.logits) for s in seqs]

    def chat(self, messages: list[dict], params: SamplingParams | None = None
             ) -> CompletionOutput:
        """One chat completion, rendered with the tokenizer's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], params)[0]

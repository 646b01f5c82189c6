"""Request bodies of the OpenAI-compatible API (pydantic, strict types).

Strict mode makes "fields of the wrong type" a 400 rather than a silent coercion (a
string max_tokens is rejected). A field this server does not honour is a 400 naming it
(`unsupported_fields`), never silently ignored: OpenAI's and vLLM's servers either honour
a field or refuse it. Value checks (ranges) live in ``SamplingParams``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from phoenixft.serve.engine.config import SamplingParams

MAX_CHOICES = 64  # prompts x n of one request


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", protected_namespaces=())

    def unsupported_fields(self) -> list[str]:
        """Fields of the body this server does not know or does not honour."""
        return sorted(self.model_extra or {})


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # vLLM's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the operator's logs; it changes nothing

    def check(self) -> None:
        """ValueError (-> 400) for what no request may ask."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")

    def top_logprobs_wanted(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """ValueError (-> 400) on out-of-range values. Choice i of a seeded request with
        n > 1 uses seed + i, so it equals a single request with that seed."""
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}), logprobs=self.top_logprobs_wanted())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # the chosen token's and this many most likely (0..20)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be an empty list")
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def check(self) -> None:
        super().check()
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs (the prompt's logprobs) is not "
                             "supported; ask for one or the other")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class LoadAdapterRequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported_fields(self) -> list[str]:
        out = super().unsupported_fields()
        for i, m in enumerate(self.messages):
            out += [f"messages[{i}].{k}" for k in m.unsupported_fields()]
            if isinstance(m.content, list):
                out += [f"messages[{i}].content.{k}" for p in m.content
                        for k in p.unsupported_fields()]
        return out

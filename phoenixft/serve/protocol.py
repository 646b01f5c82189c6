"""Request bodies of the OpenAI-compatible API (pydantic, strict types).

Strict mode makes "fields of the wrong type" a 400 rather than a silent coercion (a
string max_tokens is rejected). Unknown fields are ignored, as OpenAI's server does for
fields it does not know. Value checks (ranges) live in ``SamplingParams``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .config import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """ValueError (-> 400) on out-of-range values."""
        if self.n != 1:
            raise ValueError("only n=1 is supported")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class LoadAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

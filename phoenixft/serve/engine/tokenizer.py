"""Text <-> token ids, and chat templates.

Two implementations behind one small interface: ``HFTokenizer`` reads ``tokenizer.json``
with the ``tokenizers`` library (plus ``tokenizer_config.json`` for special tokens and the
jinja chat template); ``ByteTokenizer`` is the byte-level vocabulary of our example model
(ids 0..255 are bytes, 256 BOS, 257 EOS). Chat templates render in a sandboxed jinja2
environment, so a template from a model directory cannot reach Python objects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import ModelConfig


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Base: subclasses implement ``encode``/``decode``; chat templates are shared."""

    eos_token_ids: set[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_text(self, tok: int) -> str:
        """One token as logprobs show it (special tokens by name)."""
        return self.decode([tok])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> str:
        """Render ``messages`` with the model's template; ValueError if there is none."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; "
                             "use /v1/completions instead")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template rejected the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise ValueError(f"chat template failed to render: {exc}") from exc


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids; BOS/EOS above them. No BOS is added: the example model is
    trained on raw concatenated text, so a prompt is continued as plain bytes."""

    def __init__(self, bos_id: int = 256, eos_id: int = 257) -> None:
        self.bos_id, self.eos_id = bos_id, eos_id
        self.eos_token_ids = {eos_id}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class IdsOnlyTokenizer(Tokenizer):
    """For a directory without tokenizer files: prompts must be token ids, text is empty."""

    def __init__(self) -> None:
        self.eos_token_ids = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise ValueError("this model directory has no tokenizer.json: send the prompt as a "
                         "list of token ids")

    def decode(self, ids: list[int]) -> str:
        return ""


class HFTokenizer(Tokenizer):
    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        self.chat_template = template
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.eos_token_ids = set()
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, tok: int) -> str:
        return self._tok.decode([tok], skip_special_tokens=False)


def load_tokenizer(model_dir: str | Path, model_config: ModelConfig) -> Tokenizer:
    """tokenizer.json when present, else the byte tokenizer (for byte-vocab models), else
    token ids only."""
    path = Path(model_dir)
    if (path / "tokenizer.json").is_file():
        tok: Tokenizer = HFTokenizer(path)
    elif model_config.byte_tokenizer or model_config.vocab_size == 258:
        tok = ByteTokenizer()
    else:
        tok = IdsOnlyTokenizer()
    tok.eos_token_ids |= set(model_config.eos_token_ids)
    return tok

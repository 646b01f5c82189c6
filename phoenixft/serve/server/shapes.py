"""The OpenAI response shapes the handlers build from engine outputs: completion and chat
objects, their streamed chunks, logprobs objects and usage (a base class of the handlers:
they need its `name` and `spec.tokenizer`, nothing else)."""

from __future__ import annotations

import time
from collections.abc import Callable

from phoenixft.serve.engine.llm_engine import RequestOutput
from phoenixft.serve.engine.spec import EngineSpec


def usage(out: RequestOutput) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_completion_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}


class ResponseShapes:
    name: str
    spec: EngineSpec

    def _token_text(self, tok: int) -> str:
        return self.spec.tokenizer.token_text(tok)

    def _logprobs(self, endpoint: str, outs: list[RequestOutput], offset: int = 0):
        """OpenAI's logprobs object for these outputs' tokens (None if not asked)."""
        pairs = [(t, lp) for o in outs if o.logprobs for t, lp in zip(o.new_token_ids, o.logprobs)]
        if not pairs:
            return None
        if endpoint == "chat":
            def entry(tok: int, logprob: float) -> dict:
                text = self._token_text(tok)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in top]}
                                for t, (lp, top) in pairs]}
        tokens = [self._token_text(t) for t, _ in pairs]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in pairs],
                "top_logprobs": [{self._token_text(a): b for a, b in top} for _, (_, top) in pairs],
                "text_offset": offsets}

    def _chunker(self, endpoint: str, rid: str) -> Callable:
        now = int(time.time())
        if endpoint == "chat":
            def chunk(delta, reason, index=0, logprobs=None):
                choices = [] if delta is None else [
                    {"index": index, "delta": delta, "logprobs": logprobs,
                     "finish_reason": reason}]
                return {"id": "chatcmpl-" + rid[4:], "object": "chat.completion.chunk",
                        "created": now, "model": self.name, "choices": choices}
        else:
            def chunk(text, reason, index=0, logprobs=None):
                choices = [] if text is None else [
                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]
                return {"id": "cmpl-" + rid[4:], "object": "text_completion", "created": now,
                        "model": self.name, "choices": choices}
        return chunk

    def _choice(self, endpoint: str, index: int, outs: list[RequestOutput], echo: str) -> dict:
        text = echo + "".join(o.new_text for o in outs)
        lp = self._logprobs(endpoint, outs, len(echo))
        reason = outs[-1].finish_reason
        if endpoint == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    def _result(self, endpoint: str, rid: str, choices: list[dict],
                lasts: list[RequestOutput], n: int) -> dict:
        prompt = sum(o.num_prompt_tokens for o in lasts[::n])  # once per prompt
        completion = sum(o.num_completion_tokens for o in lasts)
        counts = {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion}
        if endpoint == "chat":
            return {"id": "chatcmpl-" + rid[4:], "object": "chat.completion",
                    "created": int(time.time()), "model": self.name, "choices": choices,
                    "usage": counts}
        return {"id": "cmpl-" + rid[4:], "object": "text_completion",
                "created": int(time.time()), "model": self.name, "choices": choices,
                "usage": counts}


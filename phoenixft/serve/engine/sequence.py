"""One request's tokens, progress and stopping state, as the scheduler sees it.

Invariant: the KV cache holds tokens ``token_ids[:num_computed_tokens]``; a step computes
the next ``num_new_tokens`` of them (the scheduler's choice: a decode's one token, a whole
prompt, or a chunk of a prompt longer than the step's token budget), and once all are
computed the sampler appends one token. Everything needed to resume a request after a crash is
in ``to_dict()`` (plain JSON types): ids, progress, sampling parameters and the resolved
seed, because sampling is a pure function of (seed, token index, logits).
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field

import torch

from .config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_new_tokens: int = 0  # what this step computes (the scheduler's; 0: the rest)
    finish_reason: str | None = None
    output_text: str = ""
    num_emitted_chars: int = 0
    emitted: list[int] = field(default_factory=list)  # num_emitted_chars after each token
    adapter: str | None = None  # the LoRA adapter it uses (adapters.py), by name
    adapter_version: int = 0  # pinned when it is admitted
    prompt_computed: int = 0  # prompt tokens computed for it by this engine (not cached)
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    keep_logits: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def new_tokens(self) -> int:
        """Tokens the step computes: what the scheduler gave it, else all not computed."""
        return self.num_new_tokens or len(self.token_ids) - self.num_computed_tokens

    @property
    def prefilling(self) -> bool:
        """More than the next token is still to be computed (a prompt, or its rest)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def to_dict(self) -> dict:
        """Plain-JSON state (no logits, no timing) from which ``from_dict`` rebuilds it."""
        return {"seq_id": self.seq_id, "token_ids": list(self.token_ids),
                "num_prompt_tokens": self.num_prompt_tokens, "params": asdict(self.params),
                "seed": self.seed, "status": self.status.value,
                "block_table": list(self.block_table),
                "num_computed_tokens": self.num_computed_tokens,
                "finish_reason": self.finish_reason, "output_text": self.output_text,
                "num_emitted_chars": self.num_emitted_chars,
                "adapter": self.adapter, "adapter_version": self.adapter_version,
                "num_preemptions": self.num_preemptions}

    @classmethod
    def from_dict(cls, d: dict) -> Sequence:
        d = dict(d)
        d["params"] = SamplingParams(**d["params"])
        d["status"] = SequenceStatus(d["status"])
        return cls(**d)

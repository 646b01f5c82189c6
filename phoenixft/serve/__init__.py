"""Paged-KV inference engine with an OpenAI-compatible server (``phoenixft serve``).

Public API: ``LLM`` (offline generation) and ``SamplingParams``; ``EngineConfig`` sets the
engine's limits.
"""

from .config import EngineConfig, SamplingParams
from .llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams"]

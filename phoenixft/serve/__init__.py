"""Paged-KV inference engine with an OpenAI-compatible server (``phoenixft serve``).

Public API: ``LLM`` (offline generation) and ``SamplingParams``; ``EngineConfig`` sets the
engine's limits. Names are imported lazily: the recovery log's executor process imports
modules of this package without paying for torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "phoenixft.serve.engine.llm", "EngineConfig": "phoenixft.serve.engine.config",
            "SamplingParams": "phoenixft.serve.engine.config"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'phoenixft.serve' has no attribute {name!r}")

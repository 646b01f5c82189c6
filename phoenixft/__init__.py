"""phoenixft: keep LLM training and serving running through failures.

Names are imported lazily so that `phoenixft.serve` does not pull in the training side.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_EXPORTS = {
    "Session": "phoenixft.train.session",
    "Step": "phoenixft.train.step",
    "Pipeline": "phoenixft.train.pipeline_schedule",
    "JobAborted": "phoenixft.train.lifecycle",
    "SessionConfig": "phoenixft.train.config",
    "state_digest": "phoenixft.train.digest",
    "ResumableLoader": "phoenixft.train.loader",
    "IdBatches": "phoenixft.train.loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'phoenixft' has no attribute {name!r}")

"""The one seam between the engine and whatever records its progress (the recovery log,
`phoenixft.serve.recovery.recorder.Recorder`): the engine calls it, never the other way.

Why a seam: the engine must stay a thing a reader can understand alone (and that
`LLM` runs with no log at all), while serving needs every step to reach a log that
outlives the engine. The engine only knows the three calls below; what is logged, where,
and by which process is the recorder's business.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .adapters import Adapter


class StepRecorder(Protocol):
    """What `LLMEngine` calls, all from the thread that steps it.

    The engine guarantees:
    - `end_step()` after every `step()`, also one that scheduled nothing, once the step's
      tokens are appended, its KV written and its finished requests released, and before
      the next step is scheduled. Between two calls the engine's state (its requests,
      queues, block tables, the block manager's dirty slots and quarantine) changes only
      by `add_sequence`, `abort`, `load_adapter` and `step`, all on that thread, so the
      recorder may read it there without locks;
    - a new adapter version is passed to `adapter_payload` before it is installed, and
      what that returned to `log_adapter` right after, before any step can use it: a
      request is never recorded using a version the log has not been given;
    - the engine does not interpret the payload.

    The recorder guarantees:
    - `end_step` is cheap and never blocks the decode loop on I/O, and a failing log
      does not raise from it: recording stops, the failure is reported by the recorder's
      own means, and serving goes on (recovery is then off, never silently wrong);
    - `adapter_payload` raises ValueError (a message naming why) when the version could
      not be recorded, and changes nothing then, so a refused load leaves the engine as
      it was;
    - it frees quarantined blocks (the block manager's `release`) no later than the
      log has them, and all of them once it stops recording.
    """

    @abstractmethod
    def end_step(self) -> None:
        """The step just taken is complete: record what it changed."""

    @abstractmethod
    def adapter_payload(self, adapter: Adapter) -> bytes:
        """The record of a new adapter version, or ValueError when it cannot be kept."""

    @abstractmethod
    def log_adapter(self, payload: bytes) -> None:
        """The version `payload` describes is installed: record it before any step uses it."""

"""Continuous batching: which sequences run in the next step.

A step is either a prefill batch (waiting sequences admitted while blocks, the sequence
limit and the token budget allow) or a decode batch (one token for every running
sequence). Prefills go first, so new requests join the running batch at the next step
instead of waiting for the batch to drain.

Preemption is by *recompute*: when a decode step needs a block and none is free, the most
recently admitted running sequence gives up all its blocks and returns to the front of the
waiting queue; when it is admitted again its prompt plus the tokens generated so far are
prefilled again (prefix-cache hits make that cheaper when its blocks were not reused).
Recompute was chosen over swapping to host memory because on CPU the "device" already is
host memory, and because a preempted sequence then needs no state beyond its token ids,
which is also what the crash-recovery log stores.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("Scheduler needs a resolved EngineConfig (call .resolve(model))")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Return (sequences to run, is_prefill). Empty when there is nothing to do."""
        cfg, bm = self.config, self.block_manager
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) + len(batch) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            if batch and num_tokens + len(seq) > cfg.max_num_batched_tokens:
                break
            bm.allocate(seq)
            num_tokens += len(seq) - seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            batch.append(seq)
        if batch:
            self.running.extend(batch)
            return batch, True
        while self.running:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.append(seq)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch, False

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks (it may be waiting or running)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def state_dict(self) -> dict:
        """Queues in order, each sequence as plain JSON (see ``Sequence.to_dict``)."""
        return {"waiting": [s.to_dict() for s in self.waiting],
                "running": [s.to_dict() for s in self.running],
                "num_preemptions": self.num_preemptions}

    def load_state_dict(self, state: dict) -> list[Sequence]:
        self.waiting = deque(Sequence.from_dict(d) for d in state["waiting"])
        self.running = deque(Sequence.from_dict(d) for d in state["running"])
        self.num_preemptions = state["num_preemptions"]
        return [*self.waiting, *self.running]

"""Continuous batching: which sequences run in the next step.

Every step decodes one token for each running sequence and, in the same forward pass,
prefills the waiting sequences that blocks, the sequence limit and the prefill token
budget admit. Mixing the two means a newly arrived request neither waits for the batch
to drain nor stalls the running sequences for a prefill-only step (on CPU a small
prefill costs about what a decode step costs, so separate steps would halve decode
throughput under steady arrivals).

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

    def schedule(self) -> list[Sequence]:
        """Sequences to run this step: the running ones first, then newly admitted ones.

        Empty when there is nothing to do. No sequence is admitted in a step that had to
        preempt (blocks are short; admitting would only preempt again).
        """
        cfg, bm = self.config, self.block_manager
        batch: list[Sequence] = []
        candidates, preempted = list(self.running), False
        candidates.reverse()  # pop() from the end = oldest first
        while candidates:
            seq = candidates.pop()
            while not bm.can_append(seq):
                preempted = True
                if candidates:
                    self._preempt(candidates.pop(0))  # the most recently admitted
                else:
                    self._preempt(seq)
                    break
            else:
                bm.append(seq)
                batch.append(seq)
        self.running = deque(batch)
        prefill_tokens = 0
        while (not preempted and self.waiting and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            if prefill_tokens and prefill_tokens + len(seq) > cfg.max_num_batched_tokens:
                break
            bm.allocate(seq)
            prefill_tokens += len(seq) - seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        return batch

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

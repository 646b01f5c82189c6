"""Continuous batching: which sequences run in the next step.

Every step decodes one token for each running sequence and, in the same forward pass,
prefills the waiting sequences that blocks, the sequence limit and the step's token
budget admit; a prompt longer than the budget left is prefilled in chunks over several
steps, between the running sequences' decodes (vLLM V1's chunked prefill), so one long
prompt does not stall every stream. Mixing the two means a newly arrived request neither waits for the batch
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
        """Sequences to run this step, each with its `num_new_tokens`: the running ones'
        decodes first, then the rest of prompts already begun, then newly admitted ones,
        within the step's token budget (`max_num_batched_tokens`).

        A prompt longer than what the budget leaves is prefilled in chunks over several
        steps while the running sequences go on decoding (a chunk's progress is the
        sequence's `num_computed_tokens`, which the recovery log records). Empty when
        there is nothing to do. No sequence is admitted in a step that had to preempt
        (blocks are short; admitting would only preempt again).
        """
        cfg, bm = self.config, self.block_manager
        decodes: list[Sequence] = []
        kept: list[Sequence] = []
        candidates, preempted = list(self.running), False
        candidates.reverse()  # pop() from the end = oldest first
        while candidates:
            seq = candidates.pop()
            if seq.prefilling:  # a prompt begun: its blocks were allocated on admission
                kept.append(seq)
                continue
            while not bm.can_append(seq):
                preempted = True
                if candidates:
                    self._preempt(candidates.pop(0))  # the most recently admitted
                else:
                    self._preempt(seq)
                    break
            else:
                bm.append(seq)
                seq.num_new_tokens = 1
                decodes.append(seq)
                kept.append(seq)
        self.running = deque(kept)
        budget = cfg.max_num_batched_tokens - len(decodes)
        chunks: list[Sequence] = []
        for seq in kept:  # prompts begun in earlier steps, oldest first
            if seq.prefilling and budget > 0:
                budget -= self._chunk(seq, budget)
                chunks.append(seq)
        while (not preempted and budget > 0 and self.waiting
               and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            budget -= self._chunk(seq, budget)
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(seq)
        return decodes + chunks

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """Give `seq` the step's next min(rest of it, budget) tokens; returns how many."""
        seq.num_new_tokens = min(len(seq) - seq.num_computed_tokens, budget)
        return seq.num_new_tokens

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

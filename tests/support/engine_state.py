"""Test helper: an engine's whole state as one dict (live KV tensors, the block manager's
tables, the scheduler's queues with each request as `Sequence.to_dict`), and back.

The engine once exposed this as its crash-recovery seam (`state_dict`/`load_state_dict`);
the recovery log now records regions instead (`phoenixft.serve.recovery.regions`, a
rebuilt engine takes them over with `LLMEngine.install`), and only the tests still check
that an engine restored from such a snapshot continues token for token.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from phoenixft.serve.engine.block_manager import BlockManager
from phoenixft.serve.engine.llm_engine import LLMEngine
from phoenixft.serve.engine.scheduler import Scheduler
from phoenixft.serve.engine.sequence import Sequence


def block_manager_state(bm: BlockManager) -> dict:
    return {"num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "ref_counts": list(bm.ref_counts), "hashes": list(bm.hashes),
            "block_tokens": [None if t is None else list(t) for t in bm.block_tokens],
            "free": list(bm.free)}


def load_block_manager_state(bm: BlockManager, state: dict) -> None:
    if (state["num_blocks"], state["block_size"]) != (bm.num_blocks, bm.block_size):
        raise ValueError("block manager state has a different geometry: "
                         f"{state['num_blocks']}x{state['block_size']} vs "
                         f"{bm.num_blocks}x{bm.block_size}")
    bm.ref_counts = list(state["ref_counts"])
    bm.hashes = list(state["hashes"])
    bm.block_tokens = [None if t is None else tuple(t) for t in state["block_tokens"]]
    bm.free = OrderedDict((b, None) for b in state["free"])
    bm.hash_to_block = {}
    for b, h in enumerate(bm.hashes):
        if h is not None:
            bm.hash_to_block.setdefault(h, b)
    bm.dirty = {}
    bm.quarantine = {}


def scheduler_state(sch: Scheduler) -> dict:
    """Queues in order, each sequence as plain JSON (see ``Sequence.to_dict``)."""
    return {"waiting": [s.to_dict() for s in sch.waiting],
            "running": [s.to_dict() for s in sch.running],
            "num_preemptions": sch.num_preemptions}


def load_scheduler_state(sch: Scheduler, state: dict) -> list[Sequence]:
    sch.waiting = deque(Sequence.from_dict(d) for d in state["waiting"])
    sch.running = deque(Sequence.from_dict(d) for d in state["running"])
    sch.num_preemptions = state["num_preemptions"]
    return [*sch.waiting, *sch.running]


def engine_state(engine: LLMEngine) -> dict:
    """KV tensors (live, not copies), block tables and queues (plain JSON)."""
    return {"k_cache": engine.runner.k_cache, "v_cache": engine.runner.v_cache,
            "block_manager": block_manager_state(engine.block_manager),
            "scheduler": scheduler_state(engine.scheduler),
            "num_generated_tokens": engine.num_generated_tokens}


def load_engine_state(engine: LLMEngine, state: dict) -> None:
    with torch.no_grad():
        engine.runner.k_cache.copy_(state["k_cache"])
        engine.runner.v_cache.copy_(state["v_cache"])
    load_block_manager_state(engine.block_manager, state["block_manager"])
    engine.seqs = {s.seq_id: s for s in load_scheduler_state(engine.scheduler,
                                                             state["scheduler"])}
    engine.num_generated_tokens = state["num_generated_tokens"]

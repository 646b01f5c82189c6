"""The worker's side of fault injection (`faults/inject.py` decides what fires where):
claiming a spec once across the job, recording the fault before it lands, letting the
previous step commit before a microbatch fault, and damaging this node's shared memory
for `corrupt` and `shm`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from phoenixft.checkpoint.slots import HEADER_BYTES, SlotKind, slot_path
from phoenixft.cluster.keys import Keys
from phoenixft.faults.inject import FaultKind, WorkerHooks
from phoenixft.observe.events import EventLog


def member_hooks(*, store: dist.Store, wid: str, shm_dir: str | Path, events: EventLog,
                 agent_pid: int | None, where: Callable[[], dict],
                 before_fault: Callable[[], None], settle: Callable[[], None],
                 slow: Callable | None = None, wrong: Callable | None = None) -> WorkerHooks:
    """The injector's hooks for one worker. `where()` names its place now (rank, gen,
    world_size); `before_fault` runs before a fault lands (whatever must reach the store
    while the worker still lives); `settle` waits until the previous step committed."""

    def claim(spec: str) -> bool:
        return store.add(Keys.inject(spec), 1) == 1

    def on_fire(spec, t: float, point: dict) -> None:
        before_fault()
        if spec.kind not in (FaultKind.SLOW, FaultKind.FLIP, FaultKind.FREEZE,
                             FaultKind.WRONG):  # (these carry on: not failing)
            store.set(Keys.failing(wid), repr(t))
        # point may name the gen itself
        events.emit("inject", spec=str(spec), **{**where(), "pid": os.getpid(), **point})

    def damage(kind: str) -> None:
        """Corrupt this rank's own snapshot slots, or delete the node's shared memory."""
        if kind == "shm":
            shutil.rmtree(shm_dir, ignore_errors=True)
            return
        for step in (0, 1):  # both slots
            p = slot_path(shm_dir, SlotKind.SNAP, where()["rank"], step)
            if p.exists() and p.stat().st_size > HEADER_BYTES:
                with p.open("r+b") as f:
                    f.seek(HEADER_BYTES + 7)
                    b = f.read(1)
                    f.seek(HEADER_BYTES + 7)
                    f.write(bytes([b[0] ^ 0xFF]))

    return WorkerHooks(claim=claim, on_fire=on_fire, settle=settle, damage=damage, slow=slow,
                       wrong=wrong, agent_pid=agent_pid)

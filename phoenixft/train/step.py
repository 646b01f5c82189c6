"""One optimizer step as the user's loop sees it: microbatch ids to compute, and a
`backward` that records each one (for the audit, the quota bookkeeping and in-step
recovery)."""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch


class StepPhase(enum.Enum):
    """Where a step stands. A recovery may keep a step's finished microbatches only while
    no optimizer update has started (COMPUTE or REDUCE)."""

    COMPUTE = "compute"  # the user's forward/backward passes
    REDUCE = "reduce"  # in the gradient all-reduce
    UPDATE = "update"  # optimizer step and parameter all-gather


class Ahead(NamedTuple):
    """Where a spare's step computed ahead of joining starts: the restore step it loaded
    and the generation that wrote that snapshot (it is kept only if the recovery
    restores the same one)."""

    step: int
    generation: int


class MicrobatchExecutor(ABC):
    """Who runs a step's microbatches. `UserLoop`: the user's own loop on each rank runs
    each of its microbatches' forward and backward (`Step.microbatches()` yields the ids,
    `Step.backward(loss)` records each). A pipeline schedule would run the step's
    microbatches across stages itself (its collectives send/recv), fed by `Step.run_schedule`,
    and report the loss from the last stage (`PipelineSchedule`, pipeline_schedule.py)."""

    user_loop: bool  # whether the user's loop body runs once per microbatch on this rank

    @abstractmethod
    def microbatches(self, step: Step) -> Iterator[int]:
        """The ids this rank still computes in `step`, in order."""

    def blocked_s(self) -> float:
        """Seconds this rank waited on other ranks in its microbatches since the last call
        (a pipeline stage on its neighbours: not its own compute, which stragglers time)."""
        return 0.0

    def run(self, step: Step, batch: Callable[[int], tuple]) -> list[torch.Tensor]:
        """Run the microbatches this rank still computes in `step` (each one's data is
        `batch(j)`), adding them to `step.done`; returns their losses where they are
        computed (a pipeline's last stage)."""
        raise RuntimeError("step.run_schedule(batch) runs a pipelined job's step; this job "
                           "has no pipeline (setup(pipeline=...)): iterate "
                           "step.microbatches() and call step.backward(loss) for each")


class UserLoop(MicrobatchExecutor):
    user_loop = True

    def microbatches(self, step: Step) -> Iterator[int]:
        # a check step's recomputations first, on a first attempt (`recompute.py`)
        checks = [] if step.retry else step.check_ids
        if any(j is not None for j in checks):
            step.check_phase(True)
        for i, j in enumerate(checks):
            if j is None:
                continue  # (that peer computes no microbatch in this step)
            step.current, step.checking, step.check_index = j, True, i
            step.check_t0 = time.perf_counter()
            yield j
            step.checking = False
        step.check_phase(False)  # (whatever came before: a retried step's passes reduce)
        for j in list(step.ids):
            if j not in step.done:
                step.current = j
                yield j


class Step:
    """One optimizer step of M microbatches. Iterate `microbatches()` and call
    `backward(loss)` once per microbatch, with the mean loss of that microbatch.

    After an in-step recovery the same step is yielded again (`retry` is True) with only
    the microbatches this rank still has to compute; gradients of the ones it finished
    are kept."""

    def __init__(self, index: int, ids: list[int], m: int,
                 on_backward: Callable[[Step], None] | None = None,
                 on_clip: Callable[[Step, float, float], torch.Tensor] | None = None,
                 executor: MicrobatchExecutor | None = None,
                 on_check: Callable[[Step], None] | None = None,
                 on_check_phase: Callable[[bool], None] | None = None,
                 on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.index = index
        self.ids = ids
        self.m = m  # microbatches in this step, over all ranks
        self.loss_sum: float | torch.Tensor = 0.0  # this rank's microbatch losses, summed
        self.done: list[int] = []
        self.phase = StepPhase.COMPUTE
        self.retry = False
        self.loss: float | None = None  # the step's mean loss over all ranks, once reduced
        # set by the all-reduce: the averaged gradient, the audit, and whether it ran
        self.grads: torch.Tensor | None = None
        self.audit: list[float] = []
        self.reduced = False
        self.failure: BaseException | None = None  # a collective failed inside the loop body
        # set when a spare computes this step ahead of joining, from local snapshots
        # (Member._speculate); None otherwise
        self.speculative: Ahead | None = None
        self._on_backward = on_backward
        self._on_clip = on_clip
        self.current: int | None = None  # the id the loop body computes now
        # a check step (`recompute.py`): the peers' microbatch ids this rank recomputes
        # first, whether it computes one now, and the gradients' digests
        self.check_ids: list[int | None] = []
        self.checking = False
        self.check_t0 = 0.0  # when the check computed now was handed to the loop
        self.check_index = 0  # its place in check_ids
        self.check_digests: list[int] = []
        self.own_digest = -1
        self._on_check = on_check
        self._on_check_phase = on_check_phase
        self._on_loss = on_loss  # (an injected `wrong` fault: the loss backward starts from)
        self._executor = executor or UserLoop()

    def microbatches(self) -> Iterator[int]:
        """The microbatch ids j (0 <= j < M) this rank computes in this step; the data of
        (step.index, j) should be a pure function of them if the world may shrink (the
        layout's `MicrobatchExecutor` decides which: the user's loop runs each). With
        `--recompute-every K`, every K-th step first yields up to two peers' ids to
        recompute (`recompute.py`): call `backward` for each id before asking for the next."""
        return self._executor.microbatches(self)

    def check_phase(self, on: bool) -> None:
        """The recomputed passes begin (on) or the rank's own ones do (`recompute.py`)."""
        if self._on_check_phase is not None:
            self._on_check_phase(on)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self._on_loss is None else self._on_loss(loss)).backward()
        if self.checking:  # a peer's microbatch, recomputed: digested and dropped
            self.checking = False
            if self._on_check is not None:
                self._on_check(self)
            return
        # summed where the loss lives, in float64 (what float() then + did, bit for bit),
        # and read once per step by the all-reduce: float() here synced the device
        # after every microbatch
        self.loss_sum = self.loss_sum + loss.detach().double()
        j = self.current
        if j is None or j in self.done:
            j = next(k for k in self.ids if k not in self.done)
        self.done.append(j)
        if self._on_backward is not None:
            self._on_backward(self)

    def run_schedule(self, batch: Callable[[int], tuple]) -> None:
        """A pipelined job's loop body (`setup(pipeline=...)`): run the step's microbatches
        through the pipeline schedule. `batch(j)` returns microbatch j's (inputs, targets)
        for this step (a pure function of the step's index and j, as with
        `microbatches()`); the first stage uses the inputs, the last the targets. The loss
        of each microbatch comes from the last stage; the step's mean loss is `loss` once
        the step is reduced. After an in-step recovery the step comes back (`retry`) and
        this runs what is left of it."""
        before = len(self.done)
        losses = self._executor.run(self, batch)
        finished, self.done = self.done[before:], self.done[:before]
        for loss in losses:
            self.loss_sum = self.loss_sum + loss.detach().double()
        for j in finished:  # recorded one by one, as backward records each
            self.done.append(j)
            if self._on_backward is not None:
                self._on_backward(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the step's gradient by its global norm, like
        `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` on a DDP model, and
        return the total norm (before clipping). Call it after the last microbatch's
        `backward`: it runs the step's gradient all-reduce then, so the norm is that of the
        gradient averaged over every rank's microbatches (the same on every rank). If a
        failure interrupts that all-reduce it returns nan, and the step is run again after
        recovery (its loop body too)."""
        if self._on_clip is None:
            raise RuntimeError("clip_grad_norm_ needs a step made by Session.steps()")
        return self._on_clip(self, float(max_norm), float(norm_type))

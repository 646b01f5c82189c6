"""`PipelineSchedule`: the `MicrobatchExecutor` of a pipelined job (`pipeline_layout.py`).
A step's microbatches are not the user loop's: `Step.run_schedule(batch)` hands them to a
`torch.distributed.pipelining` schedule (GPipe or 1F1B), which runs them across the
replica's stages, its forward and backward collectives send/recv on the replica's "pp"
group (a `SwapGroup`: a failed or late send/recv is latched, never raised in the
schedule), and the loss of each microbatch comes from the last stage.

Per generation. The `PipelineStage` and its schedules are torch's bookkeeping around this
rank's stage module (its buffers for the microbatches in flight, a warm-up exchange with
its neighbours on the first step): they are built afresh for each generation, on every
rank, so a spare that takes a stage meets neighbours as fresh as itself. The stage module,
its parameters and the optimizer are kept for the worker's life.

Shapes. torch's stage infers what it receives at the first step by exchanging pickled
metadata with its neighbours; a pickle from a peer is never read here, so the shapes are
given to it (its static mode): stage 0 runs its module once over the first
microbatch's inputs (no gradients, the RNG state put back), sends its output's dtype and
shape (a small int64 tensor) to stage 1, which does the same, and so on to the last stage.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from phoenixft.train.step import MicrobatchExecutor, Step

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # microbatch id -> (inputs, targets)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> loss
Split = Callable[[nn.Module, object], list[nn.Module]]  # (model, pp mesh) -> this rank's stages


class ScheduleKind(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"

    __format__ = str.__format__

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """What `Session.setup(pipeline=...)` needs to run a pipelined job.

    - `pp`: stages per pipeline replica (ranks per replica, times dp_shard).
    - `split(model, pp_mesh)`: this rank's stage module, from the whole model (torchtitan's
      splitter; a list of one module). Its parameters' names must be the model's own (a
      checkpoint is then the model's at any depth: `phoenixft.models.LlamaStage` keeps them).
    - `schedule`: "gpipe" or "1f1b".
    - `loss_fn(outputs, targets)`: a microbatch's mean loss, on the last stage.
    """

    pp: int
    split: Split
    loss_fn: LossFn
    schedule: ScheduleKind | str = ScheduleKind.ONE_F_ONE_B

    def __post_init__(self) -> None:
        if self.pp < 2:
            raise ValueError(f"Pipeline(pp={self.pp}): a pipeline has 2 stages at least "
                             "(one stage: set up without pipeline=)")
        try:
            object.__setattr__(self, "schedule", ScheduleKind(self.schedule))
        except ValueError:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}): one of "
                             f"{', '.join(map(str, ScheduleKind))} (interleaved schedules run "
                             "under plain torchrun only, not yet under phoenixft)") from None


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32]
_META_LEN = 16  # dtype, ndim, then the dims


def _encode(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _META_LEN - 2 or t.dtype not in _DTYPES:
        raise ValueError(f"a stage output of dtype {t.dtype} and {t.dim()} dimensions cannot "
                         "be passed between stages here")
    out = torch.zeros(_META_LEN, dtype=torch.int64)
    out[0], out[1] = _DTYPES.index(t.dtype), t.dim()
    out[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return out


def _decode(meta: torch.Tensor) -> torch.Tensor:
    dtype, ndim = _DTYPES[int(meta[0])], int(meta[1])
    return torch.empty(meta[2:2 + ndim].tolist(), dtype=dtype, device="meta")


def _probe_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's output shape and dtype on a microbatch like `x` (a meta tensor): one
    forward pass without gradients, the RNG state put back after it (an FSDP2 stage
    all-gathers in it, as every rank of its dp_shard group does at the same point)."""
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        out = module(x)
    return torch.empty(out.shape, dtype=out.dtype, device="meta")


def _example(meta: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    t = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    return t.requires_grad_(grad and t.is_floating_point())


class PipelineSchedule(MicrobatchExecutor):
    """Runs a step's microbatches through this rank's stage (see the module doc). The
    layout calls `rebuild` once a generation's "pp" group is bound; `run` does a step."""

    user_loop = False

    def __init__(self, spec: Pipeline, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.module: nn.Module | None = None
        self.stage_index = -1
        self.group: dist.ProcessGroup | None = None
        self._stage = None
        self._schedule_n: tuple[int, object] | None = None  # (n, the schedule for n)
        self._waits: list = []  # groups whose waits are not this rank's compute

    @property
    def first(self) -> bool:
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        return self.stage_index == self.spec.pp - 1

    def microbatches(self, step: Step) -> Iterator[int]:
        raise RuntimeError("a pipelined job's step runs its microbatches through the pipeline "
                           "schedule: call step.run_schedule(batch) (batch(j) -> (inputs, "
                           "targets) of microbatch j), not step.microbatches()")

    def blocked_s(self) -> float:
        waited = sum(g.blocked_s for g in self._waits)
        for g in self._waits:
            g.blocked_s = 0.0
        return waited

    def rebuild(self, module: nn.Module, stage_index: int, group: dist.ProcessGroup,
                waits: list | None = None) -> None:
        """A new generation: torch's stage and schedule are made again at the next step.
        `waits`: the `SwapGroup`s whose waits `blocked_s` counts (default: `group`)."""
        self.module, self.stage_index, self.group = module, stage_index, group
        self._waits = waits if waits is not None else [group]
        self._stage, self._schedule_n = None, None

    def _build_stage(self, x: torch.Tensor):
        """torch's `PipelineStage` for this generation, its shapes passed down the pipeline
        (the module doc), for microbatches of the shape of `x` (stage 0's input)."""
        from torch.distributed.pipelining import PipelineStage

        g, s = self.group, self.stage_index
        peer = [dist.get_global_rank(g, s - 1) if s > 0 else -1,
                dist.get_global_rank(g, s + 1) if not self.last else -1]
        if self.first:
            inp = torch.empty(x.shape, dtype=x.dtype, device="meta")
        else:  # (on the device: NCCL sends device memory only)
            meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
            dist.recv(meta, src=peer[0], group=g)
            inp = _decode(meta.cpu())
        probe = x if self.first else torch.zeros(inp.shape, dtype=inp.dtype, device=self.device)
        out = _probe_forward(self.module, probe)
        if not self.last:
            dist.send(_encode(out).to(self.device), dst=peer[1], group=g)
        # what autograd connects: a stage's floating-point output needs the next stage's
        # gradient, and its floating-point input (activations) sends one back
        trains = any(p.requires_grad for p in self.module.parameters())
        return PipelineStage(self.module, s, self.spec.pp, self.device,
                             input_args=_example(inp, self.device, not self.first),
                             output_args=_example(out, self.device, trains), group=g)

    def _schedule(self, n: int):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if self._schedule_n is None or self._schedule_n[0] != n:
            # one at a time: a schedule's set-up rewrites the stage's buffers for its n
            cls = {ScheduleKind.GPIPE: ScheduleGPipe,
                   ScheduleKind.ONE_F_ONE_B: Schedule1F1B}[self.spec.schedule]
            if n < self.spec.pp:
                # 1F1B needs a microbatch per stage at least; a replica given fewer (a
                # shrunk job's uneven share) runs them as GPipe, which computes the same
                cls = ScheduleGPipe
            # the gradient is summed over the microbatches: the layout divides it by the
            # step's M once every replica's sum is in (scale_grads=False)
            self._schedule_n = (n, cls(self._stage, n, loss_fn=self.spec.loss_fn,
                                       scale_grads=False))
        return self._schedule_n[1]

    def run(self, step: Step, batch: Batch) -> list[torch.Tensor]:
        """Run the microbatches of `step` this replica still computes; returns their losses
        on the last stage (empty elsewhere)."""
        ids = [j for j in step.ids if j not in step.done]
        if not ids:
            return []
        step.current = ids[0]
        pairs = [batch(j) for j in ids] if (self.first or self.last) else []
        x = torch.cat([p[0] for p in pairs]).to(self.device) if self.first else None
        losses: list[torch.Tensor] = []
        # torch 2.13: an FSDP2 stage's gradients from an earlier schedule step are lost by
        # the next one (measured: the second step's replace them), so the gradients a
        # recovery kept are set aside and added back (kept + new, as the replicas' sum
        # would add them)
        held = {p: p.grad for p in self.module.parameters() if p.grad is not None}
        for p in held:
            p.grad = None
        try:
            if self._stage is None:
                self._stage = self._build_stage(pairs[0][0].to(self.device) if self.first
                                                else None)
            schedule = self._schedule(len(ids))
            if self.first:
                schedule.step(x)
            elif self.last:
                y = torch.cat([p[1] for p in pairs]).to(self.device)
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
        except Exception:  # noqa: BLE001 - a failed generation's garbage, or a bug
            failed = getattr(self.group, "failure", None)
            if failed is None:
                raise
            # the pp group failed (latched): what the schedule did after it is garbage and
            # may trip torch's checks; the session recovers when the loop body returns
            step.failure = failed
            self._stage, self._schedule_n = None, None
            return []
        finally:
            for p, g in held.items():
                p.grad = g if p.grad is None else g.add_(p.grad)
        step.done.extend(ids)
        return losses

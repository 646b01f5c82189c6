"""`FlatZero1`: the data-parallel layout, ZeRO-1 over one flat parameter buffer
(`zero.py` has the mechanics).

Every rank holds all parameters, identical on every rank, as views of one flat buffer
padded to a multiple of the world size: they are never snapshotted (any survivor serves
them). Rank r alone holds the master copy and the optimizer state of its contiguous
shard `[r*S, (r+1)*S)`: that is its unique state. The gradient region of the step's
all-reduce is the whole flat gradient; after the optimizer step on the shard an
all-gather of the shards rebuilds the parameters. Resharding concatenates the old shards
(their padding cut off) and cuts the new ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from phoenixft.checkpoint.record import Snapshot
from phoenixft.comm.collectives import GroupOps
from phoenixft.train.layout import Holdings, Membership, StepMath, VoteScope
from phoenixft.train.zero import FlatParams, SchedulerFactory, ShardedOptimizer

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class FlatZero1(Membership, Holdings, StepMath, VoteScope):
    """Plays every role but `WorkSplit` (data parallelism's default) for a data-parallel
    job; votes over the reduced gradients and the parameters, which every rank holds."""

    def __init__(self, model: nn.Module, factory: OptimizerFactory,
                 scheduler: SchedulerFactory | None = None) -> None:
        self.flat = FlatParams(model)
        self.factory = factory
        self.scheduler_factory = scheduler
        self.device, self.master_dtype = self.flat.device, self.flat.master_dtype
        self.opt: ShardedOptimizer | None = None
        self._hooks: list[Callable[[], None]] = []

    # -- identity ----------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.flat.numel

    @property
    def world_size(self) -> int:
        return self.opt.world_size if self.opt is not None else 0

    # -- a generation ------------------------------------------------------------------
    def join(self, rank: int, world_size: int) -> bool:
        self.flat.layout(world_size)
        if self.opt is not None and self.opt.rank == rank and self.opt.world_size == world_size:
            return False
        self.opt = ShardedOptimizer(self.flat, self.factory, rank, self.scheduler_factory)
        for hook in self._hooks:
            self.opt.inner.register_step_pre_hook(lambda *_, h=hook: h())
        return True

    def on_optimizer_step(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)
        if self.opt is not None:
            self.opt.inner.register_step_pre_hook(lambda *_: hook())

    def relocate(self) -> None:
        self.flat.relocate()

    # -- the step ----------------------------------------------------------------------
    def grad_numel(self) -> int:
        return self.flat.buf.numel()

    def write_grads(self, out: torch.Tensor) -> None:
        self.flat.gather_grads(out)
        out[self.flat.numel:].zero_()  # the padding

    def clip(self, grads: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
        """The norm of the all-reduced gradient (every rank holds it whole: no collective),
        per parameter as torch's; its clip coefficient applied to the flat region at once."""
        views = list(self.flat.unflatten(grads[:self.flat.numel]).values())
        norm = torch.nn.utils.get_total_norm(views, norm_type)
        grads.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def update(self, grads: torch.Tensor, ops: GroupOps, what: str,
               before_gather: Callable[[Callable[[], None]], None] | None = None) -> None:
        self.opt.step(grads)  # its pre-hooks wait for the previous snapshot's copy
        if before_gather is None:
            ops.all_gather_into(self.flat.buf, self.opt.gathered(), what)
            return
        gathered = ops.all_gather_start(self.flat.buf, self.opt.gathered(), what)
        before_gather(gathered)
        gathered()

    def fingerprinted(self, grads: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        return {"reduced gradients": [grads], "parameters": [self.flat.buf]}

    def can_undo(self) -> bool:
        return True

    def start_from_rank0(self, ops: GroupOps) -> None:
        ops.broadcast(self.flat.buf, 0, "initial parameter broadcast")
        self.opt.reload_shard_from_params()

    def params_changed(self) -> None:
        if self.opt is not None:
            self.opt.reload_shard_from_params()

    # -- snapshots, restores, resharding -----------------------------------------------
    def unique_tensors(self) -> dict[str, torch.Tensor]:
        return self.opt.state_tensors()

    def unique_meta(self) -> dict:
        return self.opt.state_meta()

    def load_unique(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.opt.load_state(tensors, meta)

    def load_params(self, shards: list[dict[str, torch.Tensor]]) -> None:
        shard = self.flat.shard_size(len(shards))
        with torch.no_grad():
            for q, tensors in enumerate(shards):
                self.flat.buf[q * shard:(q + 1) * shard].copy_(
                    tensors["param_shard"].to(self.flat.dtype))

    def gather_params(self, ops: GroupOps, what: str) -> None:
        ops.all_gather_into(self.flat.buf, self.opt.gathered(), what)

    def reshard(self, old: list[Snapshot]) -> None:
        n, padded = self.flat.numel, self.flat.buf.numel()

        def fit(x: torch.Tensor) -> torch.Tensor:  # old padding -> new padding
            out = torch.zeros(padded, dtype=x.dtype)
            out[:n] = x[:n]
            return out

        full = {}
        for name, t0 in old[0].tensors.items():
            if name != "param_shard" and not name.startswith("opt."):
                continue  # rank-local state (RNG, tracked objects) does not reshard
            full[name] = t0 if t0.dim() == 0 else torch.cat([s.tensors[name] for s in old])
        start, end = self.opt.start, self.opt.end
        self.opt.load_state({k: x if x.dim() == 0 else fit(x)[start:end]
                             for k, x in full.items()}, old[0].header.opt)
        with torch.no_grad():
            self.flat.buf.copy_(fit(full["param_shard"]).to(self.flat.buf.device))

    def full_state(self, ops: GroupOps) -> dict[str, torch.Tensor]:
        flat, world = self.flat, self.opt.world_size
        out = {f"model.{k}": v for k, v in flat.unflatten(flat.buf).items()}
        for name, t in self.opt.state_tensors().items():
            if not name.startswith("opt."):
                continue
            if t.dim() == 0:
                out[f"optim.{name[4:]}"] = t
                continue
            full = torch.empty(t.numel() * world, dtype=t.dtype, device=t.device)
            ops.all_gather_into(full, t, "state gather")
            for k, v in flat.unflatten(full).items():
                out[f"optim.{name[4:]}.{k}"] = v
        return out

    def export_meta(self) -> dict:
        params = [[name, list(p.shape), off] for (off, _), (name, p) in
                  zip(self.flat.offsets, self.flat.named)]
        return {"params": params, "numel": self.flat.numel,
                "dtype": str(self.flat.dtype).removeprefix("torch.")}

    def trained_names(self) -> set[str]:
        return {name for name, _ in self.flat.named}

    # -- the user's optimizer ----------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt.inner

    @property
    def scheduler(self):
        return self.opt.sched

"""ZeRO-1: parameters as views of one flat buffer, optimizer state sharded over ranks.

Every rank holds all parameters (identical, so never snapshotted whole: any survivor
serves them), but only rank r keeps the optimizer state and the master copy of its
contiguous shard ``[r*S, (r+1)*S)`` of the flat parameter vector. That shard is exactly
the state that would be lost with the rank, so it is what the snapshot and its replica
protect. After the step, an all-gather of the shards rebuilds the full parameters.

Mixed precision: when the model's parameters are bf16 or fp16, the master shard, the
optimizer state and the gradient all-reduce are fp32 (`master_dtype`); the shard is
rounded to the model's dtype only for the all-gather. With fp32 parameters (and bf16
autocast in the forward pass) everything is fp32.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from torch import nn


class FlatParams:
    """The model's trainable parameters re-pointed at views of one flat buffer."""

    def __init__(self, model: nn.Module) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in self.named}
        devices = {p.device for _, p in self.named}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"phoenixft shards one flat buffer: all trainable parameters must "
                             f"share a dtype and device, got {dtypes} on {devices}")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self.numel = sum(p.numel() for _, p in self.named)
        self.offsets: list[tuple[int, int]] = []
        off = 0
        for _, p in self.named:
            self.offsets.append((off, p.numel()))
            off += p.numel()
        self.buf = torch.empty(0)
        self.world_size = 0

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of master weights, optimizer state and the gradient all-reduce."""
        return torch.float32 if self.dtype in (torch.bfloat16, torch.float16) else self.dtype

    def shard_size(self, world_size: int) -> int:
        return -(-self.numel // world_size)

    def layout(self, world_size: int) -> None:
        """(Re)allocate the flat buffer padded to a multiple of `world_size`."""
        if world_size == self.world_size:
            return
        size = self.shard_size(world_size) * world_size
        buf = torch.zeros(size, dtype=self.dtype, device=self.device)
        for (off, n), (_, p) in zip(self.offsets, self.named):
            buf[off:off + n].copy_(p.detach().reshape(-1))
            p.data = buf[off:off + n].view_as(p)
        self.buf, self.world_size = buf, world_size

    def relocate(self) -> None:
        """Move the parameters to a fresh flat buffer (same values), so an abandoned
        collective that still targets the old buffer cannot change them."""
        buf = self.buf.clone()
        for (off, n), (_, p) in zip(self.offsets, self.named):
            p.data = buf[off:off + n].view_as(p)
        self.buf = buf

    def shard_range(self, rank: int) -> tuple[int, int]:
        s = self.shard_size(self.world_size)
        return rank * s, (rank + 1) * s

    def gather_grads(self, out: torch.Tensor) -> None:
        """Copy every parameter's .grad into out[:numel] (zeros where there is none)."""
        for (off, n), (_, p) in zip(self.offsets, self.named):
            if p.grad is None:
                out[off:off + n].zero_()
            else:
                out[off:off + n].copy_(p.grad.reshape(-1))

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + n].view_as(p)
                for (off, n), (name, p) in zip(self.offsets, self.named)}


SchedulerFactory = Callable[[torch.optim.Optimizer], object]


# On CPU the optimizer steps the shard in cache-sized chunks: an elementwise optimizer
# (AdamW: about ten passes over each tensor per step) over one 10M-element shard streams
# every pass through memory, and took 35 ms a step here against 12 ms over chunks of 256K
# elements (2 threads). The chunk count is bounded, since every chunk costs each of those
# passes a Python-level call. On a GPU one tensor is best (one kernel per pass).
CPU_CHUNK = 1 << 18
MAX_CHUNKS = 64
# Chunks change nothing only for an optimizer whose update of each element depends on
# that element alone: torch's own elementwise ones. Any other (Adafactor, LAMB, LARS:
# per-tensor norms) steps the shard as one tensor.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "RMSprop", "ASGD", "Rprop")
    if hasattr(torch.optim, name))


def chunk_bounds(n: int, device: torch.device) -> list[tuple[int, int]]:
    """The [a, b) ranges of a shard of `n` elements the optimizer steps separately."""
    if device.type != "cpu" or n <= CPU_CHUNK:
        return [(0, n)]
    size = max(CPU_CHUNK, -(-n // MAX_CHUNKS))
    return [(a, min(a + size, n)) for a in range(0, n, size)]


class ShardedOptimizer:
    """Runs the user's torch optimizer (and LR scheduler, if any) on this rank's shard.

    The optimizer is built on views of the shard (`chunk_bounds`); its per-element state
    tensors are kept as views of one flat tensor per state key (`_flat_state`), so the
    snapshot takes each key whole and a restore loads it in one copy."""

    def __init__(self, flat: FlatParams, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 rank: int, scheduler: SchedulerFactory | None = None) -> None:
        self.flat = flat
        self.rank = rank
        self.world_size = flat.world_size
        self.start, self.end = flat.shard_range(rank)
        self.shard = nn.Parameter(flat.buf[self.start:self.end].detach().to(flat.master_dtype,
                                                                            copy=True))
        self.bounds = chunk_bounds(self.shard.numel(), self.shard.device)
        self.params = ([self.shard] if len(self.bounds) == 1 else
                       [nn.Parameter(self.shard.detach()[a:b]) for a, b in self.bounds])
        self._flat_state: dict[str, torch.Tensor] = {}
        self.inner = factory(self.params)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError("optimizer factory must return a torch.optim.Optimizer built on "
                            "the parameters it is given, e.g. lambda p: torch.optim.AdamW(p, lr=3e-4)")
        if len(self.params) > 1 and type(self.inner) not in ELEMENTWISE:
            self.bounds, self.params = [(0, self.shard.numel())], [self.shard]
            self.inner = factory(self.params)  # (built anew, on the whole shard: no state yet)
        self.sched = scheduler(self.inner) if scheduler is not None else None
        if self.sched is not None and not (hasattr(self.sched, "step") and
                                           hasattr(self.sched, "state_dict")):
            raise TypeError("scheduler factory must return an LR scheduler built on the "
                            "optimizer it is given, e.g. lambda opt: "
                            "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)")
        if self.sched is not None:
            try:
                json.dumps(self.sched.state_dict())
            except TypeError as exc:
                raise TypeError(f"the LR scheduler's state_dict() must be JSON-serialisable to "
                                f"be snapshotted without pickle ({exc})") from None

    def step(self, flat_grad: torch.Tensor) -> None:
        g = flat_grad[self.start:self.end]
        for p, (a, b) in zip(self.params, self.bounds):
            p.grad = g[a:b]
        self.inner.step()
        for p in self.params:
            p.grad = None
        if len(self.params) > 1:
            self._consolidate()
        if self.sched is not None:
            self.sched.step()

    def _consolidate(self) -> None:
        """Make every chunk's per-element state tensor a view of its key's flat tensor
        (after the first step, or after an optimizer replaced a state tensor instead of
        updating it in place); 0-dim tensors (a step count) stay per chunk, and must agree
        across chunks (the snapshot takes chunk 0's)."""
        first = self.inner.state.get(self.params[0], {})
        name = type(self.inner).__name__
        checking = not self._flat_state  # the first step (after a restore: known good)
        for p, (a, b) in zip(self.params, self.bounds):
            st = self.inner.state.get(p, {})
            if checking and st.keys() != first.keys():
                raise TypeError(f"{name}'s state keys differ between chunks of the shard "
                                f"({sorted(first)} and {sorted(st)})")
            for k, v in st.items():
                if not torch.is_tensor(v):
                    continue
                if v.dim() == 0:
                    if checking and not torch.equal(v, first[k]):
                        raise TypeError(f"{name}'s state {k!r} differs between chunks of the "
                                        "shard: it is not an elementwise optimizer")
                    continue
                if v.shape != p.shape:
                    raise TypeError(f"{name}'s state {k!r} has shape {tuple(v.shape)} for a "
                                    f"parameter of shape {tuple(p.shape)}: phoenixft shards "
                                    "optimizer state element by element")
                flat = self._flat_state.get(k)
                if flat is None:
                    flat = self._flat_state[k] = torch.empty(self.shard.numel(), dtype=v.dtype,
                                                             device=v.device)
                elif flat.dtype != v.dtype:
                    raise TypeError(f"{name}'s state {k!r} has dtype {v.dtype} in one chunk and "
                                    f"{flat.dtype} in another")
                view = flat[a:b]
                if v.data_ptr() != view.data_ptr():
                    view.copy_(v)
                    st[k] = view

    def gathered(self) -> torch.Tensor:
        """The shard as the all-gather into the model's parameters takes it."""
        return self.shard.detach().to(self.flat.dtype)

    def reload_shard_from_params(self) -> None:
        with torch.no_grad():
            self.shard.copy_(self.flat.buf[self.start:self.end])

    # -- snapshot support --------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The shard and its optimizer state, one tensor per key over the whole shard (a
        0-dim tensor, a step count, is the same in every chunk: they step together)."""
        out = {"param_shard": self.shard.detach()}
        for k, v in self.inner.state.get(self.params[0], {}).items():
            if torch.is_tensor(v):
                out[f"opt.{k}"] = self._flat_state.get(k, v) if v.dim() > 0 else v
        return out

    def state_meta(self) -> dict:
        scalars = {k: v for k, v in self.inner.state.get(self.params[0], {}).items()
                   if not torch.is_tensor(v)}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        meta = {"opt_scalars": scalars, "param_groups": groups, "shard": [self.start, self.end]}
        if self.sched is not None:
            meta["scheduler"] = self.sched.state_dict()
        return meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with torch.no_grad():
            self.shard.copy_(tensors["param_shard"])
        saved = {k[4:]: v for k, v in tensors.items() if k.startswith("opt.")}
        scalars = meta.get("opt_scalars", {})
        self.inner.state.clear()
        self._flat_state = {}
        if saved or scalars:
            chunked = len(self.params) > 1
            if chunked:
                self._flat_state = {k: v.clone() for k, v in saved.items() if v.dim() > 0}
            for p, (a, b) in zip(self.params, self.bounds):
                st = {k: self._flat_state[k][a:b] if k in self._flat_state else v.clone()
                      for k, v in saved.items()}
                st.update(scalars)
                self.inner.state[p] = st
        for g, saved_group in zip(self.inner.param_groups, meta.get("param_groups", [])):
            g.update({k: v for k, v in saved_group.items() if k in g})
        if self.sched is not None and "scheduler" in meta:
            self.sched.load_state_dict(meta["scheduler"])

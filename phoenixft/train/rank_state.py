"""What one rank holds that a snapshot protects and a recovery restores.

`RankState` is the explicit object the generation protocol works on (instead of reaching
into the user-facing `Session`): the model, its `Layout` (how parameters and
optimizer state are cut over ranks: the parallelism seam, `layout.py`), the tracked
objects, the step, and who wrote the newest snapshot. It knows how to turn itself into a
snapshot payload and how to take the per-rank part of one back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from phoenixft.checkpoint.record import Snapshot, SnapshotHeader
from phoenixft.config import Policy
from phoenixft.torch_internals import local
from phoenixft.train import quota
from phoenixft.train.layout import Layout
from phoenixft.train.tracked import Tracked


class SnapSource(NamedTuple):
    """Who wrote a rank's newest snapshot: where a recovery looks for it (-1: none)."""

    generation: int
    world_size: int


@dataclass(kw_only=True)
class RankState:
    """What one rank holds: the model, its `Layout` (the parallelism seam: which of
    its state is unique to this rank), the tracked objects (samplers, loaders), the step,
    M, and who wrote the newest snapshot. The generation protocol and recovery work on
    it, never on the user-facing `Session`."""

    model: nn.Module
    layout: Layout
    tracked: Tracked
    policy: Policy = Policy.CONSTANT
    step: int = 0  # optimizer steps completed
    m: int = 0  # microbatches per step (M), fixed at the first generation
    initial_world: int = 0
    snap_from: SnapSource = SnapSource(-1, -1)  # who wrote snapshot `step`
    grad: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # see Member._prepare

    @property
    def joined(self) -> bool:
        """Whether a generation was joined (the layout and optimizer are built)."""
        return self.layout.members.world_size > 0

    def m_for(self, world_size: int) -> int:
        """Microbatches per step at this world size (the policy's rule)."""
        return quota.effective_m(self.m, self.initial_world, world_size, self.policy)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def snapshot(self, *, rank: int, world_size: int) -> Snapshot:
        """This rank's snapshot, its header and tensors: only what this rank alone holds
        (the layout's unique state: with ZeRO-1 its shard of master weights and optimizer
        state; RNG states, tracked objects). The tensors are references: the snapshot
        thread copies them before the next optimizer step may change them."""
        tensors = self.layout.state.unique_tensors()
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and self.layout.math.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.layout.math.device)
        tensors.update(self.tracked.tensors())
        version, mt, gauss = random.getstate()
        header = SnapshotHeader(rank=rank, world_size=world_size, numel=self.layout.state.numel,
                                opt=self.layout.state.unique_meta(), tracked=self.tracked.meta(),
                                python_random=[version, list(mt), gauss])
        return Snapshot(header, tensors)

    def aliases(self) -> dict[str, str]:
        """State-dict names that share another name's tensor (tied weights) -> that name."""
        seen: dict[int, str] = {}
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            t = local(t)  # (a DTensor's own data_ptr is 0: its shard's)
            ptr = t.data_ptr()
            if not t.numel():
                continue  # (an empty shard has no storage to share)
            if ptr in seen:
                out[name] = seen[ptr]
            seen.setdefault(ptr, name)
        return out

    def export_meta(self) -> dict:
        """How to rebuild the model from persisted shards (the layout's part), names that
        alias another tensor (tied weights), and the model's Hugging Face config when it
        has one."""
        cfg = getattr(self.model, "config", None)
        config = (cfg.to_hf_dict() if hasattr(cfg, "to_hf_dict") else
                  cfg.to_dict() if hasattr(cfg, "to_dict") else None)
        return {**self.layout.state.export_meta(), "aliases": self.aliases(), "config": config}

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """Model tensors that are not trained (frozen parameters, buffers), as CPU copies:
        persisted once per generation beside the shards."""
        skip = self.layout.state.trained_names() | set(self.aliases())
        return {name: t.detach().to("cpu", copy=True).contiguous()
                for name, t in self.model.state_dict().items() if name not in skip}

    def load_rank_local(self, snap: Snapshot) -> None:
        """Take over the per-rank state of a snapshot: RNGs and tracked objects (the
        optimizer shard is loaded separately, since it also reshards)."""
        tensors = snap.tensors
        torch.set_rng_state(tensors["rng.torch"].clone())
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"].clone(), self.layout.math.device)
        self.tracked.load(tensors, snap.header.tracked)
        v, state, gauss = snap.header.python_random
        random.setstate((v, tuple(state), gauss))

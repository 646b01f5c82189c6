"""The parallelism seam: how one rank's share of the training state is laid out over the
ranks of a generation, and everything the session, the generation protocol, snapshots,
restores and resharding need to know about it.

The session owns the loop, the microbatch bookkeeping and the step's one all-reduce;
snapshots and replicas own the bytes; the restore planner owns where old copies come
from. None of them knows how parameters, gradients and optimizer state are cut over
ranks: they ask a `StateLayout`. Today's layout is `FlatZero1` (`flat_layout.py`): every
rank holds all parameters in one flat buffer and 1/world of the optimizer state and
master weights. A sharded-model layout (FSDP2 / tensor parallel) is the seam's second
implementation; both pass the one shared test body in `tests/unit/test_layout_contract.py`.

Guarantees every implementation gives, and the rules for calling it:

- `join(rank, world_size)` is called once per generation, before anything else of that
  generation, with the optimizer's pre-step hook already registered through
  `on_optimizer_step`; it may rebuild the optimizer (a new rank or world size) and says
  so. It is not collective.
- `unique_tensors()` are references to the state only this rank holds (state that other
  ranks hold identically is not in it: any survivor serves that). They stay valid until
  the next `update`; the snapshot thread copies them before it.
- A snapshot is `(unique_tensors(), unique_meta())`. `load_unique` takes back this rank's
  own snapshot of the same world size; `reshard` takes every old rank's snapshot of
  another world size. Neither is collective; after either, `gather_params(ops)`
  (collective) makes the model's parameters whole again where the layout needs it.
- `update(grads, ops)` steps the optimizer on the averaged gradient region of the step's
  all-reduce buffer (`grad_numel()` elements, filled by `write_grads`) and leaves the
  model's parameters ready for the next forward pass. It is collective.
- `full_state(ops)` (collective) is world-size free: the same bytes for the same
  training state at any world size, which is what the final digest and export compare.
- Methods that take `ops` run collectives with its deadlines; a failure raises
  `CommFailure` and leaves the layout usable for the next generation after `relocate()`.
- `bind(ops, generation, m)` is called once the generation's training group is built,
  before any collective of that generation. A layout whose own collectives run inside
  the user's forward and backward (FSDP2) latches their failures instead of raising them
  there; `failure()` returns it, and the session raises it before the step's all-reduce.
- `local_gradients`: a rank's accumulated gradients are its own until the step's
  all-reduce (true for the flat layout). Only then can a recovery keep the microbatches a
  survivor finished, or a spare compute the dead rank's ahead of joining.
- `fingerprinted(grads)` / `vote_classes(world_size)`: state the ranks of each class hold
  bit for bit before the update (data parallel: the reduced gradients and the full
  parameters, every rank one class; HSDP: the reduced gradient shards, parameter and
  optimizer shards, one class per place in the replica groups): the fingerprint vote
  digests it (`fingerprints.py`); `can_undo()`: the vote may then be awaited after the
  update. The seal covers `unique_tensors()`.
- `mesh_groups(rank, world_size)`: process groups over subsets of the generation's ranks
  the layout needs besides the training group (a tensor-parallel mesh's rows and
  columns): name -> (this rank's place in it, its size). They are built with the
  training group and handed to `bind`.
- `plan(m, world_size)` / `contributes()`: which microbatch ids each rank computes, and
  whether this rank's audit, loss and count go into the step's all-reduce (ranks of one
  tensor-parallel group compute the same microbatches: only one of them counts them).
  `reassign` hands an interrupted step's unfinished ids to the next generation's ranks.
- Failure units (HSDP's replica groups): `unit_ranks(rank, world_size)` are the ranks
  whose gradients are one thing (FSDP2 reduce-scatters inside them): they keep a step's
  finished microbatches together or not at all (`keeps_work`), and a unit leaves the job
  whole. The `mesh_groups` that lie inside a unit (`in_unit`) are not interrupted by a
  new generation that leaves the unit as it was: its collectives complete. `reduce`
  (collective, before the step's all-reduce) reduces gradients across units without
  touching the accumulated ones. `can_move()`: whether a worker can take another rank
  (False: a worker its generation leaves out exits instead of waiting as a spare).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from phoenixft.comm.collectives import CommFailure, GroupOps
from phoenixft.train import quota


class StateLayout(ABC):
    """How this rank's training state is cut over the generation's ranks (see the module
    docstring for the guarantees and calling rules)."""

    device: torch.device
    master_dtype: torch.dtype  # dtype of the gradient region and the optimizer's state
    local_gradients: bool = True  # see the module docstring

    # -- identity ----------------------------------------------------------------------
    @property
    @abstractmethod
    def numel(self) -> int:
        """Elements of trainable state: a snapshot of another model is refused by it."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The world size it is laid out for (0 before the first `join`)."""

    # -- a generation ------------------------------------------------------------------
    @abstractmethod
    def join(self, rank: int, world_size: int) -> bool:
        """Lay out for (rank, world_size); True when the optimizer was (re)built."""

    def mesh_groups(self, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
        """The extra groups this layout needs at (rank, world_size) (see the module doc)."""
        return {}

    def plan(self, m: int, world_size: int) -> list[list[int]]:
        """Microbatch ids per rank: ReCoVer's quota plan over the ranks."""
        return quota.plan(m, world_size)

    def data_ranks(self, world_size: int) -> int:
        """Ranks that compute distinct microbatches (M's default: one microbatch each)."""
        return world_size

    def contributes(self) -> bool:
        """Whether this rank's microbatches are counted in the step's all-reduce."""
        return True

    def reassign(self, remaining: list[int], m: int, old_world: int,
                 world_size: int) -> list[list[int]]:
        """An interrupted step's unfinished ids, per rank of the next generation."""
        return quota.reassign(remaining, self.plan(m, old_world), world_size)

    def unit_ranks(self, rank: int, world_size: int) -> range:
        """The ranks of `rank`'s failure unit (see the module docstring)."""
        return range(rank, rank + 1)

    def in_unit(self, name: str) -> bool:
        """Whether mesh group `name` lies inside one failure unit."""
        return False

    def keeps_work(self) -> bool:
        """Whether the gradients accumulated in the interrupted step are intact (decided
        when the generation was left, `relocate`)."""
        return self.local_gradients

    def reduce(self, m: int, what: str) -> None:
        """Collective, before the step's all-reduce: gradients across failure units, for
        a step of `m` microbatches."""
        return None

    def can_move(self) -> bool:
        """Whether this worker, once laid out, can take another rank."""
        return True

    def fingerprinted(self, grads: torch.Tensor) -> dict[str, list[torch.Tensor]] | None:
        """What the ranks of each `vote_classes` class hold bit for bit once the step's
        gradients are reduced (`grads`: the reduced region of the step's all-reduce),
        before the update: the gradients first, then the parameters (and whatever else);
        the fingerprint vote digests each entry. None: no vote (no replicas)."""
        return None

    def vote_classes(self, world_size: int) -> list[list[int]]:
        """The sets of ranks whose `fingerprinted` state must be equal (data parallel:
        every rank; HSDP: the ranks at one place of every replica group)."""
        return [list(range(world_size))]

    def can_undo(self) -> bool:
        """Whether an optimizer step can be undone from the rank's own snapshot of the step
        before plus `gather_params` (every rank's unique state is in its own snapshot):
        the fingerprint vote is then awaited after the update."""
        return False

    def bind(self, ops: GroupOps, generation: int, microbatches: int,
             groups: dict[str, GroupOps]) -> None:
        """The generation's training group is built (`microbatches`: M of its steps), and
        the `mesh_groups` (name -> their ops). A layout that talks only through `ops` has
        nothing to do here."""
        return None

    def failure(self) -> CommFailure | None:
        """A failure of this generation latched inside the user's passes, if any."""
        return None

    @abstractmethod
    def on_optimizer_step(self, hook: Callable[[], None]) -> None:
        """Run `hook` before every optimizer step, on every optimizer built from now on
        (the snapshot's copy must finish before the update mutates its tensors)."""

    @abstractmethod
    def relocate(self) -> None:
        """Move the live state to fresh storage: an abandoned collective of a dead
        generation that completes late must not write into it."""

    # -- the step ----------------------------------------------------------------------
    @abstractmethod
    def grad_numel(self) -> int:
        """Length of the gradient region of the step's all-reduce buffer."""

    @abstractmethod
    def write_grads(self, out: torch.Tensor) -> None:
        """Copy this rank's accumulated gradients into `out` (`grad_numel()` elements)."""

    @abstractmethod
    def clip(self, grads: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the step's averaged gradient (`grads`: the reduced region of the step's
        all-reduce; a sharded layout's own gradients) by its global norm, exactly as
        `torch.nn.utils.clip_grad_norm_` does, and return that norm, the same on every
        rank. Called after the step's all-reduce, before `update`; collective where the
        gradients are sharded (a failure is latched like the passes', `failure()`)."""

    @abstractmethod
    def update(self, grads: torch.Tensor, ops: GroupOps, what: str,
               before_gather: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Collective: the optimizer step on the averaged gradient region, then the model's
        parameters made ready for the next forward pass. `before_gather(gathered)` runs
        once the optimizer stepped and the parameters' collective (if any) is issued:
        `gathered()` waits for it (the fingerprint vote's result is awaited there, and
        an update it rejects is undone after `gathered()`)."""

    def load_dcp(self, url: str) -> int:
        """At a fresh start, this rank's state from a checkpoint in DCP's default format
        (`--init-from`); returns its step. Not collective."""
        raise ValueError(
            f"--init-from {url}: starting from a torch.distributed.checkpoint directory needs "
            "a sharded model (setup(parallelize=...)); a data-parallel model loads its "
            "weights with sess.load_state(...) before the loop")

    @abstractmethod
    def start_from_rank0(self, ops: GroupOps) -> None:
        """Collective, at a fresh start: every rank takes rank 0's initial parameters."""

    @abstractmethod
    def params_changed(self) -> None:
        """The user changed the model's parameters (loaded weights): take them in."""

    # -- snapshots, restores, resharding -----------------------------------------------
    @abstractmethod
    def unique_tensors(self) -> dict[str, torch.Tensor]:
        """References to the state only this rank holds."""

    @abstractmethod
    def unique_meta(self) -> dict:
        """JSON-serialisable rest of this rank's unique state (optimizer scalars, ...)."""

    @abstractmethod
    def load_unique(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Take back this rank's own snapshot, of the current world size."""

    @abstractmethod
    def load_params(self, shards: list[dict[str, torch.Tensor]]) -> None:
        """The model's parameters from every rank's snapshot tensors (rank order), without
        a collective: a spare computing ahead from the node's copies."""

    @abstractmethod
    def gather_params(self, ops: GroupOps, what: str) -> None:
        """Collective: the model's parameters from every rank's loaded state."""

    @abstractmethod
    def reshard(self, old: list[tuple[dict[str, torch.Tensor], dict]]) -> None:
        """This rank's state from every old rank's snapshot (tensors, meta), in old rank
        order, of another world size. The parameters are whole afterwards."""

    @abstractmethod
    def full_state(self, ops: GroupOps) -> dict[str, torch.Tensor]:
        """Collective: the whole model and optimizer state, world-size free."""

    @abstractmethod
    def export_meta(self) -> dict:
        """How to rebuild the model's trained tensors from persisted snapshots."""

    @abstractmethod
    def trained_names(self) -> set[str]:
        """State-dict names of the tensors the layout trains (the rest is fixed)."""

    # -- the user's optimizer ----------------------------------------------------------
    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer this rank steps (after the first `join`)."""

    @property
    @abstractmethod
    def scheduler(self):
        """The LR scheduler built on it, or None."""

"""The parallelism seam: how one rank's share of the training state is laid out over the
ranks of a generation, as a few small roles with one job each.

The session owns the loop and the step's one all-reduce; snapshots and replicas own the
bytes; the restore planner owns where old copies come from. None of them knows how
parameters, gradients and optimizer state are cut over ranks: they ask the job's
`Layout`, which is composed of six roles:

- `Membership`: how the rank takes part in a generation (join, its mesh groups, bind,
  latched failures, relocate). `FlatZero1`, `Fsdp2Layout`, `HsdpLayout`.
- `Holdings`: what this rank's state is, and how it is saved, loaded, resharded and
  exported. The same three.
- `StepMath`: how a step's gradients are reduced and clipped and the optimizer stepped.
  The same three.
- `WorkSplit`: who computes which microbatch; which ranks form a failure unit.
  `DataParallelWork` (the default), `TensorParallelWork`, `ReplicaGroupWork`.
- `VoteScope`: what the silent-corruption vote compares, among which ranks. `NoVote`
  (the default), `FlatZero1`, `HsdpLayout`.
- `MicrobatchExecutor`: who runs a step's microbatches. `UserLoop` (the user's own loop,
  on each rank).

One object may play several roles (a layout's state, its step and its generations share
its buffers); a role that only one parallelism needs has a default the others never see
(`StepMath.reduce`, `WorkSplit.in_unit`, `Holdings.load_dcp`, ...). Layouts are chosen
from `Session.setup`'s arguments in one place, `layouts.py`; `tests/unit/test_layout_contract.py`
runs one shared body against every layout.

A pipeline (the next parallelism) is a second `MicrobatchExecutor`: a schedule that runs
a step's microbatches across stages, whose forward and backward collectives are
send/recv; the session then hands the schedule the step's microbatch ids instead of
yielding them to the user's loop (docs/architecture.md: "Pipelines").

The calling rules that span roles:

- `Membership.join(rank, world_size)` is called once per generation, before anything else
  of that generation, with the optimizer's pre-step hook already registered through
  `StepMath.on_optimizer_step`; it may rebuild the optimizer and says so. Not collective.
- `Membership.bind(...)` is called once the generation's training group and the
  `mesh_groups` are built, before any collective of that generation.
- Methods that take `ops` run collectives with its deadlines; a failure raises
  `CommFailure` and leaves the layout usable for the next generation after `relocate()`.
- A snapshot is `(Holdings.unique_tensors(), Holdings.unique_meta())`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from phoenixft.checkpoint.record import Snapshot
from phoenixft.comm.collectives import CommFailure, GroupOps
from phoenixft.train import quota
from phoenixft.train.step import MicrobatchExecutor, UserLoop


class Membership(ABC):
    """How this rank takes part in a generation.

    - `join` once per generation, first; `bind` once its groups are built, before any of
      its collectives. A layout whose own collectives run inside the user's forward and
      backward (FSDP2) latches their failures instead of raising them there: `failure()`
      returns it, and the session raises it before the step's all-reduce.
    - `mesh_groups(rank, world_size)`: process groups over subsets of the generation's
      ranks the layout needs besides the training group (a mesh's rows and columns):
      name -> (this rank's place in it, its size); built with the training group and
      handed to `bind`.
    - `relocate()`: the generation was left; the live state moves to fresh storage (an
      abandoned collective that completes late must not write into it).
    """

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The world size it is laid out for (0 before the first `join`)."""

    @abstractmethod
    def join(self, rank: int, world_size: int) -> bool:
        """Lay out for (rank, world_size); True when the optimizer was (re)built."""

    @abstractmethod
    def relocate(self) -> None:
        """Move the live state to fresh storage (see the class doc)."""

    def mesh_groups(self, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
        return {}

    def bind(self, ops: GroupOps, generation: int, microbatches: int,
             groups: dict[str, GroupOps]) -> None:
        """The generation's training group is built (`microbatches`: M of its steps), and
        the `mesh_groups` (name -> their ops)."""
        return None

    def failure(self) -> CommFailure | None:
        """A failure of this generation latched inside the user's passes, if any."""
        return None

    def can_move(self) -> bool:
        """Whether this worker, once laid out, can take another rank (False: a worker its
        generation leaves out exits instead of waiting as a spare)."""
        return True

    def fault_phases(self) -> frozenset[str]:
        """The fault-injection phases inside the passes this layout reaches: "backward"
        (a sharded model's reduce-scatter, a pipeline's gradient send/recv), "forward" (a
        pipeline's activation send/recv)."""
        return frozenset()


class Holdings(ABC):
    """What this rank's training state is, and how it is saved, loaded and resharded.

    - `unique_tensors()` are references to the state only this rank holds (what other
      ranks hold identically is not in it: any survivor serves that). They stay valid
      until the next `StepMath.update`; the snapshot thread copies them before it.
    - `load_unique` takes back this rank's own snapshot of the same world size; `reshard`
      takes every old rank's snapshot of another world size. Neither is collective; after
      either, `gather_params(ops)` (collective) makes the parameters whole where needed.
    - `full_state(ops)` (collective) is world-size free: the same bytes for the same
      training state at any world size (the final digest and export compare it).
    """

    @property
    @abstractmethod
    def numel(self) -> int:
        """Elements of trainable state: a snapshot of another model is refused by it."""

    @abstractmethod
    def unique_tensors(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def unique_meta(self) -> dict:
        """JSON-serialisable rest of this rank's unique state (optimizer scalars, ...)."""

    @abstractmethod
    def load_unique(self, tensors: dict[str, torch.Tensor], meta: dict) -> None: ...

    @abstractmethod
    def load_params(self, shards: list[dict[str, torch.Tensor]]) -> None:
        """The model's parameters from every rank's snapshot tensors (rank order), without
        a collective: a spare computing ahead from the node's copies."""

    @abstractmethod
    def gather_params(self, ops: GroupOps, what: str) -> None:
        """Collective: the model's parameters from every rank's loaded state."""

    @abstractmethod
    def reshard(self, old: list[Snapshot]) -> None:
        """This rank's state from every old rank's snapshot, in old rank order, of another
        world size (`header.opt` is what `unique_meta` gave). The parameters are whole
        afterwards."""

    @abstractmethod
    def full_state(self, ops: GroupOps) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def export_meta(self) -> dict:
        """How to rebuild the model's trained tensors from persisted snapshots."""

    @abstractmethod
    def trained_names(self) -> set[str]:
        """State-dict names of the tensors the layout trains (the rest is fixed)."""

    @abstractmethod
    def start_from_rank0(self, ops: GroupOps) -> None:
        """Collective, at a fresh start: every rank takes rank 0's initial parameters."""

    @abstractmethod
    def params_changed(self) -> None:
        """The user changed the model's parameters (loaded weights): take them in."""

    def load_dcp(self, url: str) -> int:
        """At a fresh start, this rank's state from a checkpoint in DCP's default format
        (`--init-from`); returns its step. Not collective."""
        raise ValueError(
            f"--init-from {url}: starting from a torch.distributed.checkpoint directory needs "
            "a sharded model (setup(parallelize=...)); a data-parallel model loads its "
            "weights with sess.load_state(...) before the loop")


class StepMath(ABC):
    """How a step's gradients are reduced and clipped, and the optimizer stepped.

    - `write_grads(out)` copies this rank's accumulated gradients into the gradient region
      of the step's all-reduce buffer (`grad_numel()` elements; 0 where the layout reduces
      inside backward). `reduce` (collective, before that all-reduce) reduces gradients
      across failure units without touching the accumulated ones (HSDP).
    - `clip` after the all-reduce, before `update`: the global norm, as
      `torch.nn.utils.clip_grad_norm_` computes it, the same on every rank.
    - `update(grads, ops)` (collective) steps the optimizer on the averaged gradient and
      leaves the parameters ready for the next forward pass.
    - `local_gradients`: a rank's accumulated gradients are its own until the step's
      all-reduce (the flat layout). Only then can a recovery keep the microbatches a
      survivor finished, or a spare compute the dead rank's ahead of joining.
    """

    device: torch.device
    master_dtype: torch.dtype  # dtype of the gradient region and the optimizer's state
    local_gradients: bool = True

    @abstractmethod
    def grad_numel(self) -> int: ...

    @abstractmethod
    def write_grads(self, out: torch.Tensor) -> None: ...

    def reduce(self, m: int, what: str) -> None:
        """Collective, before the step's all-reduce: gradients across failure units, for
        a step of `m` microbatches."""
        return None

    @abstractmethod
    def clip(self, grads: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the step's averaged gradient by its global norm and return that norm
        (collective where the gradients are sharded; a failure is latched like the
        passes', `Membership.failure()`)."""

    @abstractmethod
    def update(self, grads: torch.Tensor, ops: GroupOps, what: str,
               before_gather: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Collective: the optimizer step, then the parameters made ready for the next
        forward pass. `before_gather(gathered)` runs once the optimizer stepped and the
        parameters' collective (if any) is issued: `gathered()` waits for it (the vote's
        result is awaited there, and an update it rejects is undone after it)."""

    @abstractmethod
    def on_optimizer_step(self, hook: Callable[[], None]) -> None:
        """Run `hook` before every optimizer step, on every optimizer built from now on
        (the snapshot's copy must finish before the update mutates its tensors)."""

    @property
    @abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer this rank steps (after the first `join`)."""

    @property
    @abstractmethod
    def scheduler(self):
        """The LR scheduler built on it, or None."""

    # -- sampled recomputation (`recompute.py`) ---------------------------------------
    # whether a rank's own first microbatch is recomputed apart as well, as a third check
    # pass: its gradient in the step is reduced inside backward, never its own alone
    own_checked_apart: bool = False

    def recompute_refusal(self) -> str | None:
        """Why a check pass cannot keep a microbatch's gradient apart from the step's in
        this layout (`--recompute-every` is then refused), or None."""
        if self.local_gradients:
            return None
        return ("it recomputes a peer's microbatch in this rank's own loop, from gradients "
                "that are its own until the all-reduce: data parallelism or a plain FSDP2 "
                "model (a tensor-parallel, HSDP or pipelined one reduces across ranks that "
                "compute together)")

    def check_pass(self, on: bool) -> None:
        """Check passes begin (on) or end: their backward must leave the gradient on this
        rank, unreduced (data parallelism: it does anyway, until the all-reduce)."""
        return None

    def check_gradients(self, model: nn.Module) -> list[torch.Tensor]:
        """The gradient the check pass just computed."""
        return [p.grad for p in model.parameters() if p.grad is not None]

    def drop_check_gradients(self, model: nn.Module) -> None:
        """Forget it (the step's own passes follow)."""
        model.zero_grad(set_to_none=True)


class WorkSplit:
    """Who computes which microbatch of a step, and which ranks form a failure unit. This
    class is data parallelism's: every rank computes its own share (ReCoVer's quota plan)
    and is a unit by itself.

    - `plan(m, world_size)`: the microbatch ids per rank; `contributes()`: whether this
      rank's audit, loss and count go into the step's all-reduce (the ranks of one
      tensor-parallel group compute the same microbatches: one of them counts them);
      `reassign` hands an interrupted step's unfinished ids to the next generation's ranks.
    - Failure units: `unit_ranks(rank, world_size)` are the ranks whose gradients are one
      thing; they keep a step's finished microbatches together or not at all
      (`keeps_work`), and a unit leaves the job whole (`leaves_whole`: its size, or None
      when the leader may drop single ranks). The mesh groups inside one unit (`in_unit`)
      are not interrupted by a generation that leaves the unit as it was.
    """

    leaves_whole: int | None = None

    def plan(self, m: int, world_size: int) -> list[list[int]]:
        return quota.plan(m, world_size)

    def data_ranks(self, world_size: int) -> int:
        """Ranks that compute distinct microbatches (M's default: one microbatch each)."""
        return world_size

    def default_m(self, world_size: int) -> int:
        """M when `setup` names none: one microbatch per data-parallel rank."""
        return self.data_ranks(world_size)

    def contributes(self) -> bool:
        return True

    def reassign(self, remaining: list[int], m: int, old_world: int,
                 world_size: int) -> list[list[int]]:
        return quota.reassign(remaining, self.plan(m, old_world), world_size)

    def unit_ranks(self, rank: int, world_size: int) -> range:
        return range(rank, rank + 1)

    def in_unit(self, name: str) -> bool:
        return False

    def keeps_work(self) -> bool:
        """Whether the gradients accumulated in the interrupted step are intact (decided
        when the generation was left)."""
        return True

    def min_world_error(self, min_world: int, world_size: int) -> str | None:
        """Why `--min-nproc min_world` can never take effect with this split, or None."""
        return None

    def peer_classes(self, world_size: int) -> list[list[int]]:
        """The ranks whose compute times are comparable (the same work each step): a
        straggler is a rank slower than the others of its class."""
        return [list(range(world_size))]

    def where(self, rank: int, world_size: int) -> str | None:
        """Where rank `rank` sits, for a person (a pipeline: its stage and replica)."""
        return None


DataParallelWork = WorkSplit


class VoteScope:
    """What the silent-corruption vote compares (`fingerprints.py`). This class is the
    default: no vote (no rank holds a copy of another's state).

    - `fingerprinted(grads)`: state the ranks of each `vote_classes` class hold bit for
      bit once the step's gradients are reduced (`grads`: the reduced region of the
      step's all-reduce), before the update: the gradients first, then the parameters
      (and whatever else); None: no vote.
    - `can_undo()`: an optimizer step can be undone from the rank's own snapshot of the
      step before plus `Holdings.gather_params`: the vote may then be awaited after the
      update. The seal covers `Holdings.unique_tensors()`.
    - `rolls_back()`: a disagreement rolls every rank back to the step before the one
      whose state differs (no replay, no majority needed: a vote of two copies, where a
      snapshot may hold the changed copy), instead of naming the ranks outvoted alone.
    - `finds()`: the kinds of flip (`flip:...:where=W`) the vote finds.
    """

    def fingerprinted(self, grads: torch.Tensor) -> dict[str, list[torch.Tensor]] | None:
        return None

    def vote_classes(self, world_size: int) -> list[list[int]]:
        return [list(range(world_size))]

    def can_undo(self) -> bool:
        return False

    def rolls_back(self) -> bool:
        return False

    def finds(self) -> frozenset[str]:
        return frozenset({"grad", "param"})


NoVote = VoteScope


@dataclass(frozen=True)
class Layout:
    """One job's layout: its roles (see the module doc). `kind` names it (`layouts.py`)."""

    kind: str
    members: Membership
    state: Holdings
    math: StepMath
    work: WorkSplit
    vote: VoteScope
    executor: MicrobatchExecutor

    @staticmethod
    def of(kind: str, core, work: WorkSplit, vote: VoteScope | None = None,
           executor: MicrobatchExecutor | None = None) -> Layout:
        """A layout whose `core` object plays Membership, Holdings and StepMath (and
        VoteScope when it is one and no `vote` is given)."""
        vote = vote if vote is not None else core if isinstance(core, VoteScope) else NoVote()
        return Layout(kind, core, core, core, work, vote, executor or UserLoop())

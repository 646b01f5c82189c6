"""`HsdpLayout`: FSDP2 inside replica groups, the groups replicating each other (HSDP),
with the replica group as the unit of failure (`layout.py`'s failure units).

The job's ranks form R replica groups of U = dp_shard x tp consecutive ranks. The user's
`parallelize(model, mesh)` is the same as for FSDP2: the mesh phoenixft gives is its
group's ("dp_shard"[, "tp"]), so FSDP2 reduce-scatters gradients inside the group, in
the user's backward. Across groups phoenixft reduces them itself, at the step's end
(`reduce`: an all-reduce of each rank's gradient shards over the "dp_replicate" group of
the ranks at its place in every group), into a buffer of its own: a group's accumulated
gradients are the group's until that all-reduce has completed everywhere. So when a group
is lost, the other groups keep the microbatches they finished (ReCoVer's in-step
recovery, per group) and take the lost group's quota; the step's gradient is the mean
over the same M microbatches as a failure-free step's.

Why not FSDP2's own HSDP (`fully_shard` over a 2-D (replicate, shard) mesh): it
all-reduces across groups inside backward, per unit and microbatch, so a group lost in
the middle of a step leaves every survivor's gradients holding part of its work (torchft
pays the same by dropping the step). The cost is that the cross-group all-reduce is not
overlapped with backward.

Membership. A worker keeps its place in its group (the dp_shard and tp coordinates
`fully_shard` cut its shards for) for life; its group's number and its rank may change:
when a group leaves, the others are renumbered. The world process group
(torch.distributed's default) is swapped only while it has the worker's first rank and
size; otherwise it is retired (a collective on it raises, naming why). A new generation
that leaves a group's members as they were does not interrupt the group's own
collectives (`in_unit`): a survivor group finishes its microbatch and then finds the
failure at the step's end. A group that lost a member drops its step's work; its live
members exit if no spare takes the dead one's place (`can_move`), and `--respawn`
brings a whole group back at a step boundary.

Snapshots: the groups hold the same shards, so only group 0 snapshots parameters and
optimizer state (every rank still snapshots its own RNG and data position); a restore
sends them from group 0 to the others over dp_replicate (`gather_params`), and a
world-size change (a group gone or back) reshards from group 0's snapshot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import phoenixft.torch_internals as ti
from phoenixft.comm.collectives import CommFailure, GroupOps
from phoenixft.comm.swap_group import sub_group
from phoenixft.config import ConfigError
from phoenixft.train import quota
from phoenixft.train.fsdp_layout import MESH_DIMS, Fsdp2Layout, TensorParallelWork
from phoenixft.train.layout import VoteScope


class HsdpLayout(Fsdp2Layout, VoteScope):
    """FSDP2 (and tp) inside replica groups of `dp_shard * tp` ranks; see the module doc.
    Its `WorkSplit` is `ReplicaGroupWork`; it votes across the groups."""

    def __init__(self, *args, dp_shard: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if dp_shard < 1:
            raise ValueError(f"dp_shard must be >= 1, got {dp_shard}")
        self.dp_shard = dp_shard
        self.unit = dp_shard * self.tp
        self.unit_words = ("replica groups of dp_shard x tp", "--dp-shard, --tp")
        self._place = (-1, 0)  # (rank, world size) of the generation joined last
        self._local = -1  # this worker's rank inside its group, for life
        self._rep_ops: GroupOps | None = None
        self._reduced: torch.Tensor | None = None  # the step's cross-group sum (`reduce`)
        self.kept = False  # `relocate` found the group's gradients intact

    def recompute_refusal(self) -> str | None:
        return ("HSDP's replica groups hold copies that the fingerprint vote compares "
                "(--fingerprint-every); the recomputation is built for data parallelism and "
                "plain FSDP2 (no replica groups)")

    # -- a generation ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._place[1]

    @property
    def rank(self) -> int:
        return self._place[0]

    def join(self, rank: int, world_size: int) -> bool:
        if world_size % self.unit:
            words, flags = self.unit_words
            raise ConfigError(f"--nproc {world_size}: {world_size} ranks cannot form {words} = "
                              f"{self.unit} ({flags}): run a multiple of {self.unit} ranks")
        if self.group is not None:
            if rank % self.unit != self._local:
                raise RuntimeError(f"a replica group member keeps its place in its group: this "
                                   f"worker is place {self._local}, the new generation makes it "
                                   f"rank {rank} (place {rank % self.unit})")
            self._place = (rank, world_size)
            return False
        self._place, self._local = (rank, world_size), rank % self.unit
        return super().join(rank, world_size)

    def _make_mesh(self, rank: int, world_size: int):
        """The group's DeviceMesh: ("dp_shard",) or ("dp_shard", "tp") over this group's
        global ranks (each dimension a SwapGroup), as Fsdp2Layout's with tp > 1."""
        from torch.distributed.device_mesh import DeviceMesh
        base = rank - rank % self.unit
        grid = torch.arange(base, base + self.unit).view(self.dp_shard, self.tp)
        d, t = divmod(rank % self.unit, self.tp)
        self.dims = {"dp_shard": sub_group("dp_shard", grid[:, t].tolist(), rank)}
        if self.tp > 1:
            self.dims["tp"] = sub_group("tp", grid[d].tolist(), rank)
        self.dims["dp_shard"].before_reduce_scatter = self._before_reduce_scatter
        if self.tp == 1:
            return DeviceMesh.from_group(self.dims["dp_shard"], self.device.type,
                                         mesh_dim_names=MESH_DIMS[:1])
        return DeviceMesh.from_group(list(self.dims.values()), self.device.type, mesh=grid,
                                     mesh_dim_names=MESH_DIMS)

    def mesh_groups(self, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
        u, local = divmod(rank, self.unit)
        d, t = divmod(local, self.tp)
        out = {f"dp_shard.{u}.{t}": (d, self.dp_shard)}
        if self.tp > 1:
            out[f"tp.{u}.{d}"] = (t, self.tp)
        out[f"dp_replicate.{local}"] = (u, world_size // self.unit)
        return out

    def can_move(self) -> bool:
        return self.group is None

    def bind(self, ops: GroupOps, generation: int, microbatches: int,
             groups: dict[str, GroupOps]) -> None:
        if (ops.pg.rank(), ops.pg.size()) == (self.group.rank(), self.group.size()):
            self.group.swap(ops, generation)
        else:
            self.group.retire(
                f"the job's world is now {ops.pg.size()} ranks, this worker is rank "
                f"{ops.pg.rank()}; torch.distributed's default group was made for "
                f"{self.group.size()} (rank {self.group.rank()}). An HSDP job's replica "
                "groups come and go: communicate over the mesh Session gives")
        for name, dim_ops in groups.items():
            dim = name.split(".")[0]
            if dim == "dp_replicate":
                self._rep_ops = dim_ops
            else:
                self.dims[dim].swap(dim_ops, generation)
        self._tp_ops = groups.get(next((n for n in groups if n.startswith("tp.")), ""), None)
        if microbatches % self.dp_shard:
            raise ConfigError(
                f"{microbatches} microbatches a step cannot be shared evenly by the "
                f"{self.dp_shard} data-parallel ranks of a replica group: FSDP2's collectives "
                f"need every rank of a group to run as many forward and backward passes. "
                f"Choose microbatches= a multiple of {self.dp_shard}")
        self._reduced = None

    def failure(self) -> CommFailure | None:
        return next((g.failure for g in self.dims.values() if g.failure is not None), None)

    def relocate(self) -> None:
        """The group's gradients are kept when none of its collectives failed and no clip
        replaced them by the step's mean (`_settle_grads`): every one of them completed (a
        generation that leaves the group as it was does not interrupt them), so they hold
        whole microbatches. Otherwise the step is redone."""
        self.kept = self.failure() is None and not self._settled
        self._reduced = None
        self._settled = False
        if not self.kept:
            super().relocate()
            return
        if self.group.retired is None:
            self.group.latch(CommFailure("the generation was left"))
        for g in self.dims.values():
            g.latch(CommFailure("the generation was left"))

    # -- the step ----------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        """Every trainable parameter's local gradient shard, in one fixed order; zeros
        where it has none (a group given no microbatch in a resumed step, a parameter no
        microbatch reached): the groups' buffers must line up element for element."""
        out = []
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(ti.local(p.grad))
        return out

    def reduce(self, m: int, what: str) -> None:
        """Sum every rank's gradient shards over dp_replicate into a buffer of our own
        (the accumulated gradients stay the group's until `update`). FSDP2 averaged each
        reduce-scatter over the group's dp_shard ranks, so the sum over groups is
        (1 / dp_shard) of the sum over the step's `m` microbatches: the mean is dp_shard
        / m of it (`m` the step's own: a step resumed after a shrink keeps its M)."""
        flat = torch.cat([g.reshape(-1) for g in self._grads()])
        if self._rep_ops is not None and self._rep_ops.pg.size() > 1:
            self._rep_ops.allreduce(flat, what)
        self._reduced, self._grad_scale = flat, self.dp_shard / m

    def _settle_grads(self) -> None:
        """The cross-group mean onto the parameters' gradient shards (once a step: by
        `clip`, else by `update`): every group then holds the same gradient, and the
        norm over one group's shards (`clip`) is the global norm."""
        if self._settled:
            return
        self._settled = True
        off = 0
        with torch.no_grad():
            for g in self._grads():
                n = g.numel()
                g.copy_(self._reduced[off:off + n].view_as(g)).mul_(self._grad_scale)
                off += n

    def update(self, grads: torch.Tensor, ops: GroupOps, what: str,
               before_gather: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._settle_grads()
        self._settled = False
        self._reduced = None
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if before_gather is not None:
            before_gather(lambda: None)

    def fingerprinted(self, grads: torch.Tensor) -> dict[str, list[torch.Tensor]] | None:
        """The groups hold the same shards: of the cross-group gradient sum, of the
        parameters and of the optimizer state (a vote across groups covers all three).
        Outside a step (the check after the last one) there is no gradient sum: the vote
        covers the other two."""
        params, opt = [], []
        for p in self.model.parameters():
            if p.requires_grad:
                params.append(ti.local(p))
                opt += [ti.local(v) for _, v in sorted(self.opt.state.get(p, {}).items())
                        if torch.is_tensor(v)]
        reduced = [self._reduced] if self._reduced is not None else []
        return {"reduced gradient shards": reduced, "parameter shards": params,
                "optimizer state shards": opt}

    def vote_classes(self, world_size: int) -> list[list[int]]:
        return [list(range(p, world_size, self.unit)) for p in range(self.unit)]

    def rolls_back(self) -> bool:
        return False  # (replica groups outvote, and the others' snapshots are whole)

    def finds(self) -> frozenset[str]:
        return frozenset({"grad", "param"})

    # -- snapshots, restores -----------------------------------------------------------
    def _holds_copy(self, name: str) -> bool:
        """Group 0 holds what every group holds; tp copies as Fsdp2Layout's."""
        return self.rank >= self.unit or super()._holds_copy(name)

    def gather_params(self, ops: GroupOps, what: str) -> None:
        """Group 0's parameters and optimizer state to every other group (over
        dp_replicate), then the tp copies inside each group."""
        if self._rep_ops is not None and self._rep_ops.pg.size() > 1:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    state = self.opt.state.get(p, {})
                    self._broadcast_state(self._rep_ops, p, state,
                                          f"{what}: {name} from group 0")
        super().gather_params(ops, what)

    def export_meta(self) -> dict:
        meta = super().export_meta()
        meta["mesh"] = {"dp_replicate": self.world_size // self.unit,
                        "dp_shard": self.dp_shard, "tp": self.tp}
        return meta


class ReplicaGroupWork(TensorParallelWork):
    """HSDP's split of a step: a replica group (dp_shard x tp ranks) is the failure unit,
    which leaves the job whole and keeps its finished microbatches when its collectives
    all completed (`HsdpLayout.relocate`); its mesh groups, but not the cross-group one,
    lie inside it."""

    def __init__(self, layout: HsdpLayout) -> None:
        super().__init__(layout)
        self.dp_shard, self.unit = layout.dp_shard, layout.unit
        self.leaves_whole = layout.unit

    def in_unit(self, name: str) -> bool:
        return not name.startswith("dp_replicate.")

    def unit_ranks(self, rank: int, world_size: int) -> range:
        base = rank - rank % self.unit
        return range(base, base + self.unit)

    def keeps_work(self) -> bool:
        return self.layout.kept

    def data_index(self, rank: int) -> int:
        """Which data-parallel place rank `rank` computes the microbatches of (the ranks
        of a tp group share one; a group's are consecutive)."""
        return rank // self.tp

    def _per_rank(self, dealt: list[list[int]], world_size: int) -> list[list[int]]:
        return [dealt[self.data_index(r)] for r in range(world_size)]

    def plan(self, m: int, world_size: int) -> list[list[int]]:
        """The data-parallel plan when M is a multiple of the data-parallel places;
        otherwise the ids go out in rounds of dp_shard (one per place in a group) to the
        groups in turn: every rank of a group runs as many passes, groups may run
        different numbers (the cross-group sum does not care), so M need only be a
        multiple of dp_shard, whatever number of groups the job shrinks to."""
        d = self.data_ranks(world_size)
        if m % d == 0:
            return self._per_rank(quota.plan(m, d), world_size)
        return self._per_rank(quota.plan_in_rounds(m, d // self.dp_shard, self.dp_shard),
                              world_size)

    def reassign(self, remaining: list[int], m: int, old_world: int,
                 world_size: int) -> list[list[int]]:
        """As the flat layout's (an id stays with its rank number where it can, so a
        group that recomputes its step does it exactly as before), over data-parallel
        places; but every rank of a group must run as many passes (FSDP2's collectives),
        so when that deal is uneven inside a group, the ids go out in rounds of one per
        member of a group, to the least loaded group first."""
        s = self.dp_shard
        old = [[] for _ in range(self.data_ranks(old_world))]
        for r, ids in enumerate(self.plan(m, old_world)):
            old[self.data_index(r)] = ids
        dealt = quota.reassign(remaining, old, self.data_ranks(world_size))
        groups = [dealt[i:i + s] for i in range(0, len(dealt), s)]
        if any(len({len(ids) for ids in g}) > 1 for g in groups):
            dealt = [[] for _ in dealt]
            ids = sorted(remaining)
            for i in range(0, len(ids), s):
                u = min(range(len(groups)), key=lambda k: (len(dealt[k * s]), k))
                for d, j in enumerate(ids[i:i + s]):
                    dealt[u * s + d].append(j)
        return self._per_rank(dealt, world_size)

    def min_world_error(self, min_world: int, world_size: int) -> str | None:
        if min_world % self.unit:
            return (f"--min-nproc {min_world}: HSDP's replica groups of {self.unit} ranks "
                    f"(--dp-shard x --tp) leave the job whole, so it can only shrink to a "
                    f"multiple of {self.unit}")
        return None

"""`Fsdp2Layout`: a model the user shards with FSDP2 (`fully_shard`), optionally with
tensor parallelism under it, the parallelism seam's second implementation (`layout.py`).

The user gives the unsharded model and a torchtitan-style `parallelize(model, mesh)`
(`parallelize_module` over mesh["tp"], then `fully_shard` per block and on the root over
mesh["dp_shard"]); phoenixft gives the mesh. Its groups are `SwapGroup`s
(comm/swap_group.py): the world's made torch.distributed's default group, and with tp > 1
one per mesh dimension (a tp group is `tp` consecutive ranks), registered with c10d. So
the mesh, FSDP2's parameter groups, the DTensors and the optimizer built on them are made
once per worker and kept for its whole life: after a failure the survivors keep every
object, only the communicators underneath are swapped for the next generation's (built
with its training group, `mesh_groups`), and a spare builds them once, when it takes its
rank (`fully_shard` fixes a rank's shard when it runs, so a spare cannot build them
before it knows its rank; `parallelize` must therefore not communicate).

What is unique to a rank: its local shards (each DTensor's local tensor, `torch_internals.local`) of the
parameters and their optimizer state. With tp > 1 the parameters tensor parallelism
leaves whole (FSDP2 shards them over dp_shard only: norms, attention, embeddings in the
example) are the same on every rank of a tp group: only the group's first rank
snapshots them, and a restore sends them from it to the others (`gather_params`). Where
each shard lies in the whole (`_placement`) goes into every snapshot: resharding, `ckpt
export` and bases in DCP's format (checkpoint/dcp_base.py) all place shards by it.

The step: FSDP2 reduces the gradients itself, inside the user's backward (a
reduce-scatter per unit, averaged over the D = world / tp data-parallel ranks); the
session's all-reduce carries only the audit and the loss (`grad_numel() == 0`; a tp
group's ranks compute the same microbatches, and only its first counts them). With M
microbatches per step the reduced gradient is scaled by D/M before the optimizer step
when they differ, so it is the mean over the step's microbatches as with the flat
layout; when M == D FSDP2's own reduction is left as it is, bit for bit that of a plain
FSDP2 script. M must be a multiple of D (every rank runs as many passes). Its collectives
run inside the user's loop body, so a failure there is latched by the groups and raised
by the session at the step's end (`failure`); the step is then redone from the restored
snapshot: a rank's gradients are never its own (`local_gradients` is False), so no
finished microbatch can be kept (no in-step recovery, no computing ahead).

A job resumed onto another world size or mesh shape reshards (`reshard`); a running job
cannot change its world size (survivors' shards were cut by `fully_shard` for the old
one): it needs spares (HSDP, `hsdp_layout.py`, has replica groups that can leave).
Clipping by the global norm (`clip`) takes the norm over every shard, its all-reduces on
the mesh's groups.

The vote (`VoteScope`, `fingerprints.py`): with tp > 1 the ranks of a tp group hold the
tp copies bit for bit, so they vote on them (their local shards and optimizer state)
every `--fingerprint-every` steps. A tp group of two cannot outvote either member, and a
copy changed before its snapshot was taken is in that snapshot too: so any disagreement
rolls the job back to the step before the one whose state differs (`rolls_back`), from
the snapshots every rank still holds of it, and a rank outside a strict majority (tp >=
3) is replaced as well.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import phoenixft.torch_internals as ti
from phoenixft.checkpoint.record import Snapshot
from phoenixft.comm.collectives import CommFailure, GroupOps
from phoenixft.comm.swap_group import SwapGroup, init_world, sub_group
from phoenixft.config import ConfigError
from phoenixft.train import quota
from phoenixft.train.clip import clip_grad_norm_
from phoenixft.train.digest import state_digest
from phoenixft.train.layout import Holdings, Membership, StepMath, VoteScope, WorkSplit
from phoenixft.train.zero import SchedulerFactory

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Parallelize = Callable[[nn.Module, object], object]  # (model, DeviceMesh) -> anything
MESH_DIMS = ("dp_shard", "tp")


class Fsdp2Layout(Membership, Holdings, StepMath, VoteScope):
    """Membership, Holdings, StepMath and VoteScope of an FSDP2 (+ tp) model; its
    `WorkSplit` is `TensorParallelWork`. It votes on the tp copies (tp > 1), and on nothing
    without tensor parallelism (no rank holds a copy of another's shards)."""

    local_gradients = False

    def __init__(self, model: nn.Module, factory: OptimizerFactory, parallelize: Parallelize,
                 scheduler: SchedulerFactory | None = None, *, tp: int = 1,
                 before_reduce_scatter: Callable[[], None] | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"trainable parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        self.model, self.factory, self.parallelize = model, factory, parallelize
        self.tp = tp
        self.scheduler_factory = scheduler
        self.device, self.master_dtype = params[0].device, params[0].dtype
        self._numel = sum(p.numel() for p in params)
        # every rank must start from the same parameters (seed before building the model):
        # checked at a fresh start without gathering any of them
        self._init_digest = _init_sample(model)
        self.group: SwapGroup | None = None  # the world's (torch.distributed's default group)
        self.dims: dict[str, SwapGroup] = {}  # with tp > 1: the mesh's dimensions' groups
        self.mesh = None
        self._tp_ops: GroupOps | None = None
        self._replicated: set[str] = set()  # parameters the tp dimension replicates
        self.opt: torch.optim.Optimizer | None = None
        self.sched = None
        self._hooks: list[Callable[[], None]] = []
        self._fsdp_params: list = []
        self._before_reduce_scatter = before_reduce_scatter
        self._grad_scale: float | None = None  # W/M when M != W (see `bind`)
        self._settled = False  # this step's gradients are final (`_settle_grads`)
        self._placement: dict[str, list] = {}  # see `_placement`

    # -- identity ----------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self._numel

    @property
    def world_size(self) -> int:
        return self.group.size() if self.group is not None else 0

    # -- a generation ------------------------------------------------------------------
    def join(self, rank: int, world_size: int) -> bool:
        if self.group is not None:
            if (rank, world_size) != (self.group.rank(), self.group.size()):
                raise RuntimeError(
                    f"a sharded model keeps its place in the mesh: this worker is rank "
                    f"{self.group.rank()} of {self.group.size()}, the new generation makes it "
                    f"rank {rank} of {world_size}. Changing the world size of an FSDP2 job "
                    "(--min-nproc, --respawn) is not supported yet: give it spares instead")
            return False
        if world_size % self.tp:
            raise ConfigError(f"--nproc {world_size}: {world_size} ranks cannot form tensor-"
                              f"parallel groups of tp={self.tp} (--tp): run a multiple of "
                              f"{self.tp} ranks")
        self.group = init_world(rank, world_size)
        self.mesh = self._make_mesh(rank, world_size)
        for g in self._all_groups():
            g.siblings = [x for x in self._all_groups() if x is not g]
        self.parallelize(self.model, self.mesh)
        self._fsdp_params = ti.fsdp_params(self.model)
        if not self._fsdp_params:
            raise RuntimeError("parallelize(model, mesh) sharded nothing: call fully_shard on "
                               "the model's blocks and its root with the mesh it is given")
        self._placement = _placement(self.model)
        if self.tp > 1:  # FSDP2 over dp_shard alone: the tp dimension holds copies of them
            self._replicated = {n for n, p in self.model.named_parameters()
                                if _tp_replicated(p)}
        self.opt = self.factory([p for p in self.model.parameters() if p.requires_grad])
        for hook in self._hooks:
            self.opt.register_step_pre_hook(lambda *_, h=hook: h())
        self.sched = self.scheduler_factory(self.opt) if self.scheduler_factory else None
        return True

    def _make_mesh(self, rank: int, world_size: int):
        """The DeviceMesh over SwapGroups: ("dp_shard",) of the world's group, or with
        tp > 1 ("dp_shard", "tp") of one SwapGroup per dimension (the ranks of a tp group
        are consecutive, as torchtitan lays them out)."""
        from torch.distributed.device_mesh import DeviceMesh
        dev = self.device.type
        scatter = self._before_reduce_scatter
        if self.tp == 1:
            self.group.before_reduce_scatter = scatter
            return DeviceMesh.from_group(self.group, dev, mesh_dim_names=MESH_DIMS[:1])
        grid = torch.arange(world_size).view(world_size // self.tp, self.tp)
        d, t = divmod(rank, self.tp)
        self.dims = {"dp_shard": sub_group("dp_shard", grid[:, t].tolist(), rank),
                     "tp": sub_group("tp", grid[d].tolist(), rank)}
        self.dims["dp_shard"].before_reduce_scatter = scatter
        return DeviceMesh.from_group(list(self.dims.values()), dev, mesh=grid,
                                     mesh_dim_names=MESH_DIMS)

    def _all_groups(self) -> list[SwapGroup]:
        return [self.group, *self.dims.values()] if self.group is not None else []

    def mesh_groups(self, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
        if self.tp == 1:
            return {}
        d, t = divmod(rank, self.tp)
        return {f"dp_shard.{t}": (d, world_size // self.tp), f"tp.{d}": (t, self.tp)}

    def can_move(self) -> bool:
        return self.group is None  # `fully_shard` fixed this worker's shard

    def fault_phases(self) -> frozenset[str]:
        return frozenset({"backward"})

    def bind(self, ops: GroupOps, generation: int, microbatches: int,
             groups: dict[str, GroupOps]) -> None:
        self.group.swap(ops, generation)
        for name, dim_ops in groups.items():
            self.dims[name.split(".")[0]].swap(dim_ops, generation)
        self._tp_ops = groups.get(next((n for n in groups if n.startswith("tp.")), ""), None)
        # FSDP2 averages each reduce-scatter over the D data-parallel ranks and sums the
        # M/D microbatches each runs: (1/D) of the sum; the mean over M is D/M of it
        # (FSDP2's own divide factor would need PREMUL_SUM, which gloo lacks). M == D:
        # FSDP2's own average, bit for bit that of a plain FSDP2 script.
        d = max(1, self.group.size() // self.tp)
        if microbatches % d:
            raise ConfigError(
                f"{microbatches} microbatches a step cannot be shared evenly by {d} "
                f"data-parallel ranks: FSDP2's collectives need every rank to run as many "
                f"forward and backward passes as the others. Choose microbatches= a multiple "
                f"of {d} (and, to resume onto other shapes, of their data-parallel sizes too)")
        self._grad_scale = None if microbatches == d else d / microbatches

    def failure(self) -> CommFailure | None:
        return next((g.failure for g in self._all_groups() if g.failure is not None), None)

    def on_optimizer_step(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)
        if self.opt is not None:
            self.opt.register_step_pre_hook(lambda *_: hook())

    def relocate(self) -> None:
        """The generation is over: abandon its collectives still in flight, and drop what
        FSDP2 holds of the abandoned step (its own `reset_iter_state`, then the gradients
        autograd left on unsharded parameters of units whose post-backward never ran,
        which it misses in torch 2.13 and which a redone step would add to)."""
        if self.group is None:
            return
        self.group.latch(CommFailure("the generation was left"))  # (and its siblings)
        self.model.reset_iter_state()
        self._settled = False
        for fp in self._fsdp_params:
            ti.drop_unsharded_grads(fp)
        self.opt.zero_grad(set_to_none=True)

    # -- the step ----------------------------------------------------------------------
    def grad_numel(self) -> int:
        return 0

    def write_grads(self, out: torch.Tensor) -> None:
        pass

    def _settle_grads(self) -> None:
        """The step's averaged gradient on the parameters (`.grad`), once per step: by
        `clip` or else by `update`."""
        if self._settled:
            return
        self._settled = True
        if self._grad_scale is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        ti.local(p.grad).mul_(self._grad_scale)

    def clip(self, grads: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global norm over every rank's gradient shards (`train/clip.py`): its
        all-reduces run on the mesh's groups, so a failure in them is latched and raised
        by the session, and the step redone, like a failure in backward."""
        self._settle_grads()
        return clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                               max_norm, norm_type)

    def update(self, grads: torch.Tensor, ops: GroupOps, what: str,
               before_gather: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._settle_grads()
        self._settled = False  # (the next step's gradients)
        self.opt.step()  # pre-hooks wait for the previous snapshot's copy; no collective
        if self.sched is not None:
            self.sched.step()
        if before_gather is not None:
            before_gather(lambda: None)

    # -- sampled recomputation (`recompute.py`) ---------------------------------------
    # FSDP2 reduce-scatters a microbatch's gradient inside its backward: the rank's own
    # first microbatch is recomputed apart too, with the checked ones
    own_checked_apart = True

    def recompute_refusal(self) -> str | None:
        if self.tp > 1:
            return ("with tensor parallelism a microbatch's gradient is computed by its tp "
                    "group together, so no rank alone can recompute a peer's (the tp copies "
                    "are voted on instead: --fingerprint-every); run it with --tp 1")
        return None

    def check_pass(self, on: bool) -> None:
        """FSDP2's no-sync mode (`set_requires_gradient_sync(False)`): a check pass's
        forward still all-gathers each unit's parameters (every rank runs as many check
        passes), its backward leaves the unsharded gradients on this rank instead of
        reduce-scattering them."""
        self.model.set_requires_gradient_sync(not on)

    def check_gradients(self, model: nn.Module) -> list[torch.Tensor]:
        return [g for g in map(ti.unsharded_grad, self._fsdp_params) if g is not None]

    def drop_check_gradients(self, model: nn.Module) -> None:
        for fp in self._fsdp_params:
            ti.drop_unsharded_grads(fp)

    def load_dcp(self, url: str) -> int:
        """Each rank reads its own shards (`train/dcp_io.py`); the tp copies too."""
        from phoenixft.train.dcp_io import load_sharded
        return load_sharded(self.model, self.opt, url)

    def start_from_rank0(self, ops: GroupOps) -> None:
        if self._init_digest is None:  # built on the meta device: initialised by the user
            return
        h = int(self._init_digest[:15], 16)
        vec = ops.allreduce(torch.tensor([h, -h], dtype=torch.int64),
                            "comparing the initial parameters", op=torch.distributed.ReduceOp.MAX)
        if int(vec[0]) != -int(vec[1]):
            raise RuntimeError("the ranks built different initial parameters: seed every "
                               "rank alike (torch.manual_seed) before building the model")

    def params_changed(self) -> None:
        if self.opt is not None:
            raise NotImplementedError("load_state after setup() with an FSDP2 model: load the "
                                      "weights before setup()")

    # -- snapshots, restores, resharding -----------------------------------------------
    def _holds_copy(self, name: str) -> bool:
        """Whether parameter `name` is a copy this rank holds of its tp group's first
        rank's (a parameter the tp dimension replicates, on a rank other than the first)."""
        return name in self._replicated and self.group.rank() % self.tp != 0

    def unique_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.named_parameters():
            if self._holds_copy(name):
                continue  # its tp group's first rank snapshots it (see gather_params)
            out[f"p.{name}"] = ti.local(p)
            for k, v in self.opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"o.{name}.{k}"] = ti.local(v)
        return out

    def unique_meta(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        scalars = {name: {k: v for k, v in self.opt.state.get(p, {}).items()
                          if not torch.is_tensor(v)}
                   for name, p in self.model.named_parameters()}
        # each tensor's kind of optimizer state (a rank that holds a copy gets them from
        # its tp group's first rank: it must know what to receive)
        kinds = {name: {k: [v.dim(), str(v.dtype).removeprefix("torch.")]
                        for k, v in self.opt.state.get(p, {}).items() if torch.is_tensor(v)}
                 for name, p in self.model.named_parameters() if self._holds_copy(name)}
        meta = {"param_groups": groups, "opt_scalars": scalars, "layout": "fsdp2",
                "dcp": self._placement, "copies": kinds}
        if self.sched is not None:
            meta["scheduler"] = self.sched.state_dict()
        return meta

    def load_unique(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        scalars = meta.get("opt_scalars", {})
        copies = meta.get("copies", {})
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if f"p.{name}" not in tensors and name in copies:
                    self._await_copy(p, copies[name])  # (gather_params fills it)
                    continue
                if ti.local(p).shape != tensors[f"p.{name}"].shape:
                    raise RuntimeError(f"snapshot shard of {name} is {tuple(tensors[f'p.{name}'].shape)}, "
                                       f"this rank's is {tuple(ti.local(p).shape)}: another model "
                                       "or another sharding")
                ti.local(p).copy_(tensors[f"p.{name}"])
                saved = {k[len(name) + 3:]: v for k, v in tensors.items()
                         if k.startswith(f"o.{name}.")}
                if not saved and not scalars.get(name):
                    self.opt.state.pop(p, None)
                    continue
                st = self.opt.state[p]
                for k, v in saved.items():
                    if k not in st:  # a fresh optimizer (a spare): make the state's DTensor
                        st[k] = v.clone() if v.dim() == 0 else torch.zeros_like(p)
                    ti.local(st[k]).copy_(v)
                st.update(scalars.get(name, {}))
        for g, saved_group in zip(self.opt.param_groups, meta.get("param_groups", [])):
            g.update({k: v for k, v in saved_group.items() if k in g})
        if self.sched is not None and "scheduler" in meta:
            self.sched.load_state_dict(meta["scheduler"])

    def load_params(self, shards: list[dict[str, torch.Tensor]]) -> None:
        raise RuntimeError("an FSDP2 rank cannot compute ahead (local_gradients is False)")

    def _await_copy(self, p: nn.Parameter, kinds: dict[str, list]) -> None:
        """Make the optimizer state a copy of a replicated parameter will receive."""
        st = self.opt.state[p]
        for k, (dim, dtype) in kinds.items():
            if k not in st:
                st[k] = torch.zeros_like(p) if dim else torch.zeros((), dtype=getattr(torch, dtype))

    def gather_params(self, ops: GroupOps, what: str) -> None:
        """FSDP2 all-gathers in the next forward; with tp > 1, the parameters the tp
        dimension replicates (and their optimizer state) are sent from each tp group's
        first rank to the others, which do not snapshot them."""
        if self.tp == 1:
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name not in self._replicated:
                    continue
                self._broadcast_state(self._tp_ops, p, self.opt.state.get(p, {}),
                                      f"{what}: {name} over tp")
        failed = self.failure()
        if failed is not None:
            raise failed

    def _broadcast_state(self, ops: GroupOps, p, state: dict, what: str) -> None:
        """Parameter `p`'s local shard and its optimizer state from the group's rank 0.
        A tensor off the device (Adam's `step` lives on the CPU) goes through a device
        copy: NCCL sends device memory only."""
        for t in [p, *(state[k] for k in sorted(state) if torch.is_tensor(state[k]))]:
            local = ti.local(t)
            if local.device == self.device:
                ops.broadcast(local, 0, what)
            else:
                moved = local.to(self.device)
                ops.broadcast(moved, 0, what)
                local.copy_(moved)

    def reshard(self, old: list[Snapshot]) -> None:
        """This rank's shards on a new mesh (a job resumed onto another shape) from every
        old rank's: each old shard is put where its snapshot says it lay in the whole
        (`_placement`, the same map a base in DCP's format carries), and this rank takes
        the piece its own placement names. One whole tensor at a time is built."""
        if any(s.header.dcp_placement() is None for s in old):
            kind = old[0].header.opt.get("layout", "flat")
            raise RuntimeError(f"the snapshots to reshard were written by a {kind} layout, "
                               "not a sharded model's: resume them with the model set up as "
                               "it was (parallelize= or not)")
        names = {k for s in old for k in s.tensors if k.startswith(("p.", "o."))}
        params = dict(self.model.named_parameters())
        mine = {}
        for key in sorted(names):
            name = key[2:] if key.startswith("p.") else key[2:].rpartition(".")[0]
            if name not in self._placement:
                continue  # another pipeline stage's
            held = [(s.tensors[key], s.header.opt["dcp"][name]) for s in old if key in s.tensors]
            first = held[0][0]
            if first.dim() == 0:
                mine[key] = first  # a scalar every rank holds alike (Adam's step)
                continue
            size, _ = held[0][1]
            whole = first.new_zeros(size)
            for t, (_, offsets) in held:
                whole[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
            _, offsets = self._placement[name]
            shape = ti.local(params[name]).shape
            mine[key] = whole[tuple(slice(o, o + n) for o, n in zip(offsets, shape))].clone()
        meta = dict(old[0].header.opt)  # (a pipeline's old stages each hold their own names')
        meta["opt_scalars"] = {k: v for s in old for k, v in s.header.opt.get("opt_scalars", {}).items()}
        self.load_unique(mine, meta)

    @property
    def rank(self) -> int:
        return self.group.rank()

    def full_state(self, ops: GroupOps) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.model.named_parameters():
            out[f"model.{name}"] = p.full_tensor().detach().cpu()
            for k, v in self.opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out[f"optim.{k}.{name}"] = (v.full_tensor() if v.dim() else v).detach().cpu()
        failed = self.failure()
        if failed is not None:  # a gather that failed returned garbage
            raise failed
        return out

    def export_meta(self) -> dict:
        return {"layout": "fsdp2",
                "mesh": {"dp_shard": max(1, self.world_size // self.tp), "tp": self.tp},
                "numel": self._numel, "dtype": str(self.master_dtype).removeprefix("torch.")}

    def trained_names(self) -> set[str]:
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    # -- the vote (module doc) -----------------------------------------------------------
    def fingerprinted(self, grads: torch.Tensor) -> dict[str, list[torch.Tensor]] | None:
        """The tp copies: every rank of a tp group holds the same local shards of the
        parameters tensor parallelism leaves whole, and the same optimizer state of them.
        (No reduced gradients: FSDP2 reduces them inside the user's backward; a changed one
        shows in the parameters of the next vote.) None without tp copies."""
        if not self._replicated:
            return None
        params, opt = [], []
        for name, p in self.model.named_parameters():
            if name in self._replicated and p.requires_grad:
                params.append(ti.local(p))
                opt += [ti.local(v) for _, v in sorted(self.opt.state.get(p, {}).items())
                        if torch.is_tensor(v) and v.dim()]
        return {"reduced gradient shards": [], "tp-copied parameter shards": params,
                "tp-copied optimizer state shards": opt}

    def vote_classes(self, world_size: int) -> list[list[int]]:
        return [list(range(d, d + self.tp)) for d in range(0, world_size, self.tp)]

    def rolls_back(self) -> bool:
        return True

    def finds(self) -> frozenset[str]:
        return frozenset({"param"}) if self._replicated else frozenset()

    # -- the user's optimizer ----------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt

    @property
    def scheduler(self):
        return self.sched



class TensorParallelWork(WorkSplit):
    """An FSDP2 model's split of a step: the ranks of one tensor-parallel group (tp
    consecutive ranks) compute the same microbatches (the data-parallel plan, repeated),
    and one of them counts them; its gradients are never a rank's own, so the whole world
    is one failure unit that never keeps an interrupted step's work."""

    def __init__(self, layout: Fsdp2Layout) -> None:
        self.layout, self.tp = layout, layout.tp

    def data_ranks(self, world_size: int) -> int:
        return max(1, world_size // self.tp)

    def plan(self, m: int, world_size: int) -> list[list[int]]:
        dp = quota.plan(m, self.data_ranks(world_size))
        return [dp[r // self.tp] for r in range(world_size)]

    def contributes(self) -> bool:
        group = self.layout.group
        return group is None or group.rank() % self.tp == 0

    def unit_ranks(self, rank: int, world_size: int) -> range:
        return range(world_size)

    def keeps_work(self) -> bool:
        return False

    def min_world_error(self, min_world: int, world_size: int) -> str | None:
        return (f"--min-nproc {min_world}: a plain FSDP2 model keeps its world size "
                f"({world_size} ranks; fully_shard cut each rank's shards for it): give the "
                "job spares (--spares), or replica groups that can leave whole "
                "(setup(dp_shard=...), --dp-shard)")


def _tp_replicated(p) -> bool:
    """Whether every rank of a tp group holds the same values of `p`: a parameter off the
    tp dimension (fully_shard over dp_shard alone), or one tensor parallelism replicates
    (a row-parallel layer's bias)."""
    mesh = getattr(p, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return "tp" not in names or p.placements[names.index("tp")].is_replicate()


def _init_sample(model: nn.Module, n: int = 4096) -> str | None:
    """A digest of the first `n` elements of every parameter: enough to tell ranks that
    built different initial parameters apart, without hashing a large model whole at
    set-up. None for a model on the meta device (torchtitan's way: its parameters are
    initialised after sharding, by the user's parallelize)."""
    params = dict(model.named_parameters())
    if any(p.is_meta for p in params.values()):
        return None
    return state_digest({k: p.detach().reshape(-1)[:n] for k, p in params.items()})


def _placement(model: nn.Module) -> dict[str, list]:
    """Where each parameter's local shard lies in the whole: name -> [global size, offsets]
    (what a base in DCP's format says of it, `checkpoint/dcp_base.py`)."""
    from torch.distributed.tensor import DTensor

    return {name: [list(p.shape), ti.local_offset(p) if isinstance(p, DTensor) else [0] * p.dim()]
            for name, p in model.named_parameters()}

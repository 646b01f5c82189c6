"""`PipelineLayout`: pipeline parallelism, with FSDP2 inside each stage, as HSDP's replica
groups whose members are a pipeline's stages (`hsdp_layout.py`); a pipeline replica is
the unit of failure (ReCoVer's unit once no spare is left).

Ranks. A job of R pipeline replicas of `pp` stages of `dp_shard x tp` ranks each: rank
r * U + (s * dp_shard + d) * tp + t (U = pp x dp_shard x tp: a replica's ranks are
consecutive, stage by stage, a tp group's innermost). Each rank gets a DeviceMesh ("pp",
"dp_shard"[, "tp"]) over its replica's ranks, each dimension a `SwapGroup`: the user's
`split(model, mesh["pp"])` returns this rank's stage module (torchtitan's splitter), then
`parallelize(stage, mesh)` applies tensor parallelism over mesh["tp"] and FSDP2 over
mesh["dp_shard"] (default, without tp: one `fully_shard` of the stage; with dp_shard = 1
a shard is the whole stage). The pipeline's send/recv go over the "pp" group (the ranks
of one (dp_shard, tp) place in every stage: a tp group's ranks run the same pipeline on
the same microbatches), a stage's FSDP2 and tp collectives over "dp_shard" and "tp": all
are the generation's communicators underneath, swapped at a recovery while the stage
module, its parameters and the optimizer stay.

The step (`PipelineSchedule`, pipeline_schedule.py) runs the replica's microbatches
through torch's schedule, which sums their gradients on each stage (FSDP2 reduce-scatters
them over dp_shard at the last microbatch). As HSDP's, the sum across replicas is
phoenixft's own, at the step's end (`reduce` over "dp_replicate": the ranks that hold the
same stage and shard in every replica), into a buffer of its own: a replica's gradients
stay its own until then, so a replica that finished its microbatches keeps them when
another replica fails. Clipping takes the global norm over every stage (each stage's
norm, summed over "pp").

Failures. A rank of one stage dies: its replica's send/recv with it fail (latched, the
schedule runs out without waiting), and the replica redoes its step; the other replicas
keep theirs. With a spare, the spare takes the dead rank's place in its replica (its
stage: the snapshot its peer replica holds, or replica 0's copy), every rank keeps its
process, model and optimizer, and torch's stage and schedule objects are built afresh
for the new generation. Without one, the whole replica leaves (`leaves_whole`), the
others take its microbatches, and `--respawn` brings a replica back.

Snapshots and checkpoints: as HSDP's, replica 0 snapshots each stage's shards (with where
each lies in the whole model: the stage's parameters keep the model's names), so the
snapshots of all ranks together are the model, and resuming onto another depth (pp 4 to 2)
or replica count reshards from them (`reshard` takes the names this rank's stage holds).
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist
from torch import nn

from phoenixft.comm.collectives import GroupOps
from phoenixft.comm.swap_group import sub_group
from phoenixft.config import ConfigError
from phoenixft.train.clip import clip_grad_norm_
from phoenixft.train.hsdp_layout import HsdpLayout, ReplicaGroupWork
from phoenixft.train.pipeline_schedule import Pipeline, PipelineSchedule

PP_DIMS = ("pp", "dp_shard", "tp")


class PipelineLayout(HsdpLayout):
    """Membership, Holdings and StepMath of a pipelined model (see the module doc); its
    `WorkSplit` is `PipelineWork`, its executor `PipelineSchedule`; it votes across
    replicas as HSDP does across groups."""

    def __init__(self, model: nn.Module, factory, spec: Pipeline, parallelize=None,
                 scheduler=None, *, dp_shard: int = 1, tp: int = 1,
                 before_reduce_scatter=None, before_p2p=None) -> None:
        if tp != 1 and parallelize is None:
            raise ConfigError(f"tp={tp} with a pipeline needs parallelize=: tensor parallelism "
                              "inside a stage is the user's parallelize_module over mesh[\"tp\"] "
                              "(then fully_shard over mesh[\"dp_shard\"])")
        self.spec = spec
        self._user_parallelize = parallelize
        super().__init__(model, factory, self._split, scheduler, tp=tp, dp_shard=dp_shard,
                         before_reduce_scatter=before_reduce_scatter)
        self.pp = spec.pp
        self.unit = self.pp * self.dp_shard * self.tp
        self.unit_words = ("pipeline replicas of pp x dp_shard x tp", "Pipeline(pp=), dp_shard=, tp=")
        self._full_names = {n for n, _ in model.named_parameters()}
        # the whole model's: the parameters other stages train are not the rank's fixed
        # tensors (persisted once, as they are; an export would take them over the trained)
        self._trained = {n for n, p in model.named_parameters() if p.requires_grad}
        self._before_p2p = before_p2p
        self._pp_ops: GroupOps | None = None
        self.executor = PipelineSchedule(spec, self.device)

    # -- a generation ------------------------------------------------------------------
    @property
    def stage(self) -> int:
        """This worker's stage, for life (-1 before its first join)."""
        return self._local // (self.dp_shard * self.tp) if self._local >= 0 else -1

    def _split(self, model: nn.Module, mesh) -> None:
        """`Fsdp2Layout.join`'s parallelize: this rank's stage from the user's split, then
        FSDP2 over its dp_shard group; the layout's model is the stage from now on."""
        stages = self.spec.split(model, mesh["pp"])
        stages = [stages] if isinstance(stages, nn.Module) else list(stages)
        if len(stages) != 1:
            raise ConfigError(f"Pipeline.split returned {len(stages)} stage modules for this "
                              "rank; GPipe and 1F1B run one stage per rank")
        stage = stages[0]
        stray = sorted({n for n, _ in stage.named_parameters()} - self._full_names)
        if stray:
            raise ConfigError(f"the stage Pipeline.split returned names parameters the model "
                              f"does not ({stray[0]}, ...): a stage must keep the model's "
                              "parameter names (phoenixft.models.LlamaStage does), so that "
                              "checkpoints are the model's at any pipeline depth")
        self.model = stage
        if self._user_parallelize is not None:
            self._user_parallelize(stage, mesh)
        else:
            from torch.distributed.fsdp import fully_shard
            fully_shard(stage, mesh=mesh["dp_shard"])

    def _make_mesh(self, rank: int, world_size: int):
        from torch.distributed.device_mesh import DeviceMesh
        base = rank - rank % self.unit
        grid = torch.arange(base, base + self.unit).view(self.pp, self.dp_shard, self.tp)
        s, d, t = self._coords(rank)
        self.dims = {"pp": sub_group("pp", grid[:, d, t].tolist(), rank),
                     "dp_shard": sub_group("dp_shard", grid[s, :, t].tolist(), rank)}
        if self.tp > 1:
            self.dims["tp"] = sub_group("tp", grid[s, d].tolist(), rank)
        self.dims["dp_shard"].before_reduce_scatter = self._before_reduce_scatter
        self.dims["pp"].before_p2p = self._on_p2p
        names = PP_DIMS if self.tp > 1 else PP_DIMS[:2]
        return DeviceMesh.from_group(list(self.dims.values()), self.device.type,
                                     mesh=grid if self.tp > 1 else grid[..., 0],
                                     mesh_dim_names=names)

    def _coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, place in its dp_shard group, place in its tp group) of `rank`."""
        s, rest = divmod(rank % self.unit, self.dp_shard * self.tp)
        return (s, *divmod(rest, self.tp))

    def _on_p2p(self, method: str, peer: int) -> None:
        """A send or recv of the "pp" group is about to be issued: activations go to the
        next stage (and come from the previous one), gradients the other way."""
        if self._before_p2p is not None:
            forward = (method == "send") == (peer > self.stage)
            self._before_p2p("forward" if forward else "backward")

    def fault_phases(self) -> frozenset[str]:
        return frozenset({"forward", "backward"})

    def mesh_groups(self, rank: int, world_size: int) -> dict[str, tuple[int, int]]:
        u, local = divmod(rank, self.unit)
        s, d, t = self._coords(rank)
        out = {f"pp.{u}.{d}.{t}": (s, self.pp), f"dp_shard.{u}.{s}.{t}": (d, self.dp_shard),
               f"dp_replicate.{local}": (u, world_size // self.unit)}
        if self.tp > 1:
            out[f"tp.{u}.{s}.{d}"] = (t, self.tp)
        return out

    def bind(self, ops: GroupOps, generation: int, microbatches: int,
             groups: dict[str, GroupOps]) -> None:
        super().bind(ops, generation, microbatches, groups)
        self._pp_ops = next(g for n, g in groups.items() if n.startswith("pp."))
        self._rebuild()

    def relocate(self) -> None:
        super().relocate()
        self._rebuild()

    def _rebuild(self) -> None:
        # (a stage also waits on the other places of its dp_shard group: their pipelines)
        self.executor.rebuild(self.model, self.stage, self.dims["pp"],
                              waits=list(self.dims.values()))

    def trained_names(self) -> set[str]:
        return set(self._trained)

    # -- the step ----------------------------------------------------------------------
    def clip(self, grads: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global norm over every stage: each stage's (over its shards, as HSDP's),
        combined over "pp" (a failure there is latched like the passes')."""
        self._settle_grads()

        def across_stages(norm: torch.Tensor) -> torch.Tensor:
            t = norm.detach().to(self.device, copy=True)
            if math.isinf(norm_type):
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dims["pp"])
                return t
            t = t.pow(norm_type)
            dist.all_reduce(t, group=self.dims["pp"])
            return t.sqrt() if norm_type == 2.0 else t.pow(1.0 / norm_type)

        return clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                               max_norm, norm_type, combine=across_stages)

    # -- snapshots, restores -----------------------------------------------------------
    def unique_meta(self) -> dict:
        return {**super().unique_meta(), "stage": self.stage, "stages": self.pp}

    def full_state(self, ops: GroupOps) -> dict[str, torch.Tensor]:
        """Every stage's whole state on every rank (the digest covers the whole model):
        each stage's, gathered over its shards, is broadcast over "pp" in stage order, its
        names, shapes and dtypes first (as JSON)."""
        mine = super().full_state(ops)
        out: dict[str, torch.Tensor] = {}
        for s in range(self.pp):
            what = f"stage {s}'s state for the final digest"
            if s == self.stage:
                head = json.dumps([[k, list(t.shape), str(t.dtype).removeprefix("torch.")]
                                   for k, t in mine.items()]).encode()
                n = torch.tensor([len(head)], dtype=torch.int64, device=self.device)
            else:
                n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._pp_ops.broadcast(n, s, what)  # (NCCL sends device memory only)
            buf = (torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.device)
                   if s == self.stage else torch.zeros(int(n), dtype=torch.uint8,
                                                       device=self.device))
            self._pp_ops.broadcast(buf, s, what)
            for k, shape, dtype in json.loads(bytes(buf.cpu().tolist()).decode()):
                t = mine[k].to(self.device) if s == self.stage else torch.empty(
                    shape, dtype=getattr(torch, dtype), device=self.device)
                self._pp_ops.broadcast(t, s, what)
                out[k] = t.cpu()
        return out

    def export_meta(self) -> dict:
        meta = super().export_meta()
        meta["mesh"] = {"dp_replicate": self.world_size // self.unit, "pp": self.pp,
                        "dp_shard": self.dp_shard}
        return meta


class PipelineWork(ReplicaGroupWork):
    """A pipelined job's split of a step: every stage of a replica runs the same
    microbatches (the dp_shard ranks of a stage each its own share), the last stage counts
    them, and a replica (pp x dp_shard ranks) is the failure unit, as HSDP's group."""

    def data_index(self, rank: int) -> int:
        """The ranks of a stage's tp group compute the same microbatches, and every stage
        of a replica those of its place in dp_shard."""
        return rank // self.unit * self.dp_shard + self.layout._coords(rank)[1]

    def data_ranks(self, world_size: int) -> int:
        return world_size // self.unit * self.dp_shard

    def default_m(self, world_size: int) -> int:
        """A microbatch per stage for each data-parallel place: 1F1B's least."""
        return self.data_ranks(world_size) * self.layout.pp

    def contributes(self) -> bool:
        """The last stage's ranks, one of each tp group."""
        lay = self.layout
        return lay.stage == lay.pp - 1 and (lay.group is None or lay.rank % lay.tp == 0)

    def peer_classes(self, world_size: int) -> list[list[int]]:
        """The same stage and shard in every replica (stages compute different layers)."""
        return self.layout.vote_classes(world_size)

    def where(self, rank: int, world_size: int) -> str | None:
        return f"stage {self.layout._coords(rank)[0]} of pipeline replica {rank // self.unit}"

    def min_world_error(self, min_world: int, world_size: int) -> str | None:
        if min_world % self.unit:
            return (f"--min-nproc {min_world}: a pipeline replica ({self.unit} ranks: pp x "
                    f"dp_shard x tp) leaves the job whole, so it can only shrink to a multiple of "
                    f"{self.unit}")
        return None

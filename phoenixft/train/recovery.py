"""Recovery: what a member of a new generation restores, and whether the interrupted step
survives. Works on an explicit `RankState` and the generation being joined
(`JoinContext`), never on the user-facing session.

Called collectively by every member after the generation's groups are built.

The restore step t is normally the newest committed snapshot. In-step recovery
(ReCoVer): a member whose work in step t+1 was done on the parameters of step t keeps it
(the gradients of the microbatches it finished) - a survivor interrupted in step t+1
before its optimizer update (computing, or in the gradient all-reduce), or a spare that
computed the dead rank's microbatches of t+1 ahead from the node's snapshots of t
(`Member._speculate`). Every other member (a new one, or one whose state had moved past t)
loads its rank's state of t from the snapshot and starts t+1 afresh. If anyone keeps
work, the step goes on: the ids nobody finished are handed out again. Otherwise every
member simply resumes at t+1.

When the world size changed (shrink without a spare, or grow), the optimizer state is
resharded: every member assembles the full committed state from all old shards and cuts
its new shard. Per-rank tracked objects (samplers, generators) cannot follow a rank that
no longer exists, so they are kept as they are: jobs that shrink or grow should draw
their data as a pure function of the microbatch id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.restore import MEMORY, RestorePlanner
from phoenixft.checkpoint.snapshot import mark_committed
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.comm.collectives import GroupOps
from phoenixft.observe.events import EventLog
from phoenixft.train.rank_state import RankState
from phoenixft.train.step import Step, StepPhase


@dataclass(frozen=True, kw_only=True)
class JoinContext:
    """The generation being joined, as recovery sees it."""

    generation: int
    rank: int
    world_size: int
    ops: GroupOps  # the generation's training group
    store: dist.Store
    planner: RestorePlanner
    events: EventLog
    make_step: Callable[[int, list[int], int], Step]  # (index, ids, m) -> a Step
    resume: bool = False  # the job was started with --resume: a fresh start is an error
    # this rank's failure unit has the same members as in the generation its interrupted
    # step ran in (`WorkSplit.unit_ranks`): only then can it keep that step's work
    unit_intact: bool = True


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """The step every member restores, and the generation and world size that wrote its
    snapshots. step -1: nothing committed yet (a fresh start)."""

    step: int
    world_size: int
    generation: int
    mesh: dict | None = None  # a sharded model's mesh shape when it was persisted


def restore_point(ctx: JoinContext, state: RankState, new_member: bool,
                  ahead: bool = False) -> RestorePoint:
    """Collective: agree on the restore point.

    Normally the newest committed step. But when every survivor stands at the same step s
    past it (a rank died just after step s, before snapshot s was committed), s is used if
    a verified copy of every rank's snapshot s exists somewhere: the survivors hold s in
    memory anyway, and in-step recovery then keeps the step in flight. With no survivor
    at all (every member a spare, e.g. the last survivor died during a recovery) and every
    member having computed ahead from one step s (`ahead`: its state is s, loaded from
    verified snapshots), s is tried the same way, so that work is kept.

    With a persistent tier: when some rank's committed step has no copy left in memory
    anywhere (it died with every holder of its replica), or when a new job resumes
    (nothing committed in its store yet), the newest persisted step whose records all
    verify is used instead (`_persisted_point`)."""
    committed = kv.get_int(ctx.store, Keys.COMMITTED, -1)
    gen, world = state.snap_from
    none = -(1 << 40)
    mine = -1 if new_member else state.step
    a = state.step if ahead else -1
    vec = torch.tensor([committed, mine, -mine if not new_member else none, gen, world,
                        a, -a if ahead else none], dtype=torch.int64)
    ctx.ops.allreduce(vec, "agreeing on the restore step", op=dist.ReduceOp.MAX)
    committed, s_max, s_min, gen, world, a_max, a_min = (int(x) for x in vec)
    s_min, a_min = -s_min, -a_min
    if s_max < 0 and a_max == a_min:  # no survivor; every member computed ahead from a_max
        s_max = s_min = a_max
    if s_max == s_min and s_max > committed and gen >= 0:
        _, table = ctx.planner.copy_table(ctx.ops, ctx.world_size, world, s_max, gen)
        if bool(table.any(dim=0).all()):
            if ctx.rank == 0:  # every rank's s is verified somewhere: commit it for good
                mark_committed(ctx.store, s_max, {"generation": gen, "world_size": world,
                                                  "adopted_by": ctx.generation})
            return RestorePoint(s_max, world, gen)
    if committed < 0:
        return _persisted_point(ctx, None) or _fresh_start(ctx)
    if not ctx.store.check([Keys.commit(committed)]):
        raise IntegrityError(f"step {committed} is marked committed but has no commit record")
    info = kv.get_json(ctx.store, Keys.commit(committed))
    point = RestorePoint(committed, info["world_size"], info["generation"])
    if ctx.planner.persistent is None:
        return point
    _, table = ctx.planner.copy_table(ctx.ops, ctx.world_size, point.world_size, committed,
                                      point.generation)
    if bool((table == MEMORY).any(dim=0).all()):
        return point
    # a rank and every holder of its copies are gone: the planner alone would stop here
    return _persisted_point(ctx, committed) or point


def _fresh_start(ctx: JoinContext) -> RestorePoint:
    """Nothing committed and nothing persisted: a fresh start, except for a job told to
    resume (`--resume`), which stops instead of training from step 0 without a word."""
    if ctx.resume:
        src = ctx.planner.persistent
        raise IntegrityError(
            f"--resume: no step persisted in {src.tier.url if src else 'storage'} could be "
            "read and verified (each failure is named in events.jsonl, restore_source_failed), "
            "so there is nothing to resume from; the job stops rather than train from step 0: "
            "run without --resume to start afresh")
    return RestorePoint(-1, -1, -1)


def _persisted_point(ctx: JoinContext, upto: int | None) -> RestorePoint | None:
    """Collective: the newest persisted step (at most `upto`) whose records every member
    that needs them could read and verify; older manifests are tried when one fails, each
    failure named in the event log. None: nothing persisted (or no persistent tier)."""
    src = ctx.planner.persistent
    if src is None:
        return None
    tried: set[int] = set()
    while True:
        cand = -1
        if ctx.rank == 0:
            steps = [s for s in src.steps() if (upto is None or s <= upto) and s not in tried]
            cand = steps[-1] if steps else -1
        step = int(ctx.ops.broadcast(torch.tensor([cand], dtype=torch.int64), 0,
                                     "choosing a persisted step")[0])
        if step < 0:
            return None
        tried.add(step)
        manifest = src.manifest(step)
        world = manifest["world_size"]
        need = ([ctx.rank] if world == ctx.world_size else
                list(range(world)) if ctx.rank == 0 else [])
        ok = 1
        for r in need:
            try:
                src.open(r, step)
            except (IntegrityError, KeyError) as exc:
                ok = 0
                ctx.events.emit("restore_source_failed", tier="persistent", step=step, rank=r,
                                error=str(exc)[:500])
        flag = ctx.ops.allreduce(torch.tensor([ok], dtype=torch.int32), "verifying persisted "
                                 "records", op=dist.ReduceOp.MIN)
        if int(flag[0]) == 1:
            if ctx.rank == 0 and not ctx.store.check([Keys.commit(step)]):
                # committed for this store too: later snapshots wait on its marker
                mark_committed(ctx.store, step, {"generation": manifest["generation"],
                                                 "world_size": world, "restored_from": "persistent"})
            return RestorePoint(step, world, manifest["generation"],
                                mesh=(manifest.get("model") or {}).get("meta", {}).get("mesh"))


def restore(ctx: JoinContext, state: RankState, point: RestorePoint, in_flight: Step | None,
            new_member: bool) -> tuple[str, Step | None]:
    """Collective. Returns (restore source, the step to resume inside, or None)."""
    t = point.step
    if in_flight is not None and in_flight.speculative is not None:
        ahead, in_flight.speculative = in_flight.speculative, None
        if ahead != (t, point.generation):  # a spare computed ahead from another step:
            in_flight.done.clear()  # drop that work (its gradients are zeroed below)
            in_flight.loss_sum = 0.0
            new_member, in_flight = True, None  # and join as a new member
    keep = (not new_member and in_flight is not None and in_flight.index == t + 1
            and in_flight.phase != StepPhase.UPDATE and state.layout.work.keeps_work()
            and ctx.unit_intact)
    flags = torch.zeros(ctx.world_size)
    flags[ctx.rank] = float(keep)
    ctx.ops.allreduce(flags, "agreeing on in-step recovery")
    # a failure unit (an HSDP replica group) keeps its work only if all of it does
    unit = state.layout.work.unit_ranks
    kept = [all(flags[x] > 0 for x in unit(r, ctx.world_size)) for r in range(ctx.world_size)]
    keep = kept[ctx.rank]
    in_step = any(kept)  # some member keeps finished microbatches of step t+1
    # Every member keeps (survivors that had not updated, a spare that loaded every rank's
    # shard of t to compute ahead): each already holds t's parameters, bit for bit, and
    # the all-gather would write the same bytes again (25 ms of a recovery, 4 workers).
    everyone_holds_t = all(kept)
    mesh = state.layout.state.export_meta().get("mesh")
    if point.world_size == ctx.world_size and (point.mesh is None or point.mesh == mesh):
        source = _same_world(ctx, state, point, load_rank_state=not keep,
                             gather=not everyone_holds_t)
    else:
        source = _resharded(ctx, state, point)
    state.step = t
    if not keep:  # a new member, or one whose work was past t (or is dropped): from t
        state.zero_grad()
        if in_flight is not None:  # its gradients are gone: so is the record of them (a
            in_flight.done.clear()  # later join, if this one fails, must not keep them)
            in_flight.loss_sum = 0.0
    if not in_step:
        return source, None
    return source, _resume_step(ctx, state, t + 1, in_flight if keep else None,
                                point.world_size)


def _same_world(ctx: JoinContext, state: RankState, point: RestorePoint,
                load_rank_state: bool, gather: bool = True) -> str:
    t = point.step
    snap, source = ctx.planner.restore(ctx.ops, rank=ctx.rank, world_size=ctx.world_size,
                                       step=t, generation=point.generation)
    if snap.header.numel != state.layout.state.numel:
        raise RuntimeError(f"snapshot of step {t} holds {snap.header.numel} parameters, the model "
                           f"has {state.layout.state.numel}: was the model changed between runs?")
    state.layout.state.load_unique(snap.tensors, snap.header.opt)
    if load_rank_state:
        state.load_rank_local(snap)
    if gather:
        state.layout.state.gather_params(ctx.ops, "parameter all-gather (restore)")
    return source


def _resharded(ctx: JoinContext, state: RankState, point: RestorePoint) -> str:
    old = ctx.planner.gather_old_shards(
        ctx.ops, rank=ctx.rank, world_size=ctx.world_size, old_world=point.world_size,
        step=point.step, generation=point.generation)
    if old[0].header.numel != state.layout.state.numel:
        raise RuntimeError(f"snapshot of step {point.step} holds {old[0].header.numel} parameters, "
                           f"the model has {state.layout.state.numel}: was the model changed between runs?")
    state.layout.state.reshard(old)
    if state.tracked.tensors():
        ctx.events.emit("tracked_not_resharded", step=point.step,
                        note="per-rank tracked state stays with each process across a "
                             "world-size change; draw data from microbatch ids")
    mesh = state.layout.state.export_meta().get("mesh")
    if point.mesh and mesh and point.mesh != mesh:  # (a sharded model onto another mesh shape)
        shape = "x".join  # dp_shard x tp
        return (f"resharded_{shape(str(v) for v in point.mesh.values())}_to_"
                f"{shape(str(v) for v in mesh.values())}")
    return f"resharded_{point.world_size}_to_{ctx.world_size}"


def _resume_step(ctx: JoinContext, state: RankState, index: int, in_flight: Step | None,
                 old_world: int) -> Step:
    """Hand the interrupted step's unfinished microbatch ids to the new members."""
    m_step = state.m_for(old_world)
    done = torch.zeros(m_step)
    if in_flight is not None:
        for j in in_flight.done:
            done[j] = 1.0
    ctx.ops.allreduce(done, "collecting finished microbatches")
    remaining = [j for j in range(m_step) if done[j] == 0]
    assigned = state.layout.work.reassign(remaining, m_step, old_world, ctx.world_size)
    mine = assigned[ctx.rank]
    if in_flight is None:
        st = ctx.make_step(index, mine, m_step)
    else:
        st = in_flight
        st.ids = list(st.done) + mine
    st.phase, st.retry = StepPhase.COMPUTE, True
    st.reduced, st.failure, st.grads, st.loss = False, None, None, None
    ctx.events.emit("in_step_recovery", step=index, rank=ctx.rank, kept=sorted(st.done),
                    recompute=mine, gen=ctx.generation)
    return st

"""What protects a generation's state: its snapshot thread (shared-memory slots, replicas,
commit) and, with `--persist`, its background persister, wired for one member of one
generation. Who holds whose replica is decided here too (`holders`)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from phoenixft.checkpoint.persist import JobInfo, Persister, write_fixed
from phoenixft.checkpoint.snapshot import Snapshotter
from phoenixft.cluster.membership import Plan, replica_holders
from phoenixft.comm.collectives import Interrupt
from phoenixft.faults.inject import Injector
from phoenixft.observe.events import EventLog
from phoenixft.train.config import SessionConfig
from phoenixft.train.fingerprints import votes_on_state
from phoenixft.train.rank_state import RankState


def holders(plan: Plan, replicas: int | None) -> dict[int, list[int]]:
    """Who holds whose replica in this generation (`SessionConfig.replicas`: None is one
    on another node, none in a one-node job; K is K peers, other nodes first)."""
    k = replicas
    return replica_holders(plan.nodes, min(1 if k is None else k, plan.world_size - 1),
                           same_node=k is not None)


def start_persister(tier, cfg: SessionConfig, state: RankState, *, plan: Plan, rank: int,
                    job_id: str, connect: Callable[[], dist.Store],
                    events: EventLog) -> Persister | None:
    """This generation's persister, or None without a persistent tier (rank 0 also
    writes the model's untrained tensors once, for `ckpt export`)."""
    if tier is None:
        return None
    g = plan.generation
    model = {"meta": state.export_meta(), "fixed": None}
    if rank == 0:
        model.update(write_fixed(tier, g, state.fixed_tensors()))
    return Persister(tier, rank=rank, shm_dir=cfg.shm_dir,
                     cfg=cfg.persistence,
                     job=JobInfo(job_id=job_id, generation=g, world_size=plan.world_size,
                                 model=model, voted=votes_on_state(cfg.fingerprints, state.layout,
                                                                   plan.world_size)),
                     connect=connect,
                     emit=lambda event, **kw: events.emit(event, rank=rank, gen=g, **kw))


def start_snapshotter(cfg: SessionConfig, *, plan: Plan, rank: int, rep_pg,
                      connect: Callable[[], dist.Store], interrupt: Interrupt,
                      injector: Injector, events: EventLog,
                      on_damaged_source: Callable[[int, str], None],
                      persister: Persister | None,
                      on_copied: Callable[[int, dict], None] | None = None) -> Snapshotter:
    """This generation's snapshot thread for `rank`: its replica holders and sources,
    fault points, and the persister fed after each copy."""
    g, hs = plan.generation, holders(plan, cfg.snapshots.replicas)

    def on_commit(step: int, t: float) -> None:
        if step % 10 == 0:
            events.emit("snapshot_committed", step=step, gen=g)

    return Snapshotter(
        shm_dir=cfg.shm_dir, rank=rank, generation=g, connect=connect, rep_pg=rep_pg,
        holders=hs[rank], sources=[r for r, h in hs.items() if rank in h],
        world_size=plan.world_size, nodes=plan.nodes, interrupt=interrupt,
        timeout_s=cfg.timeouts.collective_timeout_s, on_commit=on_commit,
        fault=lambda step, phase: injector.at_step(rank, step, phase),
        on_degraded=lambda detail: events.emit("snapshot_degraded", rank=rank, gen=g,
                                               detail=detail),
        on_damaged_source=on_damaged_source,
        after_copy=persister.offer if persister is not None else None,
        on_copied=on_copied,
        garble=lambda step: injector.garbles(rank, step),
        rot=lambda step: injector.rots(rank, step))

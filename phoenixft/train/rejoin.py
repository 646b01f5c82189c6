"""What a member of a new generation restores, and whether the interrupted step survives.

Called collectively by every member after the generation's groups are built and the
restore step t (the newest committed snapshot) is agreed.

In-step recovery (ReCoVer): if every surviving member was interrupted in step t+1 before
its optimizer update (waiting for snapshot t's commit or in the gradient all-reduce), the
step is not
thrown away. Survivors keep the gradients of the microbatches they finished; the ids
nobody finished (the dead ranks' ones) are handed out again; only new members (spares)
load per-rank state from the snapshot. Otherwise every member rolls back to t.

When the world size changed (shrink without a spare, or grow), the optimizer state is
resharded: every member assembles the full committed state from all old shards and cuts
its new shard. Per-rank tracked objects (samplers, generators) cannot follow a rank that
no longer exists, so they are kept as they are: jobs that shrink or grow should draw
their data as a pure function of the microbatch id.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from phoenixft.checkpoint.restore import copy_table, gather_resharded, restore_snapshot
from phoenixft.checkpoint.snapshot import commit_key
from phoenixft.cluster import store as kv
from phoenixft.cluster.store import Keys
from phoenixft.comm.collectives import wait_work
from phoenixft.train import quota
from phoenixft.train.step import Step

if TYPE_CHECKING:
    from phoenixft.train.session import Session


def _allreduce(sess: Session, t: torch.Tensor, what: str) -> torch.Tensor:
    wait_work(sess._pg.allreduce([t]), sess.interrupt, sess.cfg.collective_timeout_s, what)
    return t


def restore_point(sess: Session, new_member: bool) -> tuple[int, int, int]:
    """Collective: the step every member restores, with the world size and generation
    that wrote its snapshots. -1 = nothing committed yet (a fresh start).

    Normally the newest committed step. But when every survivor stands at the same step s
    past it (a rank died just after step s, before snapshot s was committed), s is used if
    a verified copy of every rank's snapshot s exists somewhere: the survivors hold s in
    memory anyway, and in-step recovery then keeps the step in flight."""
    committed = kv.get_int(sess.store, Keys.COMMITTED, -1)
    gen, world = sess._snap_from
    mine = -1 if new_member else sess.step
    vec = torch.tensor([committed, mine, -mine if not new_member else -(1 << 40), gen, world],
                       dtype=torch.int64)
    wait_work(sess._pg.allreduce([vec], op=dist.ReduceOp.MAX), sess.interrupt,
              sess.cfg.collective_timeout_s, "agreeing on the restore step")
    committed, s_max, s_min, gen, world = (int(x) for x in vec)
    s_min = -s_min
    if s_max == s_min and s_max > committed and gen >= 0:
        _, table = copy_table(sess._pg, sess.cfg.shm_dir, sess.world_size, world, s_max, gen,
                              sess.interrupt, sess.cfg.collective_timeout_s)
        if bool(table.any(dim=0).all()):
            if sess.rank == 0:  # every rank's s is verified somewhere: commit it for good
                kv.raise_to(sess.store, Keys.COMMITTED, s_max)
                sess.store.set(commit_key(s_max), json.dumps(
                    {"generation": gen, "world_size": world, "adopted_by": sess.generation}))
            return s_max, world, gen
    if committed < 0:
        return -1, -1, -1
    info = json.loads(sess.store.get(commit_key(committed)))
    return committed, info["world_size"], info["generation"]


def restore(sess: Session, t: int, in_flight: Step | None, new_member: bool, *,
            old_world: int, old_gen: int) -> tuple[str, Step | None]:
    """Collective. Returns (restore source, the step to resume inside, or None)."""
    keep = (not new_member and in_flight is not None and in_flight.index == t + 1
            and in_flight.phase != "update")
    flags = _allreduce(sess, torch.tensor([float(keep), float(not new_member)]),
                       "agreeing on in-step recovery")
    in_step = flags[1] > 0 and flags[0] == flags[1]
    load_rank_state = new_member or not in_step
    if old_world == sess.world_size:
        source = _same_world(sess, t, old_gen, load_rank_state)
    else:
        source = _resharded(sess, t, old_gen, old_world)
    sess.step = t
    if not in_step:
        sess._model.zero_grad(set_to_none=True)
        return source, None
    if new_member:
        sess._model.zero_grad(set_to_none=True)
    return source, _resume_step(sess, t + 1, in_flight, old_world)


def _same_world(sess: Session, t: int, old_gen: int, load_rank_state: bool) -> str:
    slot, hdr, source = restore_snapshot(
        sess._pg, rank=sess.rank, world_size=sess.world_size, step=t, shm_dir=sess.cfg.shm_dir,
        interrupt=sess.interrupt, timeout_s=sess.cfg.collective_timeout_s, generation=old_gen)
    if hdr["numel"] != sess._flat.numel:
        raise RuntimeError(f"snapshot of step {t} holds {hdr['numel']} parameters, the model has "
                           f"{sess._flat.numel}: was the model changed between runs?")
    tensors = slot.tensors(hdr)
    sess._opt.load_state(tensors, hdr["opt"])
    if load_rank_state:
        torch.set_rng_state(tensors["rng.torch"].clone())
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"].clone(), sess._flat.device)
        sess.tracked.load(tensors, hdr["tracked"])
        v, state, gauss = hdr["python_random"]
        random.setstate((v, tuple(state), gauss))
    wait_work(sess._pg._allgather_base(sess._flat.buf, sess._opt.shard.detach()),
              sess.interrupt, sess.cfg.collective_timeout_s, "parameter all-gather (restore)")
    return source


def _resharded(sess: Session, t: int, old_gen: int, old_world: int) -> str:
    full, hdr0 = gather_resharded(
        sess._pg, rank=sess.rank, world_size=sess.world_size, old_world=old_world, step=t,
        generation=old_gen, shm_dir=sess.cfg.shm_dir, interrupt=sess.interrupt,
        timeout_s=sess.cfg.collective_timeout_s)
    n = sess._flat.numel
    start, end = sess._opt.start, sess._opt.end
    padded = sess._flat.buf.numel()

    def fit(x: torch.Tensor) -> torch.Tensor:  # old padding -> new padding
        out = torch.zeros(padded, dtype=x.dtype)
        out[:n] = x[:n]
        return out

    tensors = {}
    for name, x in full.items():
        tensors[name] = x if x.dim() == 0 else fit(x)[start:end]
    sess._opt.load_state(tensors, hdr0["opt"])
    with torch.no_grad():
        sess._flat.buf.copy_(fit(full["param_shard"]).to(sess._flat.buf.device))
    if sess.tracked.tensors():
        sess.events.emit("tracked_not_resharded", step=t,
                         note="per-rank tracked state stays with each process across a "
                              "world-size change; draw data from microbatch ids")
    return f"resharded_{old_world}_to_{sess.world_size}"


def _resume_step(sess: Session, index: int, in_flight: Step | None, old_world: int) -> Step:
    """Hand the interrupted step's unfinished microbatch ids to the new members."""
    m_step = sess._m_for(old_world)
    done = torch.zeros(m_step)
    if in_flight is not None:
        for j in in_flight.done:
            done[j] = 1.0
    done = _allreduce(sess, done, "collecting finished microbatches")
    remaining = [j for j in range(m_step) if done[j] == 0]
    assigned = quota.reassign(remaining, quota.plan(m_step, old_world), sess.world_size)
    mine = assigned[sess.rank]
    if in_flight is None:
        st = Step(sess, index, mine, m_step)
    else:
        st = in_flight
        st.ids = list(st.done) + mine
    st.phase, st.retry = "compute", True
    sess.events.emit("in_step_recovery", step=index, rank=sess.rank, kept=sorted(st.done),
                     recompute=mine, gen=sess.generation)
    return st

"""What the leader tells people: `status.json` while the job runs, `summary.json` and
`audit.jsonl` at its end. Read from the store and the leader's own records; decides
nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from phoenixft.cluster import protocol
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan, PlanKind


def status(store: dist.Store, plan: Plan | None, workers: dict, failures: int,
           quarantined: list[str] = ()) -> dict:
    """The job now; `quarantined`: workers replaced as stragglers or for silent data
    corruption, never re-admitted (their role says so)."""
    members = []
    rank_of = {w: r for r, w in plan.members.items()} if plan else {}
    for w in sorted(workers.values(), key=lambda w: (rank_of.get(w.wid, 1 << 30), w.wid)):
        role = ("active" if w.wid in rank_of else "quarantined" if w.wid in quarantined else
                "failed" if w.state in ("dead", "fenced") else "spare")  # WorkerState values
        members.append({"rank": rank_of.get(w.wid), "role": role,
                        "pid": w.pid, "state": w.state, "wid": w.wid, "node": w.node})
    return {"generation": plan.generation if plan else -1,
            "kind": plan.kind if plan else "starting",
            "world_size": plan.world_size if plan else 0,
            "step": kv.get_int(store, Keys.PROGRESS, 0),
            "committed_step": kv.get_int(store, Keys.COMMITTED, -1),
            "members": members, "failures": failures, "quarantined": list(quarantined),
            "updated": time.time()}


def recoveries(store: dist.Store, last_generation: int, failures: list) -> list[dict]:
    """One entry per replaced rank of every generation that finished recovering."""
    out = []
    kinds = {f.wid: f for f in failures}
    for gen in range(1, last_generation + 1):
        key = Keys.recovered(gen)
        if not store.check([key]):
            continue
        rec = kv.get_json(store, key)
        plan = Plan.from_json(store.get(Keys.plan(gen)))
        for rank, dead in sorted(plan.replaced.items()):
            f = kinds.get(dead)
            out.append({"gen": gen, "rank": rank, "failed_worker": dead,
                        "replacement": plan.members.get(rank),
                        # a straggler swapped for a spare did not fail
                        "kind": f.kind if f else ("straggler" if plan.reason.startswith(
                            "straggler") else "unknown"),
                        "detect_s": f.detect_s if f else None,
                        "recover_s": rec["recover_s"], "lost_steps": rec["lost_steps"],
                        "restore_step": rec["restore_step"],
                        "source": restore_source(store, plan, rank)})
    return out


def restore_source(store: dist.Store, plan: Plan, rank: int) -> str | None:
    """Where replaced `rank` of generation `plan` took its state from (its node's
    `Keys.sources`); a rank a shrink removed is told by rank 0's source."""
    rank = rank if rank < plan.world_size else 0
    node = plan.nodes.get(rank)
    got = None if node is None else protocol.restore_sources(store, plan.generation, node)
    return None if got is None else got.get(rank)


def summary(store: dist.Store, run_dir: Path, last_generation: int, failures: list,
            wall_s: float, aborted: str | None, problems: list[str]) -> dict:
    # a job stopped before its end (a signal, an abort) ends at its last completed step
    final_step = kv.get_int(store, Keys.result("final_step"), -1)
    if final_step < 0:
        final_step = kv.get_int(store, Keys.PROGRESS, 0) or -1
    digest = (store.get(Keys.result("digest")).decode()
              if store.check([Keys.result("digest")]) else None)
    first = kv.get_int(store, Keys.RESUMED_FROM, 0) + 1  # a resumed job ran from there
    losses = []
    if final_step >= first:
        steps = range(first, final_step + 1)
        losses = [float(v) for v in store.multi_get([Keys.loss(s) for s in steps])]
        audit = store.multi_get([Keys.audit(s) for s in steps])
        with (run_dir / "audit.jsonl").open("w") as f:
            for s, ids in zip(steps, audit):
                f.write(json.dumps({"step": s, "microbatches": json.loads(ids)}) + "\n")
    job_id = store.get(Keys.JOB_ID).decode() if store.check([Keys.JOB_ID]) else None
    return {"job_id": job_id, "final_step": final_step, "final_state_digest": digest,
            "first_step": first, "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "failures": [f.__dict__ for f in failures],
            "recoveries": recoveries(store, last_generation, failures),
            "generations": last_generation, "wall_s": round(wall_s, 3), "aborted": aborted,
            "problems": problems,
            "persisted_step": kv.get_int(store, Keys.PERSISTED, -1),
            "committed_step": kv.get_int(store, Keys.COMMITTED, -1),
            "resumed_from": kv.get_int(store, Keys.RESUMED_FROM, -1),
            # the final state in DCP's default format (a job with --persist), or why not
            "checkpoint": _text(store, Keys.result("checkpoint")),
            "checkpoint_error": _text(store, Keys.result("checkpoint_error")),
            "microbatch_passes": kv.get_int(store, Keys.MB_COUNT, 0),
            "world_sizes": world_sizes(store, last_generation)}


def _text(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def world_sizes(store: dist.Store, last_generation: int) -> list[int]:
    out = []
    for gen in range(last_generation + 1):
        if store.check([Keys.plan(gen)]):
            p = Plan.from_json(store.get(Keys.plan(gen)))
            if p.kind is PlanKind.RUN:
                out.append(p.world_size)
    return out

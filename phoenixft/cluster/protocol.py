"""The store side of a worker's and an agent's part in the generation protocol, as functions.

The training member (`train/member.py`), the agent (`launch/agent.py`) and the control
plane benchmark's hollow members (`bench/hollow.py`) call these same functions, so the
benchmark measures the protocol jobs run, not a model of it.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan, PlanKind


def register_worker(store: dist.Store, wid: str, node: int, pid: int) -> None:
    """A worker joins the job: its heartbeat counter exists from here on (so the leader,
    which watches it once `worker/{wid}` is set, reads every counter in one request),
    then its registration."""
    store.add(Keys.heartbeat(wid), 0)
    kv.set_json(store, Keys.worker(wid), {"pid": pid, "node": node})
    store.add(Keys.REGISTERED, 1)


def register_node(store: dist.Store, node: int, nproc: int, spares: int, pid: int) -> None:
    """An agent joins the job with `nproc` workers and `spares` spares."""
    kv.set_json(store, Keys.node(node), {"nproc": nproc, "spares": spares, "pid": pid})


def file_report(store: dist.Store, body: dict) -> int:
    """A failure report for the leader (`Keys.report`): its number is taken first, then
    its body written (the leader reads them in order). Returns its number."""
    i = store.add(Keys.REPORTS, 1)
    kv.set_json(store, Keys.report(i), {"t": time.time(), **body})
    return i


def newest_plan(store: dist.Store, g: int) -> Plan:
    """The newest plan at generation >= g (plan g must exist)."""
    while store.check([Keys.plan(g + 1)]):
        g += 1
    return Plan.from_json(store.get(Keys.plan(g)))


def joined(store: dist.Store, generation: int, rank: int, source: str) -> None:
    """A member of `generation` (> 0) restored its state: where from (`Keys.source`)."""
    store.set(Keys.source(generation, rank), source)


def fenced(store: dist.Store, wids: list[str]) -> list[str]:
    """Agent, every tick: which of its live workers the leader fenced (`Keys.fence`)."""
    return [w for w in wids if store.check([Keys.fence(w)])]


def final_plan(store: dist.Store) -> Plan | None:
    """Agent that does not lead, every tick: the job's last plan if it ended (done or
    abort), else None."""
    if not store.check([Keys.plan(0)]):
        return None
    plan = newest_plan(store, 0)
    return plan if plan.kind is not PlanKind.RUN else None

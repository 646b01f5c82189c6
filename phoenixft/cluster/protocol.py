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
from phoenixft.cluster.membership import Plan
from phoenixft.cluster.node_tally import NodeShare


def register_worker(store: dist.Store, wid: str, node: int, pid: int) -> None:
    """A worker joins the job (it beats in its node's shared memory already)."""
    kv.set_json(store, Keys.worker(wid), {"pid": pid, "node": node})
    store.add(Keys.REGISTERED, 1)


def register_node(store: dist.Store, node: int, nproc: int, spares: int, pid: int) -> None:
    """An agent joins the job with `nproc` workers and `spares` spares; its node's beat
    counter exists from here on (the leader reads them all in one request)."""
    store.add(Keys.node_beat(node), 0)
    kv.set_json(store, Keys.node(node), {"nproc": nproc, "spares": spares, "pid": pid})


def file_report(store: dist.Store, body: dict) -> int:
    """A failure report for the leader (`Keys.report`): its number is taken first, then
    its body written (the leader reads them in order). Returns its number."""
    i = store.add(Keys.REPORTS, 1)
    kv.set_json(store, Keys.report(i), {"t": time.time(), **body})
    return i


def newest_plan(store: dist.Store, g: int, known: Plan | None = None,
                memo: dict | None = None) -> Plan:
    """The newest plan at generation >= g (plan g must exist). A caller that holds the
    plan before it (`known`) reads only its change (`Keys.plan_change`); `memo` keeps the
    plans built from changes for callers that share them (the benchmark's hollow
    members of one process)."""
    while store.check([Keys.plan(g + 1)]):
        g += 1
    if known is not None and known.generation == g:
        return known
    return read_plan(store, g, known, memo)


def read_plan(store: dist.Store, g: int, known: Plan | None = None,
              memo: dict | None = None) -> Plan:
    """Plan g (it exists): from its change when `known` is plan g - 1, else whole. Every
    caller reads the bytes; with `memo`, callers sharing it parse them once."""
    if known is not None and known.generation == g - 1 and g > 0:
        # (plan g >= 1 and its change are set in one request by the leader, which always
        # holds plan g - 1 when it publishes g: the change is there)
        raw = store.get(Keys.plan_change(g))
        if memo is not None and g in memo:
            return memo[g]
        plan = known.changed(raw)
    else:
        raw = store.get(Keys.plan(g))
        if memo is not None and g in memo:
            return memo[g]
        plan = Plan.from_json(raw)
    if memo is not None:
        memo[g] = plan
    return plan


def sources_read(plan: Plan, node: int) -> bool:
    """Whether the members of `plan` on `node` record their restore sources: only a node
    holding a replaced rank, or rank 0 (a shrink or a grow is told by rank 0's source), is
    ever read (the summary, the console); the others skip the request."""
    return any(plan.nodes.get(r) == node for r in (*plan.replaced, 0))


def joined(store: dist.Store, plan: Plan, rank: int, source: str, node: NodeShare) -> None:
    """A member of generation `plan` (> 0) restored its state: where from. The node's
    members tell it together: the last of them to join writes the node's record
    (`Keys.sources`), one request a node, and only where it is read (`sources_read`)."""
    if not sources_read(plan, node.node):
        return
    generation = plan.generation
    lines = node.offer(f"src-{generation}", f"{rank} {source}")
    if lines is not None:
        kv.set_json(store, Keys.sources(generation, node.node),
                    dict(line.split(" ", 1) for line in lines))


def restore_sources(store: dist.Store, generation: int, node: int) -> dict[int, str] | None:
    """Where each member of `generation` on `node` restored from (None until the node's
    last member joined)."""
    key = Keys.sources(generation, node)
    if not store.check([key]):
        return None
    return {int(r): s for r, s in kv.get_json(store, key).items()}


def fenced(store: dist.Store, node: int, wids: list[str], seen: int) -> tuple[list[str], int]:
    """Agent, every tick: which of its live workers the leader fenced (`Keys.fence`), and
    the node's fence count to pass as `seen` next time. One request a tick: the workers'
    own keys are read only when the node's count (`Keys.fences`) moved."""
    n = store.add(Keys.fences(node), 0)
    if n == seen:
        return [], n
    return [w for w in wids if store.check([Keys.fence(w)])], n


def latest_plan(store: dist.Store, known: Plan | None, memo: dict | None = None) -> Plan | None:
    """Agent that does not lead, every tick: the job's newest plan (None before the
    first), read as changes to `known`, the one it returned last: one request a tick
    while nothing changes."""
    if known is None and not store.check([Keys.plan(0)]):
        return None
    return newest_plan(store, known.generation if known else 0, known, memo)

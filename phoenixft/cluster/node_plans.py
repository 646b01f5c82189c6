"""Plans handed to a node's workers by its agent: the store is read once a node, not once a
worker.

The agent's `PlanRelay` thread waits on the store for each next plan (one blocking wait
on its own connection), reads it (the change to the plan before, `protocol.read_plan`)
and writes it whole into the node's shared memory (`NodePlans.publish`: a file per
generation, written aside and renamed in place, so a reader sees all of it or nothing).
The node's workers wait for those files (`NodePlans.wait`: a stat every `POLL_S`), so a
new generation costs the store two requests a node instead of two a worker, and the first
plan's bytes are read once a node.

Every generation is relayed in order (never skipped), so a worker that waits for plan g
finds it, then any newer one. A worker started by something else than an agent (a
standalone session, the benchmark's own readers) reads the store as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from phoenixft.cluster import protocol
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan, PlanKind

POLL_S = 0.005  # how often a waiting worker looks for the next plan's file (a stat)
RELAY_SLICE_S = 2.0  # the relay's store wait at a time (a request and its cancellation)


class NodePlans:
    """The plans of one node's shared memory (`directory`, created on first publish)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def path(self, g: int) -> Path:
        return self.dir / f"{g}.json"

    def publish(self, plan: Plan, text: str | None = None) -> None:
        """Agent: plan g's file, whole (the node's workers parse it locally); `text`: the
        plan's JSON when the caller has it already."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{plan.generation}.{os.getpid()}.tmp"
        tmp.write_text(plan.to_json() if text is None else text)
        os.replace(tmp, self.path(plan.generation))

    def has(self, g: int) -> bool:
        return self.path(g).exists()

    def wait(self, g: int, timeout_s: float,
             stop: Callable[[], bool] | None = None) -> bool:
        """Until a plan at generation >= g is here (True) or `timeout_s` passed or `stop()`
        says so (False). Plan g's own file is looked for every `POLL_S`; a later one's
        every 0.5 s (plan g's may be gone: the node's shared memory deleted under it)."""
        deadline = time.monotonic() + timeout_s
        scan = time.monotonic() + 0.5
        while not self.has(g):
            now = time.monotonic()
            if now >= deadline or (stop is not None and stop()):
                return False
            if now >= scan:
                scan = now + 0.5
                if self._any_from(g):
                    return True
            time.sleep(POLL_S)
        return True

    def _any_from(self, g: int) -> bool:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return False
        return any(n.endswith(".json") and n[:-5].isdigit() and int(n[:-5]) >= g
                   for n in names)

    def read(self, g: int, known: Plan | None = None) -> Plan:
        """Plan g (its file is here); `known` if it is that plan already."""
        if known is not None and known.generation == g:
            return known
        return Plan.from_json(self.path(g).read_bytes())

    def newest(self, g: int, known: Plan | None = None) -> Plan:
        """The newest plan at generation >= g (plan g's file is here)."""
        while self.has(g + 1):
            g += 1
        return self.read(g, known)


class PlanRelay:
    """The agent's thread that relays every plan of the job into its node's `NodePlans`,
    in order, and keeps the newest (`latest`) for the agent itself."""

    def __init__(self, connect, plans: NodePlans) -> None:
        self._connect = connect  # () -> a store connection of the relay's own
        self.plans = plans
        self.latest: Plan | None = None
        self.error: BaseException | None = None  # why it stopped early (the store is gone)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phoenixft-plan-relay",
                                        daemon=True)

    def start(self) -> PlanRelay:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            store = self._connect()
            g = 0
            while not self._stop.is_set():
                if not kv.wait_for(store, [Keys.plan(g)], RELAY_SLICE_S):
                    continue
                plan = relay_one(store, self.plans, g, self.latest)
                self.latest = plan
                if plan.kind is not PlanKind.RUN:
                    return  # the job's last plan
                g += 1
        except Exception as exc:  # noqa: BLE001 - the store is gone (the agent sees it too)
            self.error = exc


def relay_one(store: dist.Store, plans: NodePlans, g: int, known: Plan | None,
              memo: dict | None = None) -> Plan:
    """Read plan g (its change, when `known` is plan g - 1) and hand it to the node: one
    request. `memo`: plans already built, shared by the benchmark's simulated nodes."""
    plan = protocol.read_plan(store, g, known, memo)
    if memo is None:
        plans.publish(plan)
    else:  # (the plan's JSON once for all the nodes sharing the memo)
        text = memo.get(("json", g)) or memo.setdefault(("json", g), plan.to_json())
        plans.publish(plan, text)
    return plan

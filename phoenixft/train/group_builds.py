"""Each generation's process groups (training, replication), from their build to their
burial: the part of the generation protocol that owns gloo/NCCL group objects.

Builds start early, once per generation: a survivor's plan watcher starts them as soon
as the plan appears, while the training thread still finishes the microbatch it is
computing (it only sees the failure at the step's all-reduce), and a spare before it
computes ahead; gloo connects the members when all of them have called, so the group
forms while they compute instead of after (about 0.1 s of every recovery with 4 workers
on 2 cores). Otherwise they start at the join. Each build gets its own store connection:
an abandoned build (a member died mid-join) keeps blocking in a store wait, and a shared
client would queue every later call behind it.

Builds only go forward: a join of a generation older than one whose builds began is
stale (raises GenerationChanged), and a generation's groups are never built twice (a
second build under the same store prefix would meet the first one's peers; a generation
whose groups were buried after a failed join is not built again either).

Burial: kept alive, a gloo group whose peer died spins its transport thread (epoll keeps
reporting the dead peer's socket, which gloo no longer reads): half a core for the rest
of the job, measured as 20% slower steps after one recovery with 4 workers on 2 cores.
`abort()` releases its worker threads from the abandoned collective, so the destructor
(which joins them, and closes the sockets) is quick; it still runs on a helper thread,
without the GIL (torch releases it in process-group destructors), in case a worker
thread is slow to leave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan
from phoenixft.comm.collectives import GenerationChanged, Interrupt, Pending
from phoenixft.comm.groups import abort_group, new_group


class GroupBuilds:
    """The builds of every generation this worker was planned into (see the module
    docstring for the rules). Thread-safe: the plan watcher and the training thread both
    start builds."""

    def __init__(self, connect: Callable[[], dist.Store], interrupt: Interrupt, *,
                 bind_host: str, timeout_s: float) -> None:
        self.connect = connect
        self.interrupt = interrupt
        self.bind_host = bind_host
        self.timeout_s = timeout_s
        self._builds: dict[int, dict[str, Pending]] = {}  # generation -> its group builds
        self._lock = threading.Lock()
        self._built_upto = -1  # the newest generation whose builds began (never lowered)
        self.took_s: dict[str, float] = {}  # group name -> its last taken build's seconds

    def started(self, generation: int) -> bool:
        return generation in self._builds

    def start(self, plan: Plan, rank: int, device: torch.device, *, replicate: bool,
              current: int, mesh: dict[str, tuple[int, int]] | None = None
              ) -> dict[str, Pending]:
        """Start (or find) `plan`'s builds: the training group on `device`, the
        replication group when `replicate` (some rank's replica is held on another node:
        the only copies it carries), and the layout's `mesh` groups on `device` (name ->
        this rank's place in it, its size: `Membership.mesh_groups`). `current` is the
        generation this worker is in, whose builds its burial aborts; builds of
        generations never joined are discarded."""
        g, size = plan.generation, plan.world_size
        with self._lock:
            if g < self._built_upto or (g == self._built_upto and g not in self._builds):
                raise GenerationChanged(f"joining generation {g}: generation "
                                        f"{self._built_upto}'s groups were already built")
            if g not in self._builds:
                builds = {"train": self._pending(g, "train", rank, size, device)}
                if replicate:
                    builds["replicate"] = self._pending(g, "replicate", rank, size,
                                                        torch.device("cpu"))
                for name, (place, n) in (mesh or {}).items():
                    builds[name] = self._pending(g, name, place, n, device)
                kept = {}
                for k, old in self._builds.items():
                    if k == current:  # joined, or being joined: `bury` aborts what it
                        kept[k] = old  # holds when it leaves
                        continue
                    for p in old.values():  # never joined
                        p.discard(abort_group)
                self._builds, self._built_upto = {**kept, g: builds}, g
            return self._builds[g]  # (older generations' builds are dropped: abandoned)

    def names(self, generation: int) -> set[str]:
        """The groups of `generation` whose builds began (and were not taken yet)."""
        with self._lock:
            return set(self._builds.get(generation, {}))

    def take(self, generation: int, name: str, timeout_s: float) -> dist.ProcessGroup:
        """Wait for the build of `generation`'s group `name` and take its group: the
        builds no longer hold it (burying the generation leaves it to its taker: a kept
        mesh group outlives it, `kept_groups.py`)."""
        with self._lock:
            p = self._builds[generation][name]
        pg = p.result(timeout_s)
        with self._lock:
            self._builds.get(generation, {}).pop(name, None)
            self.took_s[name] = p.took_s or 0.0
        return pg

    def late(self, generation: int, name: str, rank: int, size: int,
             device: torch.device) -> None:
        """Start `generation`'s group `name` now, after the generation's other builds (a
        group the members decided not to keep: `kept_groups.py`); a no-op when begun."""
        with self._lock:
            if generation != self._built_upto or generation not in self._builds:
                raise GenerationChanged(f"building generation {generation}'s {name} group: "
                                        f"generation {self._built_upto}'s builds began")
            builds = self._builds[generation]
            if name not in builds:
                builds[name] = self._pending(generation, name, rank, size, device)

    def _pending(self, g: int, name: str, rank: int, size: int, device: torch.device) -> Pending:
        return Pending(lambda: new_group(self.connect(), Keys.group(g, name), rank, size,
                                         device=device, bind_host=self.bind_host,
                                         timeout_s=self.timeout_s),
                       self.interrupt, f"building generation {g}'s {name} group")

    def bury(self, generation: int, dead: list[dist.ProcessGroup]) -> None:
        """Abort generation `generation`'s groups (`dead`, those taken from its builds),
        then drop them on a helper thread."""
        with self._lock:  # the builds hold them too: the helper thread drops the last
            builds = self._builds.pop(generation, {})
        # A join that failed before taking a build's group (a generation announced while
        # it waited) leaves that build running: its group is aborted when it forms
        # (a group already taken is in `dead`; aborting it twice is harmless)
        for p in builds.values():
            p.discard(abort_group)
        del builds
        drop(dead)


def drop(dead: list[dist.ProcessGroup]) -> None:
    """Abort the groups `dead`, then drop them on a helper thread (the module docstring)."""
    list(map(abort_group, dead))  # (no loop variable left holding the last one)
    threading.Thread(target=dead.clear, name="phoenixft-bury-groups", daemon=True).start()

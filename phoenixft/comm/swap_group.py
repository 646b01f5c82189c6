"""A process group whose identity outlives generations: what a DeviceMesh, FSDP2 and
DTensor hold, while the communicator underneath is rebuilt for each generation.

FSDP2 keeps the process-group objects of its mesh (`FSDPMeshInfo`), DeviceMesh resolves
its groups by name through c10d's registry, and DTensor's functional collectives do the
same from C++. Rebuilding a user's sharded model and optimizer after every failure would
cost seconds at scale and throw away the survivors' state, so instead the objects they
hold never change: `SwapGroup` is a `torch.distributed.ProcessGroup` that forwards every
collective to `inner`, a c10d front end over the generation's training group (built by
`GroupBuilds`), and `swap` puts the next generation's group there.

Failure rule. FSDP2 issues its collectives inside the user's forward and backward and
waits on them with no timeout (a pipeline schedule its send/recv alike). A failed or late
collective must neither hang there nor raise through the user's loop (the exception would
leave the training script). So every work this group returns waits with the generation's
deadline and interrupt (`wait_work`), a collective that fails as it is issued (gloo
refuses a send once the peer's connection closed) is not raised either, and a failure is
latched instead of raised: the group turns *dead*, the
wait returns, every later collective of the generation completes at once without
touching its buffers, and the session raises the latched `CommFailure` when the step
reaches phoenixft again (before its own all-reduce). The step's values after the failure
are garbage and are never used: the generation is recovered from snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from phoenixft.comm.collectives import CommFailure, GroupOps, wait_work
from phoenixft.comm.ledger import watch_work
from phoenixft.torch_internals import (
    PROCESS_GROUP_COLLECTIVES,
    backend_registered,
    front_end,
    register_in_world,
)

BACKEND = "phoenixft"  # the name `init_process_group` knows our world group by



def _completed() -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return fut


class _Done(dist.Work):
    """A collective of a dead generation: complete at once, its buffers untouched."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return _completed()

    def synchronize(self) -> None:
        pass


class _Latched(dist.Work):
    """A collective of a live generation: `wait` waits with the generation's deadline and
    interrupt, and latches a failure in the group instead of raising it."""

    def __init__(self, inner: dist.Work, group: SwapGroup, generation: int, what: str) -> None:
        super().__init__()
        self.inner, self.group, self.generation, self.what = inner, group, generation, what
        self.ops = group.ops  # the generation's (the group may swap to the next one's)
        self._waited = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._waited:
            return True
        ops = self.ops
        if not self.group.live(self.generation):  # (its ledger still learns if it ends)
            watch_work(self.inner, ops.ledger.completed(self.inner))
            self._waited = True
            return True
        t0 = time.perf_counter()
        try:
            wait_work(self.inner, ops.interrupt, ops.timeout_s, self.what,
                      on_done=ops.ledger.completed(self.inner))
        except CommFailure as exc:
            ops.ledger.failed(str(exc))
            self.group.latch(exc)
        self.group.blocked_s += time.perf_counter() - t0
        self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or not self.group.live(self.generation) or self.inner.is_completed()

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        return _completed()

    def synchronize(self) -> None:
        self.wait()


class SwapGroup(dist.ProcessGroup):
    """One process group of a sharded model's mesh, for the whole life of this worker
    (see the module docstring). `swap(ops)` makes generation `ops`' training group the
    communicator; `failure` is the latched failure of the current one, if any."""

    def __init__(self, rank: int, size: int, name: str = "world") -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = name
        self._desc = name
        self.inner: dist.ProcessGroup | None = None
        self.ops: GroupOps | None = None
        self.generation = -1
        self.failure: CommFailure | None = None
        # called before each gradient reduce-scatter is issued (fault injection's
        # phase=backward); None: nothing
        self.before_reduce_scatter: Callable[[], None] | None = None
        # called before each send or recv is issued, with the method and the peer's rank
        # in this group (a pipeline's "pp" group: fault injection's phase=forward/backward)
        self.before_p2p: Callable[[str, int], None] | None = None
        # the other groups of the same mesh: a failure latched in one is latched in all
        # (the generation is over for every collective of the step)
        self.siblings: list[SwapGroup] = []
        self.retired: str | None = None  # why this group cannot be used any more (`retire`)
        self.blocked_s = 0.0  # seconds waited on its collectives (a pipeline's on its peers)

    # -- identity (what c10d, DeviceMesh and FSDP2 ask) ---------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    # -- generations ---------------------------------------------------------------------
    def swap(self, ops: GroupOps, generation: int) -> None:
        """Use generation `generation`'s training group (`ops.pg`, a gloo or NCCL backend)
        from now on; the latched failure of the previous one is cleared."""
        if ops.pg.size() != self._size or ops.pg.rank() != self._rank:
            raise RuntimeError(f"generation {generation}'s group is rank {ops.pg.rank()} of "
                               f"{ops.pg.size()}; this mesh's group is rank {self._rank} of "
                               f"{self._size} (a sharded model keeps its world size)")
        front = front_end(self._rank, self._size, ops.pg)
        self.inner, self.ops, self.generation, self.failure = front, ops, generation, None
        self.retired = None

    def retire(self, why: str) -> None:
        """This group's members are no longer a group of the job (an HSDP job's world
        after a replica group left): a collective on it raises `why`."""
        self.retired, self.inner, self.failure = why, None, None

    def latch(self, exc: CommFailure) -> None:
        """The generation is over (a failed collective, a failure elsewhere, a new plan):
        no collective of it, in this group or its siblings, waits any more."""
        for g in (self, *self.siblings):
            if g.failure is None:
                g.failure = exc

    def live(self, generation: int) -> bool:
        return self.failure is None and generation == self.generation


_LOST_PEER = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "timed out", "socket")


def _lost_peer(exc: RuntimeError) -> bool:
    """Whether an error raised as a collective was issued says the peer is gone (gloo
    raises a plain RuntimeError naming the socket's fate; NCCL a DistError)."""
    return isinstance(exc, dist.DistError) or any(w in str(exc).lower() for w in _LOST_PEER)


def _forwarder(method: str):
    scatter = "reduce_scatter" in method
    p2p = method in ("send", "recv")

    def forward(self: SwapGroup, *args, **kwargs):
        if self.retired is not None:
            raise RuntimeError(f"{method} on {self._name.removeprefix('phoenixft_')}: {self.retired}")
        if self.inner is None:
            raise RuntimeError(
                f"{method} on the mesh's {self._name.removeprefix('phoenixft_')} group while "
                "the model is being parallelized: parallelize(model, mesh) must not "
                "communicate (a spare runs it alone, when it takes its rank). Every rank "
                "builds the same initial weights, so pass src_data_rank=None to "
                "parallelize_module / distribute_tensor")
        if self.failure is not None:
            return _Done()
        if scatter and self.before_reduce_scatter is not None:
            self.before_reduce_scatter()
        peer = None
        if p2p:  # send(tensors, dstRank, tag), recv alike
            peer = args[1] if len(args) > 1 else kwargs["dstRank" if method == "send" else "srcRank"]
            if self.before_p2p is not None:
                self.before_p2p(method, peer)
        what = f"{method} of generation {self.generation}'s mesh group"
        try:
            work = getattr(self.inner, method)(*args, **kwargs)
        except RuntimeError as exc:
            if not _lost_peer(exc):  # a bug (a tensor on the wrong device, ...): raised
                raise
            # gloo refuses a send to a peer whose connection closed, as it is issued
            self.ops.ledger.spoil(f"{what} failed as it was issued: {exc}")
            self.latch(CommFailure(f"{what} failed as it was issued: {exc}"))
            return _Done()
        self.ops.ledger.issued(work, method if p2p else "collective", peer)
        return _Latched(work, self, self.generation, what)
    forward.__name__ = method
    return forward


for _method in PROCESS_GROUP_COLLECTIVES:
    setattr(SwapGroup, _method, _forwarder(_method))


def sub_group(dim: str, ranks: list[int], rank: int) -> SwapGroup:
    """A `SwapGroup` over `ranks` (global ranks, in group-rank order) for mesh dimension
    `dim`, of which global rank `rank` is a member, registered with c10d as a group of
    the world (DeviceMesh, DTensor's functional collectives and `get_process_group_ranks`
    find it by name, as they find a `new_group`'s)."""
    pg = SwapGroup(ranks.index(rank), len(ranks), name=f"phoenixft_{dim}")
    register_in_world(pg, BACKEND, ranks)
    return pg


def init_world(rank: int, size: int) -> SwapGroup:
    """Make a `SwapGroup` torch.distributed's default (world) group, through a backend
    registered under `BACKEND`: DeviceMesh, FSDP2, DTensor and the user's own
    `dist.*` calls then all go through it. Its rendezvous store is a local HashStore:
    nothing meets there (the generation's groups are built over the job's store)."""
    made: dict[str, SwapGroup] = {}

    def create(store, r, n, timeout):  # c10d's creator signature
        made["pg"] = SwapGroup(r, n)
        return made["pg"]

    if not backend_registered(BACKEND):
        dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
    if dist.is_initialized():
        raise RuntimeError("torch.distributed's default group is already initialized: "
                           "under `phoenixft run` a sharded model's groups are phoenixft's "
                           "(do not call init_process_group; use the mesh Session gives)")
    # (the worker stops a script's own init_process_group; the real one is __wrapped__)
    init = getattr(dist.init_process_group, "__wrapped__", dist.init_process_group)
    init(BACKEND, store=dist.HashStore(), rank=rank, world_size=size)
    return made["pg"]

"""Every private PyTorch name phoenixft relies on, in one place (written against torch 2.13).

phoenixft swaps the communicator under a sharded model's groups, drops what FSDP2 holds of
an abandoned step and reads DCP checkpoints through fsspec; for that it touches names
PyTorch does not promise to keep. Each one is used only through this module, and
`PRIVATE_NAMES` lists them all, with what we need of each: `tests/unit/test_torch_internals.py`
checks every entry by name (it exists; a callable takes the arguments we pass), so a torch
upgrade that renames or reshapes one fails in that one readable test, naming it, instead of
deep inside a run. Public APIs are used directly elsewhere; nothing else in the package
imports a `torch` module or attribute whose name starts with an underscore.

A layer of its own, like `platform.py`: it imports nothing of phoenixft.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class PrivateName:
    """One private name: `owner` (a module path, or module path + ":" + class path) holds
    `name`; `params`: the parameters we pass when it is a callable we call; `instance`:
    an attribute set on instances only (the test checks it on a live FSDP2 model)."""

    owner: str
    name: str
    why: str
    params: tuple[str, ...] = ()
    instance: bool = False

    def resolve(self):
        """The object named (AttributeError / ImportError when torch no longer has it)."""
        module, _, cls = self.owner.partition(":")
        obj = importlib.import_module(module)
        for part in filter(None, cls.split(".")):
            obj = getattr(obj, part)
        return getattr(obj, self.name)

    def __str__(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


# c10d's ProcessGroup collectives (torch 2.13 names) that FSDP2, DeviceMesh, DTensor and
# torch.distributed's object collectives call on a group: `SwapGroup` forwards each
PROCESS_GROUP_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "all_gather_single", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "broadcast",
    "reduce", "gather", "scatter", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier", "send", "recv", "recv_anysource", "monitored_barrier",
)

# the hooks c10d calls to name a group (`SwapGroup` implements them)
GROUP_NAME_HOOKS = ("_set_group_name", "_set_group_desc")

_C10D = "torch.distributed.distributed_c10d"
PRIVATE_NAMES: list[PrivateName] = [
    PrivateName("torch.distributed:ProcessGroupGloo", "_Options",
                "gloo options: a timeout and the device bound to the store's interface"),
    PrivateName("torch.distributed:ProcessGroup", "_set_default_backend",
                "SwapGroup.swap: a c10d front end over the generation's group", ("backend_type",)),
    PrivateName("torch.distributed:ProcessGroup", "_register_backend",
                "SwapGroup.swap: the generation's group as the front end's backend",
                ("device", "backend_type", "backend")),
    PrivateName(_C10D, "_register_pg_in_world",
                "a mesh dimension's SwapGroup registered as a group of the world",
                ("pg", "backend_name", "store", "group_name", "backend_config", "rank_mapping")),
    PrivateName("torch.distributed:Backend", "_plugins",
                "whether our world backend is registered already (init_world)"),
    PrivateName("torch.distributed.tensor:DTensor", "_local_tensor",
                "a DTensor's local shard, by reference", instance=True),
    PrivateName("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
                "where a parameter's local shard lies in the whole (sharded bases)",
                ("global_shape", "mesh", "placements")),
    PrivateName("torch.distributed.fsdp:FSDPModule", "_get_fsdp_state",
                "an FSDP2 unit's state, for its FSDPParams (relocate)"),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState",
                "_fsdp_param_group", "an FSDP2 unit's parameter group", instance=True),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup",
                "fsdp_params", "its FSDPParams", instance=True),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam",
                "_unsharded_param", "gradients autograd left on an unsharded parameter "
                "(an abandoned step's; a recomputed microbatch's, in no-sync mode)",
                instance=True),
    PrivateName("torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam",
                "unsharded_accumulated_grad", "an abandoned step's accumulated gradient (a "
                "recomputed microbatch's, in no-sync mode with a reduce dtype)",
                instance=True),
    PrivateName("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter",
                "dcp.save to any fsspec URL (a directory or s3://)", ("path",)),
    PrivateName("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader",
                "reading a DCP checkpoint from any fsspec URL", ("path",)),
    PrivateName("torch.distributed.checkpoint._nested_dict", "set_element",
                "the weights_only load planner puts a loaded object where DCP's does",
                ("root_dict", "path", "value")),
    PrivateName("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                "a class DCP's metadata pickles (on the safe unpickler's allow-list)"),
    PrivateName("torch.serialization", "_get_layout",
                "a function DCP's metadata pickles (on the safe unpickler's allow-list)"),
    PrivateName("torch", "_dynamo", "preloaded by the fork server: the first optimizer "
                "step imports it (2.8 s)"),
    PrivateName("torch.distributed:ProcessGroup", "_allgather_base",
                "a flat all-gather into one tensor, on a gloo or NCCL group",
                ("output", "input")),
    *[PrivateName("torch.distributed:ProcessGroup", n, "forwarded by SwapGroup")
      for n in PROCESS_GROUP_COLLECTIVES],
    *[PrivateName("torch.distributed:ProcessGroup", n, "implemented by SwapGroup")
      for n in GROUP_NAME_HOOKS],
]

# what the DCP metadata unpickler may build besides DCP's own metadata classes and dtypes
DCP_PICKLED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout")}


# modules the fork server imports before forking workers (a first optimizer step
# imports torch._dynamo: 2.8 s per worker otherwise)
PRELOAD_MODULES = ("torch._dynamo",)


# -- process groups ------------------------------------------------------------------------
def all_gather_base(pg: dist.ProcessGroup, out: torch.Tensor, t: torch.Tensor):
    """Issue the all-gather of `t` from every rank into flat `out`; returns its Work."""
    return pg._allgather_base(out, t)

def gloo_options(timeout: timedelta, device) -> object:
    """`ProcessGroupGloo` options with a timeout and one device (`create_device(...)`)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [device]
    return opts


def nccl_options(timeout: timedelta) -> object:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def front_end(rank: int, size: int, backend: dist.ProcessGroup) -> dist.ProcessGroup:
    """A c10d `ProcessGroup` whose one backend is `backend` (a gloo or NCCL group): what
    a `SwapGroup` forwards its collectives to."""
    front = dist.ProcessGroup(dist.HashStore(), rank, size)
    nccl = backend.name() == "nccl"
    kind = dist.ProcessGroup.BackendType.NCCL if nccl else dist.ProcessGroup.BackendType.GLOO
    front._set_default_backend(kind)
    front._register_backend(torch.device("cuda" if nccl else "cpu"), kind, backend)
    return front


def register_in_world(pg: dist.ProcessGroup, backend: str, ranks: list[int]) -> None:
    """Register `pg` (over global `ranks`, in group-rank order) as a group of the world, so
    DeviceMesh, DTensor's functional collectives and `get_process_group_ranks` find it
    by name, as they find a `new_group`'s."""
    from torch.distributed.distributed_c10d import _register_pg_in_world

    _register_pg_in_world(pg, backend_name=backend, store=dist.HashStore(),
                          group_name=pg.group_name, backend_config=backend,
                          rank_mapping={g: i for i, g in enumerate(ranks)})


def backend_registered(name: str) -> bool:
    return name.upper() in dist.Backend._plugins


# -- DTensor and FSDP2 ---------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself for a plain one), by reference."""
    return getattr(t, "_local_tensor", t)


def local_offset(p) -> list[int]:
    """Where DTensor `p`'s local shard starts in the whole, per dimension."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return list(offsets)


def fsdp_params(model: nn.Module) -> list:
    """Every FSDPParam of the model's FSDP2 units."""
    out = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        group = state()._fsdp_param_group
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def unsharded_grad(fp) -> torch.Tensor | None:
    """The unreduced gradient FSDPParam `fp` holds after a backward in no-sync mode
    (`set_requires_gradient_sync(False)`): its accumulated one (cast to the reduce dtype),
    else the one autograd left on its unsharded parameter."""
    if fp.unsharded_accumulated_grad is not None:
        return fp.unsharded_accumulated_grad
    unsharded = getattr(fp, "_unsharded_param", None)
    return unsharded.grad if unsharded is not None else None


def drop_unsharded_grads(fp) -> None:
    """Forget the gradients FSDPParam `fp` holds of an abandoned step: those autograd left
    on its unsharded parameter (a unit whose post-backward never ran) and its accumulated
    one."""
    unsharded = getattr(fp, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None
    fp.unsharded_accumulated_grad = None


# -- torch.distributed.checkpoint -----------------------------------------------------------
def fsspec_writer(url: str, **kwargs):
    """DCP's storage writer for any fsspec URL."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, **kwargs)


def fsspec_reader_class() -> type:
    """DCP's storage reader class for any fsspec URL (we subclass it)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def set_nested(root: dict, path, value) -> None:
    """Put `value` at a flattened state dict's `path` in `root` (DCP's own helper)."""
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)

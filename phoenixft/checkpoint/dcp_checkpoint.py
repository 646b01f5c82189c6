"""A whole training state as a checkpoint in torch.distributed.checkpoint's default format
(a `.metadata` file and `.distcp` files), the format torchtitan's checkpointer and plain
`dcp.load(state, checkpoint_id=DIR)` read; and such a checkpoint read back, ours or one
torchtitan (or any `dcp.save`) wrote.

Keys, as a torchtitan user's state dict has them (its `ModelWrapper` puts the model's keys
at the top level; its optimizers container flattens the optimizer's state dict):
- the model's parameters and persistent buffers under their fully qualified names
  (``layers.0.attn.q_proj.weight``);
- ``optimizer.state.<fqn>.<key>`` (``exp_avg``, ``exp_avg_sq``, ``step``, ...) and
  ``optimizer.param_groups.<fqn>.<key>`` (``lr``, ``betas``, ...), as
  `get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`;
- ``train_state.step``: the training step the state is the end of.

Whole tensors, written by one process: `dcp.load` reshards them onto any mesh. Never
loadable while incomplete: an old `.metadata` is removed before anything is written, and
DCP writes the new one last (on a filesystem through a rename). ``phoenixft.json`` then
records every file's size and checksum, which `verify` checks.

Reading: DCP's default reader unpickles `.metadata` and its planner `torch.load`s
non-tensor values with ``weights_only=False``; a peer could forge either. `read` uses an
unpickler that builds only DCP's own metadata classes and a planner that loads values with
``weights_only=True``.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from collections.abc import Iterable

import torch

from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.torch_internals import DCP_PICKLED, fsspec_reader_class, fsspec_writer, set_nested

SIDECAR = "phoenixft.json"
METADATA = ".metadata"
OPT = "optimizer"


def checkpoint_url(persist_url: str, step: int) -> str:
    """Where a job persisting to `persist_url` leaves its final state (torchtitan's
    ``checkpoint/step-N`` layout)."""
    return f"{persist_url.rstrip('/')}/checkpoint/step-{step}"


def titan_state(model: dict[str, torch.Tensor], optim: dict[tuple[str, str], torch.Tensor],
                groups: dict[str, dict], step: int) -> dict:
    """The nested state dict to save: `model` fqn -> tensor, `optim` (fqn, key) -> tensor,
    `groups` fqn -> its param group's hyper-parameters."""
    opt: dict[str, object] = {f"state.{n}.{k}": t for (n, k), t in optim.items()}
    for name, group in groups.items():
        for k, v in group.items():
            if isinstance(v, list) and k != "params":
                v = tuple(v)  # (a group read back from a snapshot's JSON header: betas)
            if k != "params" and isinstance(v, (int, float, bool, tuple, type(None))):
                opt[f"param_groups.{name}.{k}"] = v
    return {**model, OPT: opt, "train_state": {"step": torch.tensor(step, dtype=torch.int64)}}


def write(url: str, state: dict) -> str:
    """Save `state` (`titan_state`) at `url` (a directory or an fsspec URL) from this one
    process; returns the URL. A failure (RuntimeError, naming the cause) removes the
    directory it began."""
    import fsspec
    import torch.distributed.checkpoint as dcp

    fs, path = fsspec.core.url_to_fs(url)
    for name in (METADATA, SIDECAR):  # no old .metadata beside new data, ever
        if fs.exists(f"{path}/{name}"):
            fs.rm(f"{path}/{name}")
    try:
        with warnings.catch_warnings():  # ("assuming the intent is to save in a single process")
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=fsspec_writer(url, sync_files=True), no_dist=True)
    except (Exception, dcp.CheckpointException) as exc:  # (DCP's is a BaseException)
        try:  # no half-written directory left behind (a full disk, a lost connection)
            if fs.exists(path) and not fs.exists(f"{path}/{METADATA}"):
                fs.rm(path, recursive=True)
        except OSError:
            pass
        # (DCP's exception holds each rank's (exception, traceback))
        cause = next(iter(getattr(exc, "failures", {}).values()), (exc, None))[0]
        raise RuntimeError(f"{url}: writing the checkpoint failed "
                           f"({type(cause).__name__}: {cause})") from None
    files = {}
    for p in sorted(fs.ls(path, detail=False)):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name != SIDECAR:
            data = fs.cat_file(p)
            files[name] = {"nbytes": len(data), "checksum": checksum(data)}
    with fs.open(f"{path}/{SIDECAR}", "w") as f:
        json.dump({"format": "torch.distributed.checkpoint", "files": files}, f, indent=1)
    return url


# -- reading -----------------------------------------------------------------------------
_DCP_MODULES = {"torch.distributed.checkpoint.metadata"}
_ALLOWED = DCP_PICKLED | {("collections", "OrderedDict"),
            # (a collective dcp.save records its checkpoint_id, a path, in storage_meta)
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes and dtypes, and nothing else."""

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES or (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's "
                                     "metadata (refused: the file may have been forged)")


def read_metadata(url: str):
    """The checkpoint's DCP `Metadata`, unpickled with `_MetadataUnpickler`."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    where = f"{url}/{METADATA}"
    try:
        data = fs.cat_file(f"{path}/{METADATA}")
    except FileNotFoundError:
        raise IntegrityError(f"{where}: missing: not a torch.distributed.checkpoint directory "
                             "in its default format (or not a complete one)") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # (any damage: the unpickler's errors are of many kinds)
        raise IntegrityError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None


def _reader(url: str):

    class Reader(fsspec_reader_class()):
        def read_metadata(self, *args, **kwargs):
            md = read_metadata(url)
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return Reader(url)


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_nested(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner(allow_partial_load=True)


def load(url: str, state: dict) -> None:
    """Fill `state` (flat keys as `titan_state` makes them, tensors or DTensors of the right
    shapes) in place from the checkpoint at `url`, each rank reading only its own shards
    (no collective). Keys the checkpoint lacks are left as they are: the caller checks."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # ("assuming the intent is to load in a single process")
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=_reader(url), planner=_planner(), no_dist=True)


def saved_keys(url: str) -> dict[str, object]:
    """Each saved key -> its metadata (a TensorStorageMetadata: `.size`; or bytes)."""
    return dict(read_metadata(url).state_dict_metadata)


def verify(url: str) -> list[str]:
    """What is wrong with the checkpoint at `url` (empty: nothing found): a file whose
    size or checksum is not what `phoenixft.json` recorded (ours), and for any DCP
    checkpoint, tensors whose saved chunks do not cover them exactly once or whose data
    lies beyond the end of its file."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    problems = []
    if fs.exists(f"{path}/{SIDECAR}"):
        files = json.loads(fs.cat_file(f"{path}/{SIDECAR}"))["files"]
        for name, want in files.items():
            try:
                data = fs.cat_file(f"{path}/{name}")
            except FileNotFoundError:
                problems.append(f"{url}/{name}: missing")
                continue
            if len(data) != want["nbytes"] or checksum(data) != want["checksum"]:
                problems.append(f"{url}/{name}: checksum mismatch ({len(data)} bytes: "
                                "damaged or edited)")
        if problems:
            return problems
    try:
        md = read_metadata(url)
    except IntegrityError as exc:
        return [str(exc)]
    sizes = {}
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            try:
                sizes[rel] = fs.size(f"{path}/{rel}")
            except FileNotFoundError:
                sizes[rel] = -1
        if info.offset + info.length > sizes[rel]:
            problems.append(f"{url}/{rel}: too short for {index.fqn} (missing or truncated)")
    for fqn, meta in md.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            n = _covered(meta.size, meta.chunks)
            total = 1
            for d in meta.size:
                total *= d
            if n != total:
                problems.append(f"{url}/{METADATA}: {fqn}'s saved chunks cover {n} of its "
                                f"{total} elements (sharding metadata edited, or shards missing)")
    return problems


def _covered(size: Iterable[int], chunks) -> int:
    """Elements of a tensor of `size` covered by `chunks`; -1 when chunks overlap or leave
    its bounds (they must tile it)."""
    size = list(size)
    boxes = [(list(c.offsets), list(c.sizes)) for c in chunks]
    total = 0
    for i, (off, sz) in enumerate(boxes):
        if len(off) != len(size) or any(o < 0 or o + s > n for o, s, n in zip(off, sz, size)):
            return -1
        vol = 1
        for s in sz:
            vol *= s
        total += vol
        for off2, sz2 in boxes[:i]:  # (a handful of chunks a tensor: one per saving rank)
            if vol and all(o < o2 + s2 and o2 < o + s for o, s, o2, s2 in zip(off, sz, off2, sz2)):
                return -1
    return total

"""A persisted step as a model: the trainable parameters gathered from every rank's shard,
the untrained tensors (frozen parameters, buffers) written once per generation, and the
job's Hugging Face config, as a directory `transformers` loads and `phoenixft serve`
serves (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from phoenixft.checkpoint.hf_dir import write_hf_dir
from phoenixft.checkpoint.integrity import IntegrityError, checksum
from phoenixft.checkpoint.record import Snapshot
from phoenixft.checkpoint.slots import blob_snapshot
from phoenixft.checkpoint.tiers import FsspecTier


def model_state(tier: FsspecTier, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The full model state dict of a committed step, and its manifest."""
    manifest = tier.read_manifest(step)
    meta = manifest["model"]["meta"]
    if meta.get("layout") == "fsdp2":
        state = sharded_params(tier, step, manifest)
        state.update(read_fixed(tier, manifest))
        for alias in meta.get("aliases", {}):
            state.pop(alias, None)
        return state, manifest
    shards = []
    for r in range(manifest["world_size"]):
        shards.append(rank_snapshot(tier, step, r, manifest).tensors["param_shard"])
    flat = torch.cat(shards)[:meta["numel"]]
    state: dict[str, torch.Tensor] = {}
    flat = flat.to(getattr(torch, meta["dtype"]))  # master shards may be fp32 (mixed precision)
    for name, shape, off in meta["params"]:
        n = 1
        for d in shape:
            n *= d
        state[name] = flat[off:off + n].view(shape).clone()
    state.update(read_fixed(tier, manifest))
    for alias in meta.get("aliases", {}):
        state.pop(alias, None)  # tied weights are saved once, as transformers does
    return state, manifest


def rank_snapshot(tier: FsspecTier, step: int, rank: int, manifest: dict) -> Snapshot:
    """Rank `rank`'s persisted snapshot of a committed step, verified (tensors are copies)."""
    return blob_snapshot(tier.get(step, rank, manifest), step, f"{tier.url} rank {rank} step {step}")


def sharded_params(tier: FsspecTier, step: int, manifest: dict) -> dict[str, torch.Tensor]:
    """A sharded model's whole parameters from every rank's local shards, each put where
    its snapshot says it lies (`SnapshotHeader.dcp_placement`: global size and offsets). Every
    element must be covered exactly once, else the records do not make a whole model."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    written: set[tuple] = set()
    names: set[str] = set()
    for r in range(manifest["world_size"]):
        snap = rank_snapshot(tier, step, r, manifest)
        tensors, placement = snap.tensors, snap.header.dcp_placement() or {}
        names.update(placement)
        for name, (size, offsets) in placement.items():
            local = tensors.get(f"p.{name}")  # (None: a replica another rank holds)
            if local is None or local.numel() == 0 or (name, *offsets) in written:
                continue
            written.add((name, *offsets))
            if name not in full:
                full[name], covered[name] = local.new_zeros(size), 0
            index = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
            full[name][index] = local
            covered[name] += local.numel()
    short = sorted(n for n in names if n not in full or covered[n] != full[n].numel())
    if short:
        raise IntegrityError(f"step {step} of {tier.url}: the ranks' shards do not cover "
                             f"{len(short)} parameter(s) exactly once (first: {short[0]})")
    return full


def _sharded_optim(tier: FsspecTier, step: int, manifest: dict) -> dict:
    """`sharded_params` for the optimizer state: (param name, key) -> whole tensor; a
    scalar (Adam's step) as rank 0 holds it."""
    full: dict[tuple[str, str], torch.Tensor] = {}
    covered: dict[tuple[str, str], int] = {}
    written: set[tuple] = set()
    for r in range(manifest["world_size"]):
        snap = rank_snapshot(tier, step, r, manifest)
        tensors, placement = snap.tensors, snap.header.dcp_placement() or {}
        for entry, local in tensors.items():
            if not entry.startswith("o."):
                continue
            name, _, kind = entry[2:].rpartition(".")
            key = (name, kind)
            if local.dim() == 0:
                full.setdefault(key, local.clone())
                continue
            size, offsets = placement[name]
            if local.numel() == 0 or (key, *offsets) in written:
                continue
            written.add((key, *offsets))
            if key not in full:
                full[key], covered[key] = local.new_zeros(size), 0
            full[key][tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
            covered[key] += local.numel()
    short = sorted(k for k, n in covered.items() if n != full[k].numel())
    if short:
        raise IntegrityError(f"step {step} of {tier.url}: the ranks' optimizer shards do not "
                             f"cover {short[0][0]}'s {short[0][1]} exactly once")
    return full


def _flat_optim(tier: FsspecTier, step: int, manifest: dict) -> dict:
    """A data-parallel job's optimizer state (ZeRO-1 shards of one flat buffer) per
    parameter."""
    meta = manifest["model"]["meta"]
    shards: dict[str, list[torch.Tensor]] = {}
    for r in range(manifest["world_size"]):
        for k, v in rank_snapshot(tier, step, r, manifest).tensors.items():
            if k.startswith("opt."):
                shards.setdefault(k[4:], []).append(v)
    out = {}
    for kind, parts in shards.items():
        flat = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
        for name, shape, off in meta["params"]:
            n = 1
            for d in shape:
                n *= d
            out[(name, kind)] = flat.clone() if flat.dim() == 0 else flat[off:off + n].view(shape).clone()
    return out


def training_state(tier: FsspecTier, step: int) -> tuple[dict, dict, dict, dict]:
    """A committed step whole: (model fqn -> tensor, (fqn, key) -> optimizer tensor,
    fqn -> its param group's hyper-parameters, the manifest). The param groups are named
    only when the optimizer has one (the snapshot does not say which parameter is in
    which group)."""
    model, manifest = model_state(tier, step)
    meta = manifest["model"]["meta"]
    sharded = meta.get("layout") == "fsdp2"
    optim = _sharded_optim(tier, step, manifest) if sharded else _flat_optim(tier, step, manifest)
    groups = rank_snapshot(tier, step, 0, manifest).header.opt.get("param_groups") or []
    names = {n for n, _ in optim} | (set(model) - set(read_fixed(tier, manifest)))
    by_name = {n: groups[0] for n in names} if len(groups) == 1 else {}
    return model, optim, by_name, manifest


def read_fixed(tier: FsspecTier, manifest: dict) -> dict[str, torch.Tensor]:
    """The untrained tensors a manifest names, verified (checksum, when the manifest has
    one, and the safetensors format): IntegrityError names the file and what is wrong."""
    from safetensors import SafetensorError

    rel = manifest["model"].get("fixed")
    if not rel:
        return {}
    where = f"{tier.url}/{rel}"
    try:
        data = tier.read_object(rel)
    except KeyError:
        raise IntegrityError(f"{where}: missing (the model's untrained tensors, step "
                             f"{manifest['step']} needs them)") from None
    want = manifest["model"].get("fixed_checksum")
    if want is not None and checksum(data) != want:
        raise IntegrityError(f"{where}: checksum mismatch ({len(data)} bytes: damaged or "
                             "replaced)")
    try:
        return load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise IntegrityError(f"{where}: not a readable safetensors file ({exc})") from None


def export_dcp(tier: FsspecTier, step: int, out_dir: str) -> str:
    """A committed step as a checkpoint in DCP's default format (`dcp_checkpoint.py`)."""
    from phoenixft.checkpoint import dcp_checkpoint

    model, optim, groups, _ = training_state(tier, step)
    for alias, target in tier.read_manifest(step)["model"]["meta"].get("aliases", {}).items():
        if target in model:
            model[alias] = model[target]  # (a torch state dict names a tied weight twice)
    return dcp_checkpoint.write(out_dir, dcp_checkpoint.titan_state(model, optim, groups, step))


def export_hf(tier: FsspecTier, step: int, out_dir: str | Path) -> Path:
    state, manifest = model_state(tier, step)
    config = manifest["model"]["meta"].get("config")
    if config is None:
        raise ValueError(f"step {step} of {tier.url} has no model config (the job's model has no "
                         "Hugging Face config), so it cannot be written as a Hugging Face model")
    return write_hf_dir(out_dir, state, config, {"phoenixft_step": str(step),
                                                 "phoenixft_job": manifest["job_id"]})


def check_target(out_dir: str, force: bool) -> None:
    """Refuse an export target that would put files where nobody meant them: an empty
    path (it wrote into the current directory), a file, a non-empty directory (unless
    `force`: its config.json and model.safetensors are then replaced, the rest kept)."""
    if not out_dir.strip():
        raise ValueError("--to is empty: name the directory to write the model to")
    p = Path(out_dir)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--to {out_dir}: is a file, not a directory")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise ValueError(f"--to {out_dir}: the directory is not empty; choose a new one, or "
                         "pass --force to replace its config.json and model.safetensors")

"""A training session's state to and from a checkpoint in torch.distributed.checkpoint's
default format (`checkpoint/dcp_checkpoint.py`: torchtitan's keys).

- `final_state`: at the end of a job, the state `Session` gathered for its digest, keyed
  as a torchtitan user's state dict is: what rank 0 writes under the persist URL.
- `load_sharded`: a new job's sharded model and optimizer (`--init-from DIR`) from such a
  checkpoint, ours or one torchtitan or plain `dcp.save` wrote; each rank reads only its
  own shards, without a collective.
"""

from __future__ import annotations

import torch
from torch import nn

from phoenixft.checkpoint import dcp_checkpoint as ckpt
from phoenixft.checkpoint.integrity import IntegrityError


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().cpu()


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """id(parameter) -> its param group."""
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                full: dict[str, torch.Tensor], step: int) -> dict:
    """`full` (a layout's `full_state`: ``model.<fqn>``, ``optim.<key>.<fqn>``, or a flat
    layout's ``optim.<key>`` scalar for every parameter) as `dcp_checkpoint.titan_state`.
    Keys the user's `model.state_dict()` has are all there: tied weights under each of
    their names, persistent buffers too."""
    params = dict(model.named_parameters())
    weights = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    by_id = {id(p): n for n, p in params.items()}
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in weights:
            alias = by_id.get(id(value))
            weights[key] = weights[alias] if alias in weights else _whole(value)
    optim: dict[tuple[str, str], torch.Tensor] = {}
    for key, value in full.items():
        if key.startswith("optim."):
            kind, _, name = key[len("optim."):].partition(".")
            for n in ([name] if name else params):  # (a flat layout's scalar: every one)
                optim[(n, kind)] = value
    groups = {}
    by_param = _group_of(optimizer)
    for name, p in params.items():
        group = by_param.get(id(p))
        if group is None and len(optimizer.param_groups) == 1:
            group = optimizer.param_groups[0]  # (ZeRO's flat groups: one for every param)
        if group is not None:
            groups[name] = group
    return ckpt.titan_state(weights, optim, groups, step)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, url: str) -> int:
    """Load `url` into this rank's shards of `model`'s parameters (DTensors or plain) and
    its optimizer state, and the saved hyper-parameters into its param groups; returns
    the checkpoint's `train_state.step` (0 when it has none)."""
    saved = ckpt.saved_keys(url)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in saved]
    if missing:
        raise IntegrityError(
            f"{url}: no {missing[0]} (and {len(missing) - 1} more of this model's "
            f"{len(params)} parameters): a checkpoint of another model, or one that keeps "
            "the model under a prefix (phoenixft and torchtitan keep its keys at the top level)")
    state: dict[str, object] = dict(params)
    state.update({k: b for k, b in model.named_buffers() if k in saved})
    fresh: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    group_of = _group_of(optimizer)
    hyper: dict[str, tuple[dict, str]] = {}
    for name, p in params.items():
        prefix = f"{ckpt.OPT}.state.{name}."
        for key, meta in saved.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                kind = key[len(prefix):]
                size = list(getattr(meta, "size", []))
                if size == list(p.shape):
                    t = torch.zeros_like(p.detach())
                else:
                    t = torch.zeros(size, dtype=meta.properties.dtype)
                fresh.setdefault(p, {})[kind] = t
                state[key] = t
        group = group_of.get(id(p))
        for k in list(group or ()):
            key = f"{ckpt.OPT}.param_groups.{name}.{k}"
            if k != "params" and key in saved:
                state[key], hyper[key] = None, (group, k)
    if "train_state.step" in saved:
        meta = saved["train_state.step"]
        state["train_state.step"] = torch.zeros((), dtype=meta.properties.dtype)
    with torch.no_grad():
        ckpt.load(url, state)
    for p, kinds in fresh.items():
        optimizer.state[p].update(kinds)
    for key, (group, k) in hyper.items():
        group[k] = state[key]
    step = state.get("train_state.step")
    return int(step) if step is not None else 0

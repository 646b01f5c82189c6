"""Clipping by the global norm for gradients that are sharded DTensors (FSDP2, FSDP2 + TP,
HSDP): the norm over every shard of every parameter, as `torch.nn.utils.clip_grad_norm_`
computes it for gradients on one mesh, and for gradients on several meshes too.

`torch.nn.utils.clip_grad_norm_` stacks the per-parameter norms, which DTensor refuses when
they live on different meshes (tensor parallelism over some parameters only: the MLPs on
the ("dp_shard", "tp") mesh, norms and attention on ("dp_shard",)). So the norm is taken per
mesh (`get_total_norm`, reduced over that mesh's ranks by `full_tensor`: an all-reduce on
its groups, which under phoenixft are the generation's, with its deadlines), and the
per-mesh norms are combined as the stacked norm would be; the clip coefficient is applied
per mesh too (a foreach over gradients of two meshes fails alike). With one mesh this is
`clip_grad_norm_`'s own arithmetic, bit for bit: get_total_norm, then clip_grads_with_norm_.
"""

from __future__ import annotations

import torch


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, combine=None) -> torch.Tensor:
    """Scale the gradients of `params` so their global `norm_type` norm is at most
    `max_norm`; returns that norm (before clipping, the same on every rank). `combine(norm)`
    turns the norm of `params` into the global one where other ranks hold other
    parameters (a pipeline's stages)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}  # mesh -> its parameters with gradients
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p)
    if not by_mesh:
        zero = torch.tensor(0.0)
        return combine(zero) if combine is not None else zero
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    if combine is not None:
        total = combine(total)
    for group in by_mesh.values():  # (one foreach per mesh: it cannot mix them either)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total

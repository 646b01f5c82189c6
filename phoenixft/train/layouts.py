"""The layout registry: which `Layout` a job gets, chosen in this one place from
`Session.setup`'s arguments (`kind_of`), built by the builder registered for that kind.

    flat   no `parallelize`: ZeRO-1 over a flat copy of the parameters (flat_layout.py)
    fsdp2  `parallelize` (FSDP2, with `tp` > 1 tensor parallelism too): fsdp_layout.py
    hsdp   `parallelize` and `dp_shard`: FSDP2 inside replica groups (hsdp_layout.py)
    pp     `pipeline`: pipeline stages, FSDP2 inside each, replicas of the pipeline
           (pipeline_layout.py)

A new parallelism adds its kind to `kind_of` and a builder to `BUILDERS`; nothing else
chooses a layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from phoenixft.train.layout import Layout


@dataclass(frozen=True, kw_only=True)
class LayoutArgs:
    """`Session.setup`'s arguments that decide and build the layout."""

    model: nn.Module
    optimizer: Callable  # params -> torch.optim.Optimizer
    scheduler: Callable | None = None
    parallelize: Callable | None = None  # (model, DeviceMesh) -> anything
    tp: int = 1
    dp_shard: int | None = None
    pipeline: object | None = None  # pipeline_schedule.Pipeline
    before_reduce_scatter: Callable[[], None] | None = None  # fault injection's hook
    before_p2p: Callable[[str], None] | None = None  # (phase) fault injection's hook


def _flat(a: LayoutArgs) -> Layout:
    from phoenixft.train.flat_layout import FlatZero1
    from phoenixft.train.layout import DataParallelWork

    return Layout.of("flat", FlatZero1(a.model, a.optimizer, a.scheduler), DataParallelWork())


def _fsdp2(a: LayoutArgs) -> Layout:
    from phoenixft.train.fsdp_layout import Fsdp2Layout, TensorParallelWork

    core = Fsdp2Layout(a.model, a.optimizer, a.parallelize, a.scheduler, tp=a.tp,
                       before_reduce_scatter=a.before_reduce_scatter)
    return Layout.of("fsdp2", core, TensorParallelWork(core))


def _hsdp(a: LayoutArgs) -> Layout:
    from phoenixft.train.hsdp_layout import HsdpLayout, ReplicaGroupWork

    core = HsdpLayout(a.model, a.optimizer, a.parallelize, a.scheduler, tp=a.tp,
                      dp_shard=a.dp_shard, before_reduce_scatter=a.before_reduce_scatter)
    return Layout.of("hsdp", core, ReplicaGroupWork(core))


def _pp(a: LayoutArgs) -> Layout:
    from phoenixft.train.pipeline_layout import PipelineLayout, PipelineWork

    core = PipelineLayout(a.model, a.optimizer, a.pipeline, a.parallelize, a.scheduler,
                          dp_shard=1 if a.dp_shard is None else a.dp_shard, tp=a.tp,
                          before_reduce_scatter=a.before_reduce_scatter,
                          before_p2p=a.before_p2p)
    return Layout.of("pp", core, PipelineWork(core), executor=core.executor)


BUILDERS: dict[str, Callable[[LayoutArgs], Layout]] = {"flat": _flat, "fsdp2": _fsdp2,
                                                        "hsdp": _hsdp, "pp": _pp}


def kind_of(a: LayoutArgs) -> str:
    if a.pipeline is not None:
        return "pp"
    if a.parallelize is None:
        return "flat"
    return "fsdp2" if a.dp_shard is None else "hsdp"


def build(a: LayoutArgs) -> Layout:
    return BUILDERS[kind_of(a)](a)

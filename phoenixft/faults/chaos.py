"""Seeded random fault schedules for `phoenixft chaos`: N faults of every survivable kind,
at random steps, ranks and phases (mid-step, inside the snapshot thread, during a
recovery), as `--inject` specs. A pure function of its inputs: the same seed gives the same
schedule on every machine, so a failing soak can be replayed exactly.

Survivable means a run with enough spares ends with the failure-free final state:
- one node: kill, stop (a hang), corrupt (own snapshots damaged, then killed; needs a
  replica, so at least 2 ranks, and `phoenixft chaos` runs with `--replicas 1`);
- several nodes also: node (a whole node lost), shm (a node's shared memory deleted, then
  killed), since the replicas on other nodes survive them.
Faults are at least `GAP` steps apart, so no two share a recovery: fault k (from 1) then
creates generation k, and a recovery fault (`gen=G`) strikes during the recovery from the
fault before it. At most nnodes - 1 whole nodes are lost (one must stay).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from phoenixft.faults.inject import FaultKind, InjectSpec

ONE_NODE_KINDS = ("kill", "stop", "corrupt")
MANY_NODE_KINDS = ("node", "shm")
WHERE = ("start", "microbatch", "reduce", "update", "snapshot", "replicate", "commit", "recovery")
GAP = 3


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    seed: int
    faults: int
    steps: int  # the job's length: faults land in steps 2 .. steps - 1
    world_size: int
    nnodes: int = 1
    microbatches_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.faults < 1:
            raise ValueError(f"--faults must be >= 1, got {self.faults}")
        if self.steps < GAP * self.faults + 3:
            raise ValueError(f"--steps {self.steps} leaves no room for {self.faults} faults "
                             f"{GAP} steps apart (need at least {GAP * self.faults + 3})")
        if self.world_size < 1 or self.nnodes < 1 or self.microbatches_per_rank < 1:
            raise ValueError("world size, nodes and microbatches per rank must be >= 1")


def schedule(cfg: ChaosConfig) -> list[InjectSpec]:
    """The faults, in the order they fire."""
    rng = random.Random(cfg.seed)
    kinds = ONE_NODE_KINDS if cfg.world_size > 1 else ("kill", "stop")
    kinds += MANY_NODE_KINDS if cfg.nnodes > 1 else ()
    slots = rng.sample(range((cfg.steps - 3) // GAP), cfg.faults)
    out: list[InjectSpec] = []
    nodes_lost = 0
    for k, step in enumerate(sorted(2 + GAP * i for i in slots), start=1):
        kind = rng.choice(kinds)
        if kind == "node":
            nodes_lost += 1
            if nodes_lost >= cfg.nnodes:
                kind = "kill"
        rank = rng.randrange(cfg.world_size)
        where = rng.choice(WHERE if k > 1 else WHERE[:-1])
        if where == "recovery":
            out.append(InjectSpec(kind=kind if kind in ("kill", "node") else "kill",
                                  rank=rank, gen=k - 1))
        elif where == "start":
            out.append(InjectSpec(kind=kind, rank=rank, step=step))
        elif where == "microbatch":
            out.append(InjectSpec(kind=kind, rank=rank, step=step,
                                  microbatch=rng.randrange(cfg.microbatches_per_rank)))
        else:
            out.append(InjectSpec(kind=kind, rank=rank, step=step, phase=where))
    return out


def spares_needed(specs: list[InjectSpec], ranks_per_node: int) -> int:
    """One spare per fault, plus the ranks a lost node takes with it beyond the first."""
    return len(specs) + sum(ranks_per_node - 1 for s in specs if s.kind is FaultKind.NODE)

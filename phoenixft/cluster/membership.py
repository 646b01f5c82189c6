"""Generations: who holds which rank, written once per generation by the leader.

A plan is the leader's only output. Every decision (start, replace a dead worker, stop
because no spare is left, the job is done) is the next generation's plan, so members
and spares watch one key, ``gen/{g+1}/plan``, and never miss a decision.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


class PlanKind(str, enum.Enum):
    """What a generation's plan says: train on (`RUN`), the job is over (`DONE`), or it
    stops (`ABORT`, with the reason)."""

    RUN = "run"
    DONE = "done"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


@dataclass
class Plan:
    """A generation: who holds which rank (`members`, rank -> worker id) on which node,
    which dead workers it replaces, and why; or the end of the job (`kind` DONE or
    ABORT, with the reason). Written once by the leader at `gen/{g}/plan`, never changed."""

    generation: int
    kind: PlanKind = PlanKind.RUN
    members: dict[int, str] = field(default_factory=dict)  # rank -> worker id
    nodes: dict[int, int] = field(default_factory=dict)  # rank -> node index
    replaced: dict[int, str] = field(default_factory=dict)  # rank -> dead worker id
    reason: str = ""
    t_fail: float | None = None  # wall time the failure happened, when known
    t_detect: float | None = None  # wall time the leader saw it
    progress: int = 0  # newest step completed before the failure (for lost_steps)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, wid: str) -> int | None:
        for r, w in self.members.items():
            if w == wid:
                return r
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        d = json.loads(text)
        d["members"] = {int(k): v for k, v in d["members"].items()}
        d["nodes"] = {int(k): v for k, v in d["nodes"].items()}
        d["replaced"] = {int(k): v for k, v in d["replaced"].items()}
        d["kind"] = PlanKind(d["kind"])
        return cls(**d)


def crossing_replicas(nodes: dict[int, int],
                      holders: dict[int, list[int]]) -> list[tuple[int, int]]:
    """The (rank, holder) pairs of `holders` whose replica leaves the rank's node: those
    travel over the replication group (a same-node holder copies from shared memory)."""
    return [(r, h) for r, hs in holders.items() for h in hs if nodes[h] != nodes[r]]


def replica_holders(nodes: dict[int, int], k: int = 1,
                    same_node: bool = True) -> dict[int, list[int]]:
    """For each rank, the k ranks that hold its replica: the next ranks in ring order,
    taking ranks on other nodes first, so losing one node loses no snapshot; ranks on the
    rank's own node only if `same_node` (a copy there guards against a damaged slot file,
    not against losing the node, and a worker's death never takes its node's slots)."""
    ranks = sorted(nodes)
    n = len(ranks)
    holders: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        ring = [ranks[(i + j) % n] for j in range(1, n)]
        other = [h for h in ring if nodes[h] != nodes[r]]
        same = [h for h in ring if nodes[h] == nodes[r]]
        holders[r] = (other + (same if same_node else []))[:k]
    return holders

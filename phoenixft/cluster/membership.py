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
        # an index built once per members dict (a plan of 4,096 ranks is asked this by
        # every member and, per failure, by the leader: a scan each was O(N) a question)
        idx = self.__dict__.get("_index")
        if idx is None or idx[0] is not self.members or len(idx[1]) != len(self.members):
            idx = (self.members, {w: r for r, w in self.members.items()})
            self.__dict__["_index"] = idx
        return idx[1].get(wid)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def change_from(self, prev: Plan) -> str:
        """This plan as a change to `prev` (the plan before it): what a member that holds
        `prev` reads instead of the whole plan, so a failure costs the store O(N) bytes,
        not O(N) members x O(N) bytes each. JSON."""
        d = asdict(self)
        members, nodes = d.pop("members"), d.pop("nodes")
        d["base"] = prev.generation
        d["size"] = len(members)
        d["set"] = {r: [w, nodes[r]] for r, w in members.items()
                    if prev.members.get(r) != w or prev.nodes.get(r) != nodes[r]}
        return json.dumps(d)

    def changed(self, change: str | bytes) -> Plan:
        """The plan that `change` (`change_from`, against this plan) describes."""
        d = json.loads(change)
        if d.pop("base") != self.generation:
            raise ValueError(f"a change to generation {self.generation} expected")
        size, edits = d.pop("size"), d.pop("set")
        members = {r: w for r, w in self.members.items() if r < size}
        nodes = {r: n for r, n in self.nodes.items() if r < size}
        for r, (w, n) in edits.items():
            members[int(r)], nodes[int(r)] = w, n
        d["replaced"] = {int(k): v for k, v in d["replaced"].items()}
        d["kind"] = PlanKind(d["kind"])
        return Plan(members=members, nodes=nodes, **d)

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

"""Generations: who holds which rank, written once per generation by the leader.

A plan is the leader's only output. Every decision (start, replace a dead worker, stop
because no spare is left, the job is done) is the next generation's plan, so members
and spares watch one key, ``gen/{g+1}/plan``, and never miss a decision.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field, fields

_WID = re.compile(r"n(\d+)w(\d+)")


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

    def _fields(self) -> dict:
        # (dataclasses.asdict deep-copies: 60 ms for a plan of 16,384 ranks, which the
        # leader and every agent pay per generation; nothing here is changed)
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        """The plan, its membership as runs (`member_runs`): a job whose nodes start alike
        is a few bytes however many ranks it has, so reading the first plan once a node
        costs the store O(nodes) bytes in all, not O(N) a member."""
        d = self._fields()
        runs, other = member_runs(d.pop("members"), d.pop("nodes"))
        return json.dumps({**d, "runs": runs, "other": other})

    def change_from(self, prev: Plan) -> str:
        """This plan as a change to `prev` (the plan before it): what a member that holds
        `prev` reads instead of the whole plan, so a failure costs the store O(N) bytes,
        not O(N) members x O(N) bytes each. JSON."""
        d = self._fields()
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
        if "runs" in d:
            d["members"], d["nodes"] = expand_runs(d.pop("runs"), d.pop("other"))
        else:  # (a plan written whole, rank by rank)
            d["members"] = {int(k): v for k, v in d["members"].items()}
            d["nodes"] = {int(k): v for k, v in d["nodes"].items()}
        d["replaced"] = {int(k): v for k, v in d["replaced"].items()}
        d["kind"] = PlanKind(d["kind"])
        return cls(**d)


def member_runs(members: dict[int, str], nodes: dict[int, int]
                ) -> tuple[list[list[int]], dict[int, list]]:
    """A membership (rank -> worker id, rank -> node) as runs `[first rank, nodes, per
    node, first node, first index]`: ranks `first + a * per + j` are worker
    `n{first node + a}w{first index + j}` on node `first node + a`, for a < nodes, j < per.
    Worker ids of another form, or on another node than their name says, are listed
    apart (`other`: rank -> [worker id, node]). Generation 0 of nodes that start alike is
    one run; each replacement adds a few."""
    single: list[list[int]] = []  # [first rank, count, node, first index]
    other: dict[int, list] = {}
    for r in sorted(members):
        m = _WID.fullmatch(members[r])
        if m is None or int(m[1]) != nodes[r]:
            other[r] = [members[r], nodes[r]]
            continue
        k, i = int(m[1]), int(m[2])
        last = single[-1] if single else None
        if last and last[0] + last[1] == r and last[2] == k and last[3] + last[1] == i:
            last[1] += 1
        else:
            single.append([r, 1, k, i])
    runs: list[list[int]] = []
    for r, count, k, i in single:
        last = runs[-1] if runs else None
        if (last and last[2] == count and last[4] == i and last[3] + last[1] == k
                and last[0] + last[1] * last[2] == r):
            last[1] += 1
        else:
            runs.append([r, 1, count, k, i])
    return runs, other


def expand_runs(runs: list[list[int]], other: dict) -> tuple[dict[int, str], dict[int, int]]:
    """The membership that `member_runs` wrote: (rank -> worker id, rank -> node)."""
    members: dict[int, str] = {}
    nodes: dict[int, int] = {}
    for first, n_nodes, per, node0, idx0 in runs:
        for a in range(n_nodes):
            for j in range(per):
                r = first + a * per + j
                members[r], nodes[r] = f"n{node0 + a}w{idx0 + j}", node0 + a
    for r, (w, k) in other.items():
        members[int(r)], nodes[int(r)] = w, k
    return dict(sorted(members.items())), dict(sorted(nodes.items()))


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

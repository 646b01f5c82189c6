"""The leader's decisions as pure functions: from the current plan, the failures just
seen (or a straggler rank 0 reported) and the live spares, the next generation's plan
(replace, shrink, grow, swap) or a stop.
No store, no clock: `leader.py` gathers the facts, calls these, and publishes what they
return, so the whole failure policy is unit-tested from tables (tests/unit/test_policy.py)
the way `train/quota.py` is.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from phoenixft.cluster.membership import Plan


class Decision(enum.Enum):
    REPLACE = "replace"  # spares take the dead ranks
    SHRINK = "shrink"  # no spare left: the survivors go on, renumbered (ReCoVer)
    GROW = "grow"  # spares admitted at a committed step boundary
    SWAP = "swap"  # a spare takes a straggler's rank at a committed step boundary
    KEEP = "keep"  # a straggler stays (the reason says why)
    STOP = "stop"  # no way to go on: the reason says why and what to change


@dataclass(frozen=True, slots=True)
class Failed:
    """A member that failed, as the policy needs it."""

    wid: str
    rank: int
    detail: str
    t_fail: float
    t_detect: float


@dataclass(frozen=True, slots=True)
class Spare:
    wid: str
    node: int


@dataclass(frozen=True, slots=True)
class Next:
    decision: Decision
    plan: Plan | None = None  # the next generation's plan (None with STOP)
    reason: str = ""  # STOP: the message for the user
    taken: tuple[str, ...] = ()  # the spares the plan puts to work


def _nearest_first(node: int):
    """The order in which spares take a rank of `node`: one on that node first (it maps
    the rank's snapshot from shared memory), then by name."""
    return lambda s: (s.node != node, s.wid)


def after_failures(plan: Plan, failed: list[Failed], spares: list[Spare], *,
                   min_world: int | None, progress: int,
                   previous_recovered: bool, unit: int = 1) -> Next:
    """The next generation after members failed. Each dead rank goes to a live spare,
    preferring one on the dead rank's node (it maps the dead rank's snapshot from shared
    memory), else the lowest-named one elsewhere; when spares run out, the survivors go
    on without the dead ranks if `min_world` allows (renumbered in order), else the job
    stops. A recovery that never completed (`previous_recovered` False) is folded into
    this one: its replaced ranks and its failure times carry over.

    `unit` > 1: the job's failure unit is a replica group of `unit` consecutive ranks
    (HSDP: FSDP2 shards inside it). Spares still take dead ranks inside their group; when
    there are too few for every dead rank, each group with a dead rank leaves whole (its
    live ranks become spares) and the other groups go on."""
    members, nodes = dict(plan.members), dict(plan.nodes)
    replaced: dict[int, str] = {}
    left = sorted(spares, key=lambda s: s.wid)
    taken = []
    if len(failed) > len(left):
        return _shrink(plan, failed, min_world=min_world, progress=progress, unit=unit)
    for f in failed:
        node = plan.nodes[f.rank]
        left.sort(key=_nearest_first(node))
        spare = left.pop(0)
        members[f.rank], nodes[f.rank], replaced[f.rank] = spare.wid, spare.node, f.wid
        taken.append(spare.wid)
    t_fail = min(f.t_fail for f in failed)
    t_detect = min(f.t_detect for f in failed)
    if plan.generation > 0 and not previous_recovered:
        replaced = {**plan.replaced, **replaced}
        t_fail = min(t_fail, plan.t_fail or t_fail)
        t_detect = min(t_detect, plan.t_detect or t_detect)
    return Next(Decision.REPLACE, Plan(
        generation=plan.generation + 1, members=members, nodes=nodes, replaced=replaced,
        reason="; ".join(f"{f.wid}: {f.detail}" for f in failed),
        t_fail=t_fail, t_detect=t_detect, progress=progress), taken=tuple(taken))


def _shrink(plan: Plan, failed: list[Failed], *, min_world: int | None, progress: int,
            unit: int = 1) -> Next:
    lost = {f.rank // unit for f in failed}  # (unit 1: each dead rank is its own unit)
    alive = [(r, w) for r, w in sorted(plan.members.items()) if r // unit not in lost]
    f = failed[0]
    if min_world is None or len(alive) < min_world:
        why = ("rerun with more --spares, or let the job shrink with --min-nproc"
               if min_world is None else
               f"only {len(alive)} ranks would be left, below --min-nproc {min_world}")
        return Next(Decision.STOP, reason=f"worker {f.wid} (rank {f.rank}) failed ({f.detail}) "
                                          f"and no spare is left; {why}")
    return Next(Decision.SHRINK, Plan(
        generation=plan.generation + 1,
        members={i: w for i, (_, w) in enumerate(alive)},
        nodes={i: plan.nodes[r] for i, (r, _) in enumerate(alive)},
        replaced={x.rank: x.wid for x in failed},
        reason="shrink: " + "; ".join(f"{x.wid}: {x.detail}" for x in failed)
        + "".join(f"; replica group {u} (ranks {u * unit}-{u * unit + unit - 1}) leaves"
                  for u in sorted(lost) if unit > 1),
        t_fail=min(x.t_fail for x in failed), t_detect=min(x.t_detect for x in failed),
        progress=progress))


def grow(plan: Plan, spares: list[Spare], *, target_world: int, progress: int,
         unit: int = 1) -> Next | None:
    """Admit spares, lowest-named first, up to the job's starting size (None: nothing to
    admit), whole replica groups of `unit` ranks at a time. The caller has already held
    the members at a committed step boundary."""
    room = min(target_world - plan.world_size, len(spares)) // unit * unit
    if room <= 0:
        return None
    members, nodes = dict(plan.members), dict(plan.nodes)
    taken = []
    for s in sorted(spares, key=lambda s: s.wid):
        if len(taken) >= room:
            break
        members[len(members)] = s.wid
        nodes[len(nodes)] = s.node
        taken.append(s.wid)
    return Next(Decision.GROW, Plan(generation=plan.generation + 1, members=members,
                                    nodes=nodes, reason="grow", progress=progress),
                taken=tuple(taken))


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """What rank 0 says of a straggler (`--straggler swap`), through the store to the
    leader: which rank and worker, in which generation and at which step, and how much
    slower it computed (`ratio`, the median over `window` steps)."""

    rank: int
    wid: str
    gen: int
    step: int
    ratio: float
    window: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> StragglerReport:
        """Strict: a record of another shape (a foreign or older writer) is a ValueError
        naming what is wrong, never a KeyError deep in the leader."""
        if not isinstance(d, dict):
            raise ValueError(f"a straggler report is a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ValueError(f"a straggler report has the fields {sorted(names)}, got "
                             f"{sorted(d)}")
        report = cls(**d)
        if not (isinstance(report.wid, str) and all(
                isinstance(getattr(report, k), int) and not isinstance(getattr(report, k), bool)
                for k in ("rank", "gen", "step", "window"))
                and isinstance(report.ratio, (int, float))):
            raise ValueError(f"a straggler report's fields have the wrong types: {d}")
        return report


def swap_straggler(plan: Plan, report: StragglerReport, spares: list[Spare], *,
                   progress: int) -> Next | None:
    """The straggler's rank goes to a spare, one on its node first (it maps the rank's
    snapshot from shared memory), else the lowest-named one; nothing is rolled back (the
    caller has held the members at a committed step boundary before it publishes).
    KEEP when no spare is left; None when the report no longer applies (another
    generation, or its rank is held by another worker now)."""
    r = report.rank
    if report.gen != plan.generation or plan.members.get(r) != report.wid:
        return None
    if not spares:
        return Next(Decision.KEEP, reason="no spare to swap it for")
    spare = min(spares, key=_nearest_first(plan.nodes[r]))
    members, nodes = dict(plan.members), dict(plan.nodes)
    members[r], nodes[r] = spare.wid, spare.node
    return Next(Decision.SWAP, Plan(
        generation=plan.generation + 1, members=members, nodes=nodes,
        replaced={r: report.wid}, progress=progress,
        reason=f"straggler: {report.wid} (rank {r}) computed {report.ratio}x the other "
               f"ranks' median over {report.window} steps"), taken=(spare.wid,))

"""`phoenixft simulate`: what failures cost a job of N GPUs, for five strategies.

A discrete-event model. Failures arrive as a Poisson process at the job's rate (per-GPU
rate x N, from published data, see RATES), each one of a kind (GPU, host, network) drawn
from the given mix; each takes one node out of the job until it is repaired. Whole-job
outages (power, storage, the scheduler) arrive on their own, at `outage_per_day`
whatever the job's size. Strategies:

- restart:  checkpoint-and-restart. A checkpoint every tau seconds (Young/Daly optimum
            tau = sqrt(2 x checkpoint cost x MTBF)), each stalling training for the
            checkpoint cost; a failure loses the work since the last checkpoint plus the
            restart cost.
- spares:   phoenixft. A failure costs detect + recover + lost steps (measured); a failed
            node is replaced by a warm spare node while the pool lasts (pool refilled as
            nodes come back from repair); with no spare left the job shrinks (ReCoVer: same
            microbatches, throughput x survivors / N) until a repaired node rejoins.
            Snapshots cost their measured overhead on every step. A whole-job outage
            restarts from scratch (no persistent tier).
- recover:  ReCoVer alone (no spares): every failed node shrinks the job until repaired.
- tiers:    phoenixft + persistent tiers: as spares, but a whole-job outage resumes from
            the newest persisted step (lost: about half the persist interval).
- hsdp:     phoenixft on an HSDP job, tiers included: replica groups of `group_nodes`
            nodes, FSDP2 inside a group. A failed node is swapped for a spare inside its
            group while the pool lasts; with none left its whole group leaves (the other
            groups take its microbatches: throughput x groups left / groups, at least one)
            and comes back when the node is repaired. A group leaving or coming back costs
            `group_loss_s` of the whole job (measured by `bench goodput --dp-shard`).

Effective throughput = useful GPU-seconds / (wall time x GPUs provisioned); spares count
as provisioned. Inputs for phoenixft are the measured figures (from `bench recovery` and
`bench overhead` JSON when given); everything else is a parameter.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, replace

from phoenixft.simulate import scale
from phoenixft.simulate.rates import HOUR, MIX


class Strategy(str, enum.Enum):
    """How a job meets failures in the projection."""

    RESTART = "restart"  # checkpoint-restart (the whole job relaunches)
    SPARES = "spares"  # phoenixft: warm spares take dead ranks
    RECOVER = "recover"  # ReCoVer: no spares, survivors shrink and take the quota
    TIERS = "tiers"  # spares + a persistent tier for whole-job outages
    HSDP = "hsdp"  # replica groups: a group leaves whole

    __format__ = str.__format__  # f"{strategy}" is the value on every Python

    def __str__(self) -> str:
        return self.value


STRATEGIES = tuple(Strategy)
# the strategies that hold warm spares, and those that resume an outage from a tier
_WITH_SPARES = (Strategy.SPARES, Strategy.TIERS, Strategy.HSDP)
_WITH_TIER = (Strategy.TIERS, Strategy.HSDP)


@dataclass(frozen=True)
class Costs:
    step_s: float = 10.0  # one optimizer step of the job
    detect_s: float = 0.1  # phoenixft: failure -> noticed
    recover_s: float = 0.5  # phoenixft: new membership, state moved, groups built
    lost_steps: float = 1.0  # phoenixft: steps redone per failure (at most one)
    snapshot_overhead: float = 0.01  # phoenixft: share of every step
    restart_s: float = 600.0  # checkpoint-and-restart: relaunch, load, rendezvous
    ckpt_s: float = 60.0  # checkpoint-and-restart: training stall per checkpoint
    persist_every_s: float = 600.0  # tiers: a persisted base/delta this often
    repair_h: float = 4.0  # a failed node comes back (or is replaced) after this
    gpus_per_node: int = 8
    spare_frac: float = 0.005  # warm spare nodes as a share of the job's nodes (>= 1)
    outage_per_day: float = 1 / 14  # whole-job outages, whatever the size
    group_nodes: int = 4  # hsdp: nodes per replica group (the unit that leaves)
    group_loss_s: float = 0.5  # hsdp: a group leaving (detect + recover) or coming back


@dataclass
class Outcome:
    strategy: Strategy
    gpus: int
    mtbf_min: float
    effective: float  # useful work / (wall x provisioned), failure-free = 1.0
    failures: int


def _events(rate_per_s: float, outage_per_s: float, horizon_s: float,
            rng: random.Random) -> list[tuple[float, str]]:
    out, t = [], 0.0
    kinds, weights = list(MIX), list(MIX.values())
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= horizon_s:
            break
        out.append((t, rng.choices(kinds, weights)[0]))
    t = 0.0
    while outage_per_s > 0:
        t += rng.expovariate(outage_per_s)
        if t >= horizon_s:
            break
        out.append((t, "outage"))
    return sorted(out)


def young_daly(ckpt_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * ckpt_s * mtbf_s)


def simulate(strategy: Strategy | str, gpus: int, per_gpu_hour: float, costs: Costs, *,
             horizon_h: float = 72.0, seed: int = 0) -> Outcome:
    """One run of `horizon_h` hours of wall time; returns effective throughput. An
    unknown strategy is a ValueError naming the known ones (it ran as "recover" once)."""
    try:
        strategy = Strategy(strategy)
    except ValueError:
        raise ValueError(f"unknown strategy {strategy!r}: one of "
                         f"{', '.join(s.value for s in Strategy)}") from None
    rng = random.Random(seed)
    rate = per_gpu_hour * gpus / HOUR
    horizon = horizon_h * HOUR
    events = _events(rate, costs.outage_per_day / (24 * HOUR), horizon, rng)
    if strategy is Strategy.RESTART:
        effective = _restart_work(events, rate, horizon, costs) / horizon
    else:
        effective = _elastic_effective(strategy, events, gpus, horizon, costs)
    return Outcome(strategy, gpus, 1 / rate / 60, effective, len(events))


def _restart_work(events: list[tuple[float, str]], rate: float, horizon: float,
                  c: Costs) -> float:
    """Checkpoint-and-restart: work done in `horizon` seconds, checkpointing every Young/Daly
    interval; a failure (or outage) loses what was not checkpointed and pays a restart."""
    tau = young_daly(c.ckpt_s, 1 / rate)
    cycle = tau + c.ckpt_s  # work, then the checkpoint's stall
    work, t = 0.0, 0.0
    for tf, kind in events + [(horizon, "end")]:
        span = max(0.0, tf - t)
        full = math.floor(span / cycle)
        if kind == "end":
            work += full * tau + min(tau, span - full * cycle)
            break
        work += full * tau  # what was not checkpointed is lost
        t = max(t, tf) + c.restart_s
    return work


def _elastic_effective(strategy: Strategy, events: list[tuple[float, str]], gpus: int,
                       horizon: float, c: Costs) -> float:
    """spares / recover / tiers: useful GPU-seconds over those provisioned (spares count).
    A failed node is replaced from the spare pool while it lasts, else the job shrinks
    until a repaired node rejoins; each failure costs its stall and the step redone."""
    nodes = gpus // c.gpus_per_node
    # a group of `unit` nodes leaves for one missing node (hsdp); others lose just the node
    unit = max(1, min(c.group_nodes, nodes)) if strategy is Strategy.HSDP else 1
    spares = (max(1, math.ceil(c.spare_frac * nodes))
              if strategy in _WITH_SPARES else 0)
    provisioned = gpus + spares * c.gpus_per_node
    per_fail = c.detect_s + c.recover_s + c.lost_steps * c.step_s
    speed = 1.0 - (c.snapshot_overhead if strategy is not Strategy.RECOVER else 0.0)
    repairs: list[float] = []  # times a failed node comes back
    pool, down = spares, 0  # spare nodes ready, nodes missing from the job
    work, t = 0.0, 0.0
    groups = nodes // unit

    def share() -> float:  # of the job's throughput while `down` nodes (groups) are out
        return (nodes - down) / nodes if unit == 1 else (groups - down) / groups

    for (tf, kind) in events + [(horizon, "end")]:
        # advance to tf, handling repairs in between
        for r in sorted(x for x in repairs if x <= tf):
            work += (r - t) * speed * share()
            t = r
            repairs.remove(r)
            if down:
                down -= 1  # the repaired node rejoins the job (grow back)
                if unit > 1:
                    work -= c.group_loss_s * share()  # its group is admitted and healed
            else:
                pool += 1
        work += (tf - t) * speed * share()
        t = tf
        if kind == "end":
            break
        if kind == "outage":  # a whole-job outage
            work, t = _outage(strategy, work, t, c)
            continue
        repairs.append(tf + c.repair_h * HOUR)
        if pool:
            pool -= 1
            work -= per_fail * share()  # the stall and the step redone
        elif unit > 1:  # its group leaves; the others keep the step's finished work
            down = min(groups - 1, down + 1)
            work -= c.group_loss_s * share()
        else:
            work -= per_fail * share()
            down = min(nodes - 1, down + 1)
    return max(0.0, work) * gpus / (horizon * provisioned)


def _outage(strategy: Strategy, work: float, t: float, c: Costs) -> tuple[float, float]:
    """A whole-job outage: tiers resume from the newest persisted step (about half the
    persist interval lost); without a persistent tier the job starts over."""
    if strategy in _WITH_TIER:
        return work - min(work, c.persist_every_s / 2), t + c.restart_s
    return 0.0, t + c.restart_s


def mean_effective(strategy: str, gpus: int, rate: float, costs: Costs, runs: int,
                   horizon_h: float) -> Outcome:
    outs = [simulate(strategy, gpus, rate, costs, horizon_h=horizon_h, seed=s)
            for s in range(runs)]
    o = outs[0]
    return Outcome(o.strategy, gpus, o.mtbf_min, sum(x.effective for x in outs) / runs,
                   round(sum(x.failures for x in outs) / runs))


def sized(c: Costs, s: scale.ScaleInputs | None, gpus: int) -> Costs:
    """`c` with the costs that grow with the job (`scale.py`) taken at `gpus` GPUs: a
    spare's recovery, detection, checkpoint-restart's restart and checkpoint stall, the
    snapshot overhead, an HSDP group's loss. Without `s`, `c` as it is (constants)."""
    if s is None:
        return c
    t = scale.terms(s, gpus)
    return replace(c, detect_s=t["detect"], recover_s=t["control"] + t["comm"] + t["transfer"],
                   restart_s=t["restart"], ckpt_s=t["checkpoint"],
                   snapshot_overhead=scale.snapshot_overhead(s, gpus, c.step_s),
                   group_loss_s=scale.group_loss_s(s, gpus))


def projection(costs: Costs, sizes: list[int], rates: dict[str, float], runs: int,
               horizon_h: float, s: scale.ScaleInputs | None = None) -> list[dict]:
    rows = []
    for name, rate in rates.items():
        for n in sizes:
            c = sized(costs, s, n)
            outs = {st: mean_effective(st, n, rate, c, runs, horizon_h) for st in STRATEGIES}
            restart = outs["restart"].effective
            rows.append({"rate": name, "gpus": n, "mtbf_min": round(outs["spares"].mtbf_min, 2),
                         **{st: round(o.effective, 4) for st, o in outs.items()},
                         "recover_s": round(c.detect_s + c.recover_s, 3),
                         "restart_s": round(c.restart_s, 1),
                         "tiers_vs_restart": (round(outs["tiers"].effective / restart, 2)
                                              if restart > 0 else None)})
    return rows


def crossover(costs: Costs, gpus: int, target: float, runs: int, horizon_h: float) -> dict:
    """The per-GPU failure rate at which ReCoVer's effective throughput is `target` x that
    of checkpoint-and-restart (bisection on the rate's logarithm)."""
    lo, hi = math.log(1e-7), math.log(1e-2)

    def ratio(lr: float) -> float:
        r = math.exp(lr)
        a = mean_effective("recover", gpus, r, costs, runs, horizon_h).effective
        b = mean_effective("restart", gpus, r, costs, runs, horizon_h).effective
        return a / b if b > 0 else math.inf
    for _ in range(30):
        mid = (lo + hi) / 2
        if ratio(mid) < target:
            lo = mid
        else:
            hi = mid
    rate = math.exp(hi)
    return {"gpus": gpus, "target_ratio": target, "per_gpu_hour": rate,
            "job_mtbf_min": 60 / (rate * gpus)}



"""Which input moves a projection most: each one halved and doubled in turn, the rest
held, at one job size and failure rate (one-at-a-time sensitivity), sorted by the swing
of the projected effective throughput."""

from __future__ import annotations

from dataclasses import fields, replace

from phoenixft.simulate import scale
from phoenixft.simulate.model import Costs, mean_effective, sized

# inputs of `Costs` that stay constants across sizes (the others come from `scale.py`)
COST_INPUTS = ("step_s", "lost_steps", "repair_h", "spare_frac", "outage_per_day",
               "persist_every_s")
# reported, not used by this strategy, or a switch (`what_if_world_off_path`)
SKIP = {"store_barrier_s_16k", "group_gpus", "world_group_rebuilt"}


def sensitivity(strategy: str, gpus: int, rate: float, base: Costs, s: scale.ScaleInputs,
                runs: int, horizon_h: float) -> dict:
    def eff(c: Costs, si: scale.ScaleInputs, r: float) -> float:
        return mean_effective(strategy, gpus, r, sized(c, si, gpus), runs, horizon_h).effective

    at = eff(base, s, rate)
    rows = []

    def add(name: str, low: float, high: float, value) -> None:
        rows.append({"input": name, "value": value, "halved": round(low, 4),
                     "doubled": round(high, 4), "swing": round(abs(high - low), 4)})

    add("failure rate", eff(base, s, rate / 2), eff(base, s, rate * 2), rate)
    for f in fields(s):
        if f.name in SKIP:
            continue
        v = getattr(s, f.name)
        lo, hi = _scaled(f.name, v, 0.5), _scaled(f.name, v, 2.0)
        add(f.name, eff(base, replace(s, **{f.name: lo}), rate),
            eff(base, replace(s, **{f.name: hi}), rate), v)
    for name in COST_INPUTS:
        v = getattr(base, name)
        add(name, eff(replace(base, **{name: v * 0.5}), s, rate),
            eff(replace(base, **{name: v * 2.0}), s, rate), v)
    rows.sort(key=lambda r: -r["swing"])
    return {"strategy": strategy, "gpus": gpus, "rate": rate, "effective": round(at, 4),
            "rows": rows}


def _scaled(name: str, v: float, k: float) -> float:
    """`v` times `k`, kept inside what the input can be (shares stay within 0..1)."""
    if name in ("hang_share", "link_efficiency", "overlap"):
        return min(1.0, v * k)
    if name == "control_b":  # an exponent: 0.2 either way (doubled, N^2 would be absurd)
        return v + (0.2 if k > 1 else -0.2)
    return v * k


def recovery_budget(strategy: str, gpus: int, rate: float, base: Costs, s: scale.ScaleInputs,
                    target: float, runs: int, horizon_h: float) -> dict:
    """The longest a spare's recovery (detection aside) may take for `strategy` to reach
    `target` at `gpus` GPUs and `rate` (bisection), beside what the model gives now.
    None when even a free recovery misses the target (the other costs are too large)."""
    c = sized(base, s, gpus)

    def eff(rec: float) -> float:
        return mean_effective(strategy, gpus, rate, replace(c, recover_s=rec), runs,
                              horizon_h).effective

    budget = None
    if eff(0.0) >= target:
        lo, hi = 0.0, max(c.recover_s, 1.0)
        while eff(hi) >= target and hi < 1e5:
            lo, hi = hi, hi * 2
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if eff(mid) >= target else (lo, mid)
        budget = round(lo, 2)
    return {"strategy": strategy, "gpus": gpus, "target": target, "model_recover_s":
            round(c.recover_s, 2), "budget_s": budget,
            "free_recovery_effective": round(eff(0.0), 4)}


def what_if_world_off_path(strategy: str, gpus: int, rate: float, base: Costs,
                           s: scale.ScaleInputs, runs: int, horizon_h: float) -> dict:
    """`strategy` at `gpus` if a recovery rebuilt only the groups that held the failed
    rank (the world group off its path: not built yet), beside the model as it is."""
    off = replace(s, world_group_rebuilt=False)
    c = sized(base, off, gpus)
    return {"effective": round(mean_effective(strategy, gpus, rate, c, runs,
                                              horizon_h).effective, 4),
            "recover_s": round(c.detect_s + c.recover_s, 2),
            "rebuilt_ranks": scale.rebuilt_ranks(off, gpus)}

"""The simulator checked against a real run: predict each faulted mode's goodput ratio of
a `phoenixft bench goodput` result from that run's own inputs, and compare with what it
measured (goal: error <= 10%). Reads the goodput and recovery JSON only."""

from __future__ import annotations

from collections.abc import Callable

from phoenixft.observe.steps import StepEvent, step_pairs


def _replay(kills_s: list[float], steps: int, step_s: float, cost, slow) -> float:
    """Wall time of `steps` steps at `step_s` each, with a fault at each time in `kills_s`
    (seconds after the first step) costing `cost(steps_done)` seconds, after which steps
    take `slow(faults so far)` x longer."""
    t = done = 0.0
    for k, tk in enumerate(sorted(kills_s)):
        if tk <= t:
            tk = t
        done += (tk - t) / (step_s * slow(k))
        if done >= steps:
            break
        t = tk + cost(done)
    return t + max(0.0, steps - done) * step_s * slow(len(kills_s))


def _step_gaps(row: dict, before: float = float("inf")) -> dict[int, list[float]]:
    """The run's gaps between consecutive steps of one epoch and world size, by world
    size, for steps ending before `before` (seconds after launch)."""
    gaps: dict[int, list[float]] = {}
    steps = [StepEvent(t, step, epoch, world) for t, step, world, epoch in row.get("progress", [])]
    for a, b in step_pairs(steps, before=before):
        gaps.setdefault(b.world_size, []).append(b.t - a.t)
    return gaps


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _base_step_s(row: dict) -> float:
    """The run's own failure-free step time: the median gap between consecutive steps
    before its first fault (the machine's speed during that run, an input)."""
    first_kill = min((k["t_rel"] for k in row.get("kills", [])), default=float("inf"))
    gaps = [g for gs in _step_gaps(row, first_kill).values() for g in gs]
    if not gaps:
        return row.get("median_step_s") or 1 / row["eff_steps_s"]
    return _median(gaps)


def _slowdown(mode: str, row: dict, n: int, cores: int,
              step_s: float) -> Callable[[int], float]:
    """How much longer than `step_s` a step takes after k faults. Only a shrink changes
    it: at the speed the run measured at each world size (on a machine with fewer cores
    than workers a shrunk job's steps are not slower in proportion to its survivors:
    4 workers on 2 cores ran as fast after losing two), or, where fewer than 3 steps ran
    at a size, throughput following min(workers, cores)."""
    if mode != "shrink":
        return lambda k: 1.0
    by_world = {w: _median(g) for w, g in _step_gaps(row).items() if len(g) >= 3}
    return lambda k: (by_world[n - k] / step_s if n - k in by_world
                      else min(n, cores) / max(1, min(n - k, cores)))


def _fault_cost(mode: str, goodput: dict, row: dict, rec: list[dict], step_s: float):
    """Seconds one fault costs, as a function of the steps done (for lost work)."""
    if mode in ("spares", "shrink"):
        per = sum(r["detect_s"] + r["recover_s"] for r in rec) / len(rec)
        lost = 0.0 if mode == "shrink" else sum(r["lost_steps"] for r in rec) / len(rec)
        return lambda done: per + lost * step_s
    restarts = [x - step_s for x in row.get("kill_to_next_step_s", [])]
    restart_s = sum(restarts) / len(restarts) if restarts else 0.0
    every = goodput.get("ckpt_every") or 1
    return lambda done: restart_s + (done % every) * step_s


def validate(goodput: dict, recovery: dict | None) -> list[dict]:
    """Predict each faulted mode's goodput ratio (its effective steps/s over the
    failure-free run's) from: the run's own step time before its first fault, the fault
    schedule, phoenixft's per-fault cost from `bench recovery` (detect + recover + lost
    steps: a separate run), torchrun's restart time (the run's kill-to-next-step less a
    step: no other benchmark measures it) and work lost since its last checkpoint, and the
    machine's speed after a shrink (`_slowdown`)."""
    modes, n = goodput["modes"], goodput["nproc"]
    clean_eff = modes["clean"]["eff_steps_s"]
    cores = goodput.get("cpu_count") or 1
    rec = [r for r in (recovery or {}).get("rows", []) if r["fault"].startswith("kill")]
    rec = [r for r in rec if r["nproc"] == n] or rec
    out = []
    for mode in ("spares", "shrink", "restart"):
        row = modes.get(mode)
        if not row or not row.get("completed") or not row.get("kills"):
            continue
        if mode != "restart" and not rec:
            continue
        step_s = _base_step_s(row)
        first = row["first_step_after_launch_s"]
        kills = [k["t_rel"] - first for k in row["kills"]]
        steps = row["final_step"] - 1
        cost = _fault_cost(mode, goodput, row, rec, step_s)
        wall = _replay(kills, steps, step_s, cost, _slowdown(mode, row, n, cores, step_s))
        predicted = (steps / wall) / clean_eff
        measured = row["eff_steps_s"] / clean_eff
        out.append({"mode": mode, "predicted_ratio": round(predicted, 4),
                    "measured_ratio": round(measured, 4), "predicted_wall_s": round(wall, 3),
                    "measured_wall_s": round(row["wall_s"], 3),
                    "error": round(abs(predicted - measured) / measured, 4)})
    return out

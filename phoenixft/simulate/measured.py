"""The simulator's inputs that the benchmarks measure, read from their JSON results
(`bench recovery`: detect, recover, lost steps per kill; `bench overhead`: the snapshot
cost per step). Only the files are read, so the simulator runs without the benchmark code
(and its extra dependencies) installed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from phoenixft.simulate.model import Costs


def read_json(path: str | None) -> dict | None:
    """The JSON at `path`, or None when no path or no such file is given (the simulator
    then runs on its parameters alone)."""
    if not path or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text())


def measured_costs(recovery_json: str | None, overhead_json: str | None, base: Costs) -> Costs:
    """Our measured recovery figures and snapshot overhead, where given."""
    c = base
    recovery, ov = read_json(recovery_json), read_json(overhead_json)
    if recovery is not None:
        rows = [r for r in recovery["rows"]
                if r["fault"].startswith("kill")]
        if rows:
            c = replace(c, detect_s=max(r["detect_s"] for r in rows),
                        recover_s=max(r["recover_s"] for r in rows),
                        lost_steps=max(r["lost_steps"] for r in rows))
    if ov is not None:
        # step time with snapshots over without: the on/off blocks inside one run (same
        # processes, same load) when measured; across separate runs the noise is larger
        # than the effect (0.97-1.04 here), and a ratio below 1 would count as free
        ratio = (ov.get("in_run") or {}).get("ratio", ov.get("ratio"))
        if ratio is not None:
            c = replace(c, snapshot_overhead=max(0.0, ratio - 1.0))
    return c


def hsdp_costs(goodput_json: str | None, base: Costs) -> Costs:
    """A replica group leaving, measured: the mean detect + recover of the group losses in
    a `bench goodput --dp-shard` run's `shrink` mode (its recoveries), where given."""
    run = read_json(goodput_json)
    if run is None:
        return base
    if not str(run.get("layout", "")).startswith("hsdp"):
        raise SystemExit(f"phoenixft simulate: {goodput_json} is a {run.get('layout', 'dp')} "
                         "goodput run; --hsdp-json needs one of `phoenixft bench goodput "
                         "--dp-shard S`")
    rec = [r for r in run["modes"].get("shrink", {}).get("recoveries", [])
           if r.get("replacement") is None and r.get("recover_s") is not None]
    if not rec:
        return base
    return replace(base, group_loss_s=sum(r["detect_s"] + r["recover_s"] for r in rec) / len(rec))


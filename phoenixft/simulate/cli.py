"""The `phoenixft simulate` command: its flags, then project, find the crossover, validate
against a goodput run when one is given, report and write the JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from phoenixft.observe.goals import as_dicts
from phoenixft.simulate import model, report, scale
from phoenixft.simulate.measured import hsdp_costs, measured_costs, read_json
from phoenixft.simulate.model import Costs, crossover, projection, sized
from phoenixft.simulate.plot import plot
from phoenixft.simulate.published import validate_published
from phoenixft.simulate.rates import MIX, RATES, parse_rates
from phoenixft.simulate.scale import ScaleInputs
from phoenixft.simulate.sensitivity import recovery_budget, sensitivity, what_if_world_off_path
from phoenixft.simulate.validate import validate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="project goodput to 100k+ GPUs under published "
                                        "failure rates: checkpoint-restart, spares, ReCoVer, "
                                        "tiers, HSDP replica groups", description=model.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1024,4096,16384,32768,65536,100000,131072",
                   help="comma-separated job sizes")
    p.add_argument("--rates", default="llama3,projected",
                   help=f"failure-rate presets ({', '.join(RATES)}) or per-GPU-hour numbers")
    p.add_argument("--step-s", type=float, default=Costs.step_s)
    p.add_argument("--restart-s", type=float, default=Costs.restart_s,
                   help="checkpoint-and-restart: seconds from a failure to training again")
    p.add_argument("--ckpt-s", type=float, default=Costs.ckpt_s,
                   help="checkpoint-and-restart: training stall per checkpoint")
    p.add_argument("--spare-frac", type=float, default=Costs.spare_frac,
                   help="warm spare nodes as a share of the job's nodes (at least one)")
    p.add_argument("--outage-per-day", type=float, default=Costs.outage_per_day,
                   help="whole-job outages per day (power, storage, scheduler)")
    p.add_argument("--repair-h", type=float, default=Costs.repair_h)
    p.add_argument("--group-nodes", type=int, default=Costs.group_nodes,
                   help="hsdp: nodes per replica group (the unit that leaves)")
    p.add_argument("--hsdp-json", default="runs/bench/goodput-hsdp.json",
                   help="measured cost of a replica group leaving (phoenixft bench goodput "
                        "--dp-shard 2 --out ...)")
    p.add_argument("--recovery-json", default="runs/bench/recovery.json",
                   help="measured detect/recover/lost steps (phoenixft bench recovery)")
    p.add_argument("--overhead-json", default="runs/bench/overhead.json",
                   help="measured snapshot overhead (phoenixft bench overhead)")
    p.add_argument("--params", type=float, default=ScaleInputs.params,
                   help="the job's model size in parameters (state bytes, shards, restarts)")
    p.add_argument("--control-plane-json", default="runs/bench/control-plane.json",
                   help="the control plane's cost against N (phoenixft bench control-plane)")
    p.add_argument("--plot", default="runs/bench/simulate.png",
                   help="the projection as a PNG (empty: none)")
    p.add_argument("--sensitivity-runs", type=int, default=8,
                   help="Monte-Carlo runs per cell of the sensitivity table (0: none)")
    p.add_argument("--runs", type=int, default=16, help="Monte-Carlo runs per cell")
    p.add_argument("--horizon-h", type=float, default=168.0, help="simulated wall time per run")
    p.add_argument("--validate", default="runs/bench/goodput.json", metavar="GOODPUT_JSON",
                   help="predict this `phoenixft bench goodput` run's ratios and report the "
                        "error (skipped if the file does not exist)")
    p.add_argument("--out", default="runs/bench/simulate.json")
    p.set_defaults(func=cmd_simulate)


def simulate_result(args: argparse.Namespace) -> dict:
    """The projection, the crossover and the validation for these flags, with their goals."""
    base = Costs(step_s=args.step_s, restart_s=args.restart_s, ckpt_s=args.ckpt_s,
                 spare_frac=args.spare_frac, outage_per_day=args.outage_per_day,
                 repair_h=args.repair_h, group_nodes=args.group_nodes)
    if args.group_nodes < 1:
        raise SystemExit(f"phoenixft simulate: --group-nodes must be >= 1, got {args.group_nodes}")
    costs = hsdp_costs(args.hsdp_json, measured_costs(args.recovery_json, args.overhead_json, base))
    if args.params <= 0:
        raise SystemExit(f"phoenixft simulate: --params must be > 0, got {args.params}")
    s = scale_inputs(costs, args)
    sizes = [int(x) for x in args.gpus.split(",")]
    rates = parse_rates(args.rates)
    rows = projection(costs, sizes, rates, args.runs, args.horizon_h, s)
    cross = crossover(sized(costs, s, 16384), 16384, 2.23, args.runs, args.horizon_h)
    goodput = read_json(args.validate)
    checks = [] if goodput is None else validate(goodput, read_json(args.recovery_json))
    result = {"benchmark": "simulate", "costs": asdict(costs), "rates": rates, "mix": MIX,
              "rows": rows, "crossover_2_23x": cross, "validation": checks,
              "scale_inputs": s.as_table(),
              "recovery_terms": {n: scale.terms(s, n) for n in sizes},
              "published": validate_published(s, costs, costs.lost_steps, args.runs,
                                              args.horizon_h),
              "sensitivity": _sensitivity(costs, s, rates, args)}
    if args.plot:
        try:
            result["plot"] = str(plot(rows, args.plot))
        except ModuleNotFoundError as exc:  # matplotlib is an extra: said, not skipped quietly
            result["plot"] = None
            print(f"phoenixft simulate: no plot ({exc.name} is not installed: pip install "
                  "'phoenixft[plot]', or --plot '')")
    result["goals"] = as_dicts(report.goals(result))
    return {**result, "runs": args.runs, "horizon_h": args.horizon_h}


def scale_inputs(costs: Costs, args: argparse.Namespace) -> ScaleInputs:
    """The size-dependent inputs: the defaults (`scale.SOURCES`), the model size asked
    for, our control plane's fit and our measured detection and snapshot floor."""
    s = replace(ScaleInputs(), params=args.params, detect_exit_s=costs.detect_s,
                snapshot_floor=costs.snapshot_overhead)
    return s.with_measured(args.control_plane_json)


def _sensitivity(costs: Costs, s: ScaleInputs, rates: dict, args: argparse.Namespace) -> list:
    """Tiers at 16k GPUs (Llama 3's rate) and at 100k (the projected rate), where asked."""
    if args.sensitivity_runs <= 0:
        return []
    out = []
    for name, gpus in (("llama3", 16384), ("projected", 100000)):
        if name in rates:
            out.append({"rate_name": name, **sensitivity(
                "tiers", gpus, rates[name], costs, s, args.sensitivity_runs, args.horizon_h),
                "budget": recovery_budget("tiers", gpus, rates[name], costs, s, 0.9,
                                          args.sensitivity_runs, args.horizon_h),
                "world_off_path": what_if_world_off_path(
                    "tiers", gpus, rates[name], costs, s, args.sensitivity_runs,
                    args.horizon_h)})
    return out


def cmd_simulate(args: argparse.Namespace) -> int:
    result = simulate_result(args)
    report.show(result, args.validate if args.validate and Path(args.validate).is_file() else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0

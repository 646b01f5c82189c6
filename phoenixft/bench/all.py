"""`phoenixft bench all [--quick] [--out FILE]`: every benchmark, one report.

Runs each benchmark in its own process, one after another (they would disturb each other's
timings side by side on a small machine), then `phoenixft simulate` fed with the measured
figures. Writes FILE (JSON: each benchmark's result with a `goals` list of
{"name", "goal", "measured", "met"}) and BENCHMARKS.md beside it (a table per benchmark,
the command, the machine, processes and threads). `--quick` uses the smallest sizes that
still measure something (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

# name -> (benchmark, quick arguments, processes and threads in words); without --quick
# each benchmark runs at its own defaults
PLAN = {
    "overhead": ("overhead", ["--pairs", "2", "--steps", "30", "--blocks", "80"],
                 "2 workers x 1 torch thread, snapshots on and off in turn"),
    "recovery": ("recovery", ["--steps", "20", "--preset", "tiny"],
                 "2 or 4 workers + 1 spare, 1 torch thread each"),
    "recovery-small": ("recovery", ["--steps", "20", "--preset", "small", "--trials", "0,2",
                                    "--repeat", "2"],
                       "2 or 4 workers + 1 spare, 1 torch thread each, small preset"),
    "goodput": ("goodput", ["--quick"],
                "4 workers x 1 torch thread per mode; torchrun DDP for restart"),
    "checkpoint": ("checkpoint", ["--steps", "24", "--every", "4"], "1 process x 2 torch threads"),
    "serve": ("serve", ["--concurrency", "1", "8", "--rounds", "2", "--repeats", "1"],
              "1 process x 2 torch threads, engine and transformers in turn"),
    "serve-medium": ("serve", ["--size", "medium", "--concurrency", "8", "32", "--rounds", "2",
                               "--repeats", "1"],
                     "1 process x 2 torch threads, a 54M-parameter model"),
    "serve-ft": ("serve-ft", ["--contexts", "256,1024", "--blocks", "110"],
                 "engine 1 torch thread + log executor process; front + 2 engines end to end"),
    "torchft": ("torchft", ["--steps", "34", "--kill-step", "20", "--no-free-runs"],
                "2 members x 1 torch thread each (+1 spare / +1 lighthouse); plain DDP beside"),
}
FULL = {"serve-medium": ["--size", "medium"],  # what tells two runs of one benchmark apart
        "recovery-small": ["--preset", "small", "--trials", "0,2", "--repeat", "3"]}


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({model}), Linux {platform.release()}, no GPU" \
        if not _has_cuda() else f"{os.cpu_count()} CPU cores ({model}) + CUDA GPU"


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _goal(name: str, goal: str, measured, met: bool) -> dict:
    return {"name": name, "goal": goal, "measured": measured, "met": bool(met)}


def goals_of(name: str, d: dict) -> list[dict]:
    """Each benchmark's goals, from the issues it measures, in one shape."""
    if isinstance(d.get("goals"), list):
        return d["goals"]
    if name == "overhead":
        r = d["in_run"]
        cpu = r["thread_cpu_share_of_step"]
        return [_goal("step time with snapshots, on/off blocks in one run", "<= 1.01x without",
                      f"{r['ratio']:.4f} ± {r['se']:.4f}", r["ratio"] <= 1.01),
                _goal("snapshot thread CPU per snapshot, cores shared with the workers",
                      "<= 1% of a step", f"{100 * cpu:.2f}%", cpu <= 0.01),
                _goal("same final state with snapshots on and off", "identical",
                      d["same_final_state"], d["same_final_state"])]
    if name in ("recovery", "recovery-small"):
        kills = [r for r in d["rows"] if r["fault"].startswith("kill")]
        worst = max((r["recover_s"] for r in kills), default=float("nan"))
        lost = max((r["lost_steps"] for r in d["rows"]), default=0)
        out = [_goal("recovery after a SIGKILL (worst case)", f"<= {d['goal_recover_s']} s",
                     worst, worst <= d["goal_recover_s"]),
               _goal("steps lost per failure", "<= 1", lost, lost <= 1)]
        stall = d.get("max_stall_s_kill")
        if stall is not None:
            out.append(_goal("SIGKILL -> next step, beyond the step struck and any step "
                             "rolled back (worst case)",
                             f"<= {d['goal_stall_s']} s", stall, stall <= d["goal_stall_s"]))
        four = d.get("four_workers")
        if name == "recovery-small" and four:
            out += [_goal("4 workers: detection -> training again (median)",
                          f"<= {four['goal_recover_s']} s",
                          f"{four['recover_s']:.3f} s (of which protocol "
                          f"{four['protocol_s']:.3f} s)", four["recover_s"] <= four["goal_recover_s"]),
                    _goal("4 workers: SIGKILL -> next step, beyond one step (median)",
                          f"<= {four['goal_stall_s']} s", f"{four['stall_s']:.3f} s "
                          f"({four['step_s']:.3f} s steps)", four["stall_s"] <= four["goal_stall_s"])]
        return out
    if name == "goodput":
        m = d["modes"]
        shrink, restart = m.get("shrink", {}), m.get("restart", {})
        out = []
        if shrink.get("vs_restart") is not None:
            out.append(_goal("ReCoVer vs checkpoint-and-restart", ">= 2.23x",
                             round(shrink["vs_restart"], 3), shrink["vs_restart"] >= 2.23))
        if shrink.get("vs_clean_scaled") is not None:
            out.append(_goal("ReCoVer vs failure-free scaled by survivors", ">= 0.9x",
                             round(shrink["vs_clean_scaled"], 3), shrink["vs_clean_scaled"] >= 0.9))
        if restart.get("completed") is not None:
            out.append(_goal("every mode completed", "yes",
                             all(r.get("completed") for r in m.values()),
                             all(r.get("completed") for r in m.values())))
        return out
    if name in ("serve", "serve-medium"):
        return [_goal(f"engine vs transformers at {r['concurrency']} concurrent (ceiling "
                      f"for equal step costs: {r['ceiling']:.2f}x"
                      + (f"; transformers' step / the engine's: {r['step_cost_ratio']:.2f}x"
                         if "step_cost_ratio" in r else "") + ")", ">= 2x",
                      round(r["speedup"], 2), r["speedup"] >= 2)
                for r in d["results"] if r["concurrency"] >= 8]
    return []


def headline(name: str, d: dict) -> str:
    """One line per benchmark for the README's first screen."""
    try:
        if name == "overhead":
            r, loc = d["in_run"], d["in_run_local_replica"]
            return (f"step time with snapshots: {r['ratio']:.3f}x ± {r['se']:.3f} without "
                    f"(on/off blocks in one run), snapshot thread "
                    f"{100 * r['thread_cpu_share_of_step']:.1f}% of a step; with a copy on "
                    f"the same node (--replicas 1) {loc['ratio']:.3f}x ± {loc['se']:.3f}, "
                    f"{100 * loc['thread_cpu_share_of_step']:.1f}%")
        if name == "recovery-small" and d.get("four_workers"):
            f = d["four_workers"]
            return (f"4 workers, {f['step_s']:.2f} s steps: SIGKILL -> next step "
                    f"{f['stall_s']:.2f} s beyond one step, detection -> training again "
                    f"{f['recover_s']:.2f} s, of which the recovery protocol "
                    f"{f['protocol_s']:.2f} s (the rest: survivors finishing their "
                    f"microbatches, which are kept; medians of {f['runs']})")
        if name in ("recovery", "recovery-small"):
            k = [r for r in d["rows"] if r["fault"].startswith("kill")]
            return (f"SIGKILL -> training again: detect {max(r['detect_s'] for r in k):.2f} s, "
                    f"recover {max(r['recover_s'] for r in k):.2f} s, "
                    f"next step {max(r['kill_to_next_step_s'] for r in k):.2f} s (worst of "
                    f"{len(k)})")
        if name == "goodput":
            m = d["modes"]
            parts = [f"{k} {m[k]['eff_steps_s'] / m['clean']['eff_steps_s']:.2f}"
                     for k in ("spares", "shrink", "restart") if k in m and m[k].get("eff_steps_s")]
            return "goodput vs failure-free, " + ", ".join(parts) + \
                f" ({d['failures']} SIGKILLs)"
        if name == "checkpoint":
            return "; ".join(f"{g['name']}: {g['measured']}" for g in d["goals"][:2])
        if name in ("serve", "serve-medium"):
            size = d["model"].split(",")[1].strip()
            return size + ": " + ", ".join(f"{r['speedup']:.2f}x transformers at "
                                           f"{r['concurrency']}" for r in d["results"])
        if name == "serve-ft":
            return "; ".join(f"{g['name']}: {g['measured']}" for g in d["goals"])
        if name == "torchft":
            p, t = d["rows"]["phoenixft"], d["rows"]["torchft"]
            return (f"SIGKILL -> survivor's next step: phoenixft {p['kill_to_survivor_step_s']:.2f} s, "
                    f"torchft {t['kill_to_survivor_step_s']:.2f} s; back to full strength "
                    f"{p['kill_to_full_strength_s']:.2f} s vs {t['kill_to_full_strength_s']} s; "
                    f"microbatches not trained {p['microbatches_not_trained']} vs "
                    f"{t['microbatches_not_trained']}; step time vs plain DDP "
                    f"{p['step_ratio_vs_ddp']:.2f}x vs {t['step_ratio_vs_ddp']:.2f}x")
        if name == "simulate":
            rows = {(r["rate"], r["gpus"]): r for r in d["rows"]}
            a, b = rows[("llama3", 16384)], rows[("projected", 100000)]
            errs = ", ".join(f"{v['mode']} {100 * v['error']:.0f}%" for v in d["validation"])
            return (f"phoenixft + tiers {a['tiers']:.3f} of failure-free at 16k GPUs (Llama 3 "
                    f"rate; restart {a['restart']:.3f}), {b['tiers']:.3f} at 100k (projected; "
                    f"restart {b['restart']:.3f}); validation error {errs}")
    except (KeyError, ValueError, ZeroDivisionError, IndexError, TypeError):
        pass
    return "(see the JSON)"


def _markdown(report: dict) -> str:
    lines = ["# Benchmarks", "",
             f"`phoenixft bench all{' --quick' if report['quick'] else ''}` on "
             f"{report['machine']}; {report['wall_s'] / 60:.1f} minutes in all. Every figure "
             "is a ratio against the alternative run in the same invocation, or a time "
             "measured here; the JSON beside this file has every number.", "",
             "| benchmark | headline | goals met |", "|---|---|---|"]
    for name, b in report["benchmarks"].items():
        met = sum(g["met"] for g in b["goals"])
        lines.append(f"| {name} | {b['headline']} | {met}/{len(b['goals'])} |")
    for name, b in report["benchmarks"].items():
        lines += ["", f"## {name}", "", f"`{b['command']}` ({b['processes']}; "
                  f"{b['wall_s']:.0f} s, exit {b['rc']})", ""]
        if b["goals"]:
            lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
            lines += [f"| {g['name']} | {g['goal']} | {g['measured']} | "
                      f"{'yes' if g['met'] else '**no**'} |" for g in b["goals"]]
        extra = b.get("table")
        if extra:
            lines += [""] + extra
    return "\n".join(lines) + "\n"


def _simulate_tables(d: dict) -> list[str]:
    rows = ["| rate | GPUs | job MTBF | restart | spares | ReCoVer | spares + tiers | "
            "tiers / restart |", "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['rate']} | {r['gpus']:,} | {r['mtbf_min']:.1f} min | "
                    f"{r['restart']:.3f} | {r['spares']:.3f} | {r['recover']:.3f} | "
                    f"{r['tiers']:.3f} | {r['tiers_vs_restart']}x |")
    c = d["crossover_2_23x"]
    rows += ["", f"ReCoVer reaches {c['target_ratio']}x checkpoint-and-restart at "
             f"{c['gpus']:,} GPUs when the job's MTBF is {c['job_mtbf_min']:.1f} minutes "
             f"({c['per_gpu_hour']:.2e} failures per GPU-hour)."]
    if d.get("validation"):
        rows += ["", "| validation | predicted ratio | measured ratio | error |",
                 "|---|---|---|---|"]
        rows += [f"| {v['mode']} | {v['predicted_ratio']:.3f} | {v['measured_ratio']:.3f} | "
                 f"{100 * v['error']:.1f}% |" for v in d["validation"]]
    return rows


def _torchft_table(d: dict) -> list[str]:
    cols = [("step_s", "step s"), ("step_ratio_vs_ddp", "step / plain DDP"),
            ("kill_to_survivor_step_s", "kill -> survivor's next step s"),
            ("kill_to_full_strength_s", "kill -> full strength s"),
            ("lost_steps", "updates thrown away"),
            ("microbatches_not_trained", "microbatches not trained")]
    rows = ["| system | " + " | ".join(c for _, c in cols) + " |",
            "|---" * (len(cols) + 1) + "|"]
    for name, r in d["rows"].items():
        rows.append(f"| {name} | " + " | ".join(str(r[k]) for k, _ in cols) + " |")
    return rows + ["", f"torchft {d['torchft_version']}; plain DDP step {d['ddp_step_s']} s; "
                   f"{d['processes']}."]


def _checkpoint_table(d: dict) -> list[str]:
    """bench checkpoint's cost table (`checkpoint.cost_rows`), as markdown."""
    from .checkpoint import COST_COLUMNS, cost_rows, session_line
    rows = ["| " + " | ".join(COST_COLUMNS) + " |", "|" + "---|" * len(COST_COLUMNS)]
    rows += ["| " + " | ".join(r) + " |" for r in cost_rows(d)]
    p = d["modes"].get("phoenixft", {}).get("1", {})
    return rows + ["", f"Plain loop: {1000 * d['step_s']:.0f} ms a step. phoenixft persisted every "
                   f"{p.get('stride')}th step (its persister's CPU share, 5% of a core by default). "
                   + session_line(d)]


def cmd_all(args) -> int:
    out = Path(args.out)
    work = out.parent / "all"
    work.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "all", "quick": args.quick, "machine": _machine(),
              "benchmarks": {}}
    if args.only and out.exists():  # refresh some benchmarks of an existing report
        report["benchmarks"] = json.loads(out.read_text()).get("benchmarks", {})
    names = [n for n in PLAN if not args.only or n in args.only.split(",")]
    overrides = {}
    for spec in args.with_args:
        name, _, rest = spec.partition(":")
        if name not in PLAN:
            raise SystemExit(f"phoenixft bench all: --with {spec!r}: unknown benchmark {name!r}")
        overrides[name] = shlex.split(rest)
    for name in names:
        bench, quick, procs = PLAN[name]
        extra = quick if args.quick else FULL.get(name, [])
        extra = overrides.get(name, extra)
        argv = [sys.executable, "-m", "phoenixft.cli", "bench", bench, *extra,
                "--out", str(work / f"{name}.json")]
        shown = "phoenixft bench " + " ".join([bench, *extra])
        print(f"[all] {shown}", flush=True)
        t = time.time()
        with (work / f"{name}.log").open("w") as log:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
        entry = {"command": shown, "processes": procs, "rc": rc, "wall_s": time.time() - t,
                 "log": str(work / f"{name}.log")}
        path = work / f"{name}.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        entry.update(result=data, goals=goals_of(name, data) if data else [],
                     headline=headline(name, data) if data else f"failed (exit {rc}): see "
                     f"{entry['log']}")
        if name == "torchft" and data:
            entry["table"] = _torchft_table(data)
        if name == "checkpoint" and data:
            entry["table"] = _checkpoint_table(data)
        report["benchmarks"][name] = entry
        print(f"[all] {name}: {entry['headline']} ({entry['wall_s']:.0f} s)", flush=True)
    sim = ["--out", str(work / "simulate.json"), "--validate", str(work / "goodput.json"),
           "--recovery-json", str(work / "recovery.json"),
           "--overhead-json", str(work / "overhead.json")]
    t = time.time()
    with (work / "simulate.log").open("w") as log:
        rc = subprocess.run([sys.executable, "-m", "phoenixft.cli", "simulate", *sim],
                            stdout=log, stderr=subprocess.STDOUT).returncode
    data = json.loads((work / "simulate.json").read_text()) if rc == 0 else {}
    report["benchmarks"]["simulate"] = {
        "command": "phoenixft simulate (fed with the figures above)",
        "processes": "1 process", "rc": rc, "wall_s": time.time() - t, "result": data,
        "goals": data.get("goals", []), "headline": headline("simulate", data),
        "table": _simulate_tables(data) if data else None}
    report["wall_s"] = sum(b["wall_s"] for b in report["benchmarks"].values())
    out.write_text(json.dumps(report, indent=2))
    md = Path(args.markdown)
    md.write_text(_markdown(report))
    print(f"wrote {out} and {md} ({report['wall_s'] / 60:.1f} min)")
    return 0 if all(b["rc"] == 0 for b in report["benchmarks"].values()) else 1


def register(sub) -> None:
    p = sub.add_parser("all", help="every benchmark and the simulator: one JSON report and "
                                   "BENCHMARKS.md", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest sizes (~10 min on 2 cores)")
    p.add_argument("--out", default="runs/bench/all.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="the report (default ./BENCHMARKS.md)")
    p.add_argument("--with", dest="with_args", action="append", default=[],
                   metavar="NAME:ARGS", help="run benchmark NAME with these arguments instead, "
                   "e.g. --with 'overhead:--pairs 1 --preset tiny'")
    p.add_argument("--only", default=None, help="comma-separated benchmarks to run; the "
                                                "others keep their figures from --out")
    p.set_defaults(func=cmd_all)

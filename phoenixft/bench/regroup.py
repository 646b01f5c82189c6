"""`phoenixft bench regroup`: which communicators a recovery rebuilds, before and after
recovery kept the whole ones (`train/kept_groups.py`).

One HSDP job (examples/train_fsdp.py, replica groups of --dp-shard FSDP2 ranks) with a
warm spare; a rank of replica group 2 is SIGKILLed inside its backward at step --kill-step.
It runs twice side by side, one after the other in the same process tree: with
`--rebuild-groups` (every group of the job built anew: the behaviour before) and without
(the mesh groups the recovery finds whole are kept). Per run, from the events:

- the generation's communicators (the world group and every mesh group), those rebuilt,
  and those that contained the dead rank;
- the ranks whose collectives were left unfinished when they left the failed generation
  (any group; and in their replica group's own mesh groups);
- each rebuilt group's build time against its size (from the build's start, early in the
  survivors' plan watcher, to the group formed: it includes waiting for its members);
- detection -> training again, and SIGKILL -> the next step;
- the final state's digest (equal in both runs: the same job, the same failure).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from phoenixft.bench.harness import EXAMPLE, median, run_job
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal

FSDP_EXAMPLE = EXAMPLE.with_name("train_fsdp.py")
MODES = {"rebuild": "every group rebuilt (--rebuild-groups)", "keep": "whole groups kept"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("regroup", help="communicators a recovery rebuilds, with and without "
                                       "keeping the whole ones")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--dp-shard", type=int, default=2, help="FSDP2 ranks per replica group")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-step", type=int, default=4)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "ref"])
    p.add_argument("--repeat", type=int, default=1, help="runs of each mode")
    p.add_argument("--out", default="runs/bench/regroup.json")
    p.set_defaults(func=command(measure, show))


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    groups = args.nproc // args.dp_shard
    if args.dp_shard < 2 or args.nproc % args.dp_shard or groups < 3 \
            or not 2 <= args.kill_step < args.steps:
        raise SystemExit("phoenixft bench regroup: --dp-shard >= 2 dividing --nproc into 3 "
                         "replica groups or more; 2 <= --kill-step < --steps")
    dead = 2 * args.dp_shard + 1  # a rank of replica group 2
    fault = f"kill:rank={dead}:step={args.kill_step}:phase=backward"
    root = opts.runs_dir("regroup")
    rows, t0 = [], time.time()
    for i in range(args.repeat):
        for mode in MODES:
            s = run_job(root / f"{mode}-{i}", script=str(FSDP_EXAMPLE), nproc=args.nproc,
                        spares=1, inject=[fault], groups={"keep": mode == "keep"},
                        script_args=["--dp-shard", str(args.dp_shard), "--steps",
                                     str(args.steps), "--preset", args.preset])
            row = {"mode": mode, "run": i, **figures(s["events"], dead),
                   "digest": s["final_state_digest"]}
            rows.append(row)
            print({k: v for k, v in row.items() if k != "builds"}, flush=True)
    return {"benchmark": "regroup", "nproc": args.nproc, "dp_shard": args.dp_shard,
            "replica_groups": groups, "dead_rank": dead, "fault": fault,
            "preset": args.preset, "threads_per_worker": 1, "rows": rows,
            "same_digest": len({r["digest"] for r in rows}) == 1,
            "wall_s": round(time.time() - t0, 1)}


def figures(events: list[dict], dead: int) -> dict:
    """One run's figures (the module docstring) from its events."""
    joined = [e for e in events if e["event"] == "joined"]
    before = {e["rank"]: e["groups"] for e in joined if e["gen"] == 0}
    after = [e["groups"] for e in joined if e["gen"] == 1]
    names = sorted({n for gs in after for n in gs})
    rebuilt = sorted({n for gs in after for n, g in gs.items() if not g["kept"]})
    left = [e["groups"] for e in events if e["event"] == "failure_seen" and e["gen"] == 0]
    unfinished = [gs for gs in left if any(v != "clean" for v in gs.values())]
    in_unit = [gs for gs in unfinished
               if any(v != "clean" for n, v in gs.items() if not n.startswith("dp_replicate."))]
    builds = [(g["size"], g["build_s"]) for gs in after for g in gs.values() if "build_s" in g]
    by_size = {str(n): round(median([t for m, t in builds if m == n]), 4)
               for n in sorted({m for m, _ in builds})}
    inject = next(e for e in events if e["event"] == "inject")
    rec = next(e for e in events if e["event"] == "recovered")
    nxt = next(e for e in events if e["event"] == "step" and e["t"] > rec["t"])
    return {"communicators": len(names), "rebuilt": rebuilt,
            "contained_dead": sorted({"train", *before[dead]}),
            "ranks_unfinished": len(unfinished), "ranks_unfinished_in_group": len(in_unit),
            "survivors": len(left), "build_s_by_size": by_size, "builds": builds,
            "recover_s": rec["recover_s"], "kill_to_next_step_s": round(nxt["t"] - inject["t"], 4)}


def _rows(result: dict) -> list[tuple[str, ...]]:
    out = []
    for mode, words in MODES.items():
        rs = [r for r in result["rows"] if r["mode"] == mode]
        if not rs:
            continue
        r = rs[0]
        extra = sorted(set(r["rebuilt"]) - set(r["contained_dead"]))
        out.append((words, f"{len(r['rebuilt'])} of {r['communicators']}",
                    ", ".join(extra) or "none",
                    f"{r['ranks_unfinished']} ({r['ranks_unfinished_in_group']}) of {r['survivors']}",
                    ", ".join(f"{n}: {_median_build(rs, n):.3f}" for n in r["build_s_by_size"]),
                    f"{median([x['recover_s'] for x in rs]):.3f}",
                    f"{median([x['kill_to_next_step_s'] for x in rs]):.3f}"))
    return out


def _median_build(rows: list[dict], size: str) -> float:
    return median([x["build_s_by_size"][size] for x in rows if size in x["build_s_by_size"]])


HEAD = ("", "communicators rebuilt", "rebuilt without the dead rank",
        "survivors with an unfinished collective (in their replica group's mesh)",
        "build s by group size (median)", "detection -> training s", "SIGKILL -> next step s")


def show(result: dict, opts: BenchOptions) -> None:
    table = Table(title=f"regroup: {result['nproc']} workers x 1 thread ({result['replica_groups']} "
                        f"replica groups x {result['dp_shard']} FSDP2) + 1 spare, "
                        f"{result['fault']}, {result['preset']} preset")
    for col in HEAD:
        table.add_column(col)
    for row in _rows(result):
        table.add_row(*row)
    Console(width=max(Console().width, 150)).print(table)
    print(f"final digests equal in every run: {result['same_digest']}")


def markdown(result: dict) -> list[str]:
    return ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD),
            *["| " + " | ".join(r) + " |" for r in _rows(result)],
            "", f"Final digests equal in every run: {result['same_digest']}."]


def goals(result: dict) -> list[Goal]:
    kept = [r for r in result["rows"] if r["mode"] == "keep"]
    extra = sorted({n for r in kept for n in set(r["rebuilt"]) - set(r["contained_dead"])})
    return [Goal("per failure, communicators rebuilt: only those that contained the failed "
                 "rank", "none other", ", ".join(extra) or "none other", not extra),
            Goal("final state with the kept groups = with every group rebuilt", "equal",
                 "equal" if result["same_digest"] else "differs", result["same_digest"])]


def headline(result: dict) -> str:
    r = {x["mode"]: x for x in result["rows"] if x["run"] == 0}
    keep, rebuild = r.get("keep"), r.get("rebuild")
    if keep is None or rebuild is None:
        return "regroup: incomplete"
    return (f"{result['nproc']} ranks, one SIGKILL: {len(keep['rebuilt'])} of "
            f"{keep['communicators']} communicators rebuilt (was {len(rebuild['rebuilt'])}); "
            f"survivors with an unfinished collective in their replica group: "
            f"{keep['ranks_unfinished_in_group']} of {keep['survivors']}")

"""`phoenixft bench serve-ft`: what serving through crashes costs, and what it saves.

Side by side in one invocation, same model (a random Llama, 4 x 256, 2048 positions),
`--requests` concurrent requests, one engine at a time, `--threads` torch threads:

- decode throughput with the recovery log on vs off: one engine decoding the same
  requests in alternating blocks of steps, its recorder (and executor thread, which shares
  the cores) switched on and off; the median of the pairs' ratios;
- at each context length (prompt + tokens generated so far), the time from an engine's
  death until every in-flight request has its next token:
  * phoenixft: the warm standby replays the log (KV and request state) and decodes;
  * (b) warm re-prefill: a warm standby without a log: every request's prompt and
    generated tokens prefilled again;
  * (a) cold restart, what users have today: a new process (interpreter, imports, model
    load: measured in a real subprocess) plus that re-prefill;
  the log's bytes per generated token and its size in host memory;
- end to end: `phoenixft serve` (front, engine, standby) with streaming clients, the
  engine SIGKILLed: seconds from the kill to the next token a client receives.

Goals (issue: serving that survives a crash): decode with the log >= 0.97x without;
recovery >= 5x faster than a cold restart and >= 2x faster than a warm re-prefill at
2000-token contexts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.bench.serve_ft_runs import (
    build_model,
    cold_start,
    end_to_end,
    log_overhead,
    recovery_at,
)
from phoenixft.observe.goals import Goal, as_dicts, print_goals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-ft", help="serving through engine crashes: log overhead, recovery "
                       "vs cold restart and warm re-prefill", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="256,512,1024,2048", help="context lengths (tokens)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--decode-steps", type=int, default=8, help="steps per throughput block")
    p.add_argument("--blocks", type=int, default=110, help="pairs of blocks, log on and off "
                   "(at most what the context leaves room for: 110 at 8 steps a block)")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end server run")
    p.add_argument("--tiny", action="store_true", help="a 2 x 64 model (smoke test)")
    p.add_argument("--out", default="runs/bench/serve_ft.json")
    p.set_defaults(func=command(measure, show))


def measure(opts: BenchOptions) -> dict:
    """The log's overhead, recovery at each context, then the end-to-end run, in a
    temporary directory in shared memory (removed at the end)."""
    import shutil

    import torch

    args = opts.own
    torch.set_num_threads(opts.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="phoenixft-serve-ft-", dir="/dev/shm"))
    t_start = time.time()
    model = str(tmp / "model")
    desc = build_model(Path(model), args.tiny)
    print(f"[serve-ft] {desc}; {args.requests} requests; 1 process x {opts.threads} torch "
          "thread(s) per engine", flush=True)
    overhead = log_overhead(model, args, tmp)
    print(f"[serve-ft] decode with the log: {overhead['ratio']:.3f}x", flush=True)
    cold = statistics.median(cold_start(model, opts.threads) for _ in range(2))
    rows = []
    for ctx in contexts:
        rows.append(recovery_at(model, ctx, args, tmp, cold))
        r = rows[-1]
        print(f"[serve-ft] context {ctx}: replay+token {r['phoenixft_s']:.3f} s, warm re-prefill "
              f"{r['warm_reprefill_s']:.3f} s, cold restart {r['cold_restart_s']:.3f} s", flush=True)
    e2e = None if args.no_e2e else end_to_end(model, args, tmp)
    result = {"benchmark": "serve-ft", "model": desc, "requests": args.requests,
              "threads": opts.threads, "processes": "1 (engines one at a time) + 1 cold-start "
              "subprocess; end to end: front + engine + standby", "cpu_count": os.cpu_count(),
              "cold_start_s": cold, "log_overhead": overhead, "recovery": rows,
              "end_to_end": e2e}
    result["goals"] = as_dicts(goals(result))
    shutil.rmtree(tmp, ignore_errors=True)
    return {**result, "bench_wall_s": time.time() - t_start}


def goals(result: dict) -> list[Goal]:
    """The issue's goals (the module docstring), at the longest context measured."""
    overhead = result["log_overhead"]
    top = max(result["recovery"], key=lambda r: r["context"])
    return [
        Goal("decode throughput with the log", ">= 0.97x without",
             f"{overhead['ratio']:.3f}x ± {overhead['se']:.3f}", overhead["ratio"] >= 0.97),
        Goal(f"recovery vs cold restart at {top['context']} tokens", ">= 5x faster",
             f"{top['vs_cold']:.1f}x", top["vs_cold"] >= 5),
        Goal(f"recovery vs warm re-prefill at {top['context']} tokens", ">= 2x faster",
             f"{top['vs_warm_reprefill']:.1f}x", top["vs_warm_reprefill"] >= 2),
    ]


def headline(result: dict) -> str:
    return "; ".join(f"{g.name}: {g.measured}" for g in goals(result))


def show(result: dict, opts: BenchOptions) -> None:
    """The log's overhead line, the recovery table, the end-to-end line, the goals."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 140))
    o = result["log_overhead"]
    console.print(f"decode with the recovery log: {o['ratio']:.3f}x ± {o['se']:.3f} the speed "
                  f"without (paired mean of {o['pairs']} pairs of {o['steps_per_block']}-step "
                  f"blocks, {o['step_off_s'] * 1000:.1f} ms steps; pairs' quartiles "
                  f"{o['ratio_q1']:.3f}-{o['ratio_q3']:.3f}; {o['merged_steps']} decode-only "
                  f"steps merged into {o['epochs']} epochs); {o['log_bytes_per_token']:.0f} log "
                  f"bytes per generated token ({o['kv_bytes_per_token']} bytes of KV per token); "
                  f"cold start of an engine process {result['cold_start_s']:.2f} s")
    t = Table(title=f"from an engine's death to every request's next token ({result['model']}, "
                    f"{result['requests']} requests, {result['threads']} thread(s))")
    for col in ("context", "phoenixft: replay + token s", "warm re-prefill s", "cold restart s",
                "vs cold", "vs warm re-prefill", "log MB"):
        t.add_column(col)
    for r in result["recovery"]:
        t.add_row(str(r["context"]), f"{r['phoenixft_s']:.3f}", f"{r['warm_reprefill_s']:.3f}",
                  f"{r['cold_restart_s']:.2f}", f"{r['vs_cold']:.1f}x",
                  f"{r['vs_warm_reprefill']:.1f}x", f"{r['log_bytes'] / 1e6:.1f}")
    console.print(t)
    if result["end_to_end"]:
        e = result["end_to_end"]
        console.print(f"end to end ({e['processes']}, {e['requests']} streams of {e['context']} "
                      f"tokens): SIGKILL to the new engine's first token {e['kill_to_next_token_s']:.3f} s "
                      f"median over streams (max {e['kill_to_next_token_max_s']:.3f} s; takeover "
                      f"{e['recover_s']:.3f} s, replay {e['replay_s']:.3f} s); longest pause in a "
                      f"stream {e['stall_s']:.3f} s vs {e['usual_gap_s']:.3f} s between tokens usually")
    print_goals(console, goals(result))

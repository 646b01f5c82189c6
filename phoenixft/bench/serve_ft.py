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
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def register(sub) -> None:
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
    p.set_defaults(func=cmd_serve_ft)


def build_model(out: Path, tiny: bool) -> str:
    import torch

    from phoenixft.models.llama import LlamaConfig, LlamaForCausalLM, save_hf

    torch.manual_seed(0)
    shape = (dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if tiny else
             dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2))
    model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=2304))
    save_hf(model, out)
    return (f"random Llama, {model.num_params() / 1e6:.1f}M params, "
            f"{shape['num_hidden_layers']} x {shape['hidden_size']}")


def _engine(model: str, max_len: int):
    from phoenixft.serve.engine.config import EngineConfig
    from phoenixft.serve.engine.llm_engine import LLMEngine
    return LLMEngine(model, EngineConfig(max_model_len=max_len, max_num_seqs=64,
                                         kv_cache_bytes=1 << 30))


def _requests(engine, n: int, prompt_len: int, seed: int = 0, tag: str = "r") -> None:
    from phoenixft.serve.engine.config import SamplingParams
    rng = random.Random(seed)
    for i in range(n):
        ids = [rng.randrange(256) for _ in range(prompt_len)]
        engine.add_request(f"{tag}{i}", ids, SamplingParams(
            max_tokens=engine.max_model_len - prompt_len, temperature=0.0, ignore_eos=True))


def _decode_steps(engine, steps: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = sum(len(engine.step()) for _ in range(steps))
    return tokens, time.perf_counter() - t0


def log_overhead(model: str, args, tmp: Path) -> dict:
    """Decode time per step with and without the log: ONE engine whose recorder is switched
    on and off in alternating blocks (two engines differ by a few per cent on their own:
    where their caches sit in memory), in pairs whose order alternates. This machine's
    timing noise is large per block (a pair's ratio swings 10-15%), so the figure is the
    paired mean, mean(off) / mean(on) over all pairs, with its standard error (and the
    pairs' quartiles for reading); each "on" block pays for the executor work of its own
    steps (the first "off" step after it may still overlap the last epoch: 1 step in a
    block)."""
    from phoenixft.serve.recovery.recorder import Recorder

    ctx = 512
    engine = _engine(model, 2304)
    rec = Recorder(engine, tmp / "overhead-log")
    engine.recorder = rec
    _requests(engine, args.requests, ctx)
    engine.step()  # the prefill, untimed
    rec.drain()
    prefill_bytes = rec.summary()["log_bytes"]
    steps_left = engine.max_model_len - ctx - 2
    blocks = min(args.blocks, steps_left // (2 * args.decode_steps))
    pairs, times, tokens = [], {"on": [], "off": []}, {"on": 0, "off": 0}
    for b in range(blocks):
        t = {}
        for name in ("on", "off") if b % 2 == 0 else ("off", "on"):
            engine.recorder = rec if name == "on" else None
            n, s = _decode_steps(engine, args.decode_steps)
            tokens[name] += n
            t[name] = s
            times[name].append(s)
            if name == "off":  # the next "on" block records only its own steps (this log is
                engine.block_manager.take_dirty()  # never replayed: it has holes)
                rec.state.recorded(engine.seqs)
        pairs.append(t["off"] / t["on"])
    engine.recorder = rec
    rec.drain()
    summary = rec.summary()
    rec.close()
    q1, median, q3 = statistics.quantiles(pairs, n=4)
    on, off = statistics.mean(times["on"]), statistics.mean(times["off"])
    diffs = [a - b for a, b in zip(times["on"], times["off"])]
    se_diff = statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"context": ctx, "requests": args.requests, "pairs": len(pairs),
            "steps_per_block": args.decode_steps, "ratio": off / on,
            "se": se_diff * off / on ** 2,  # of the ratio, from the paired differences
            "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3,
            "step_off_s": off / args.decode_steps,
            "merged_steps": summary.get("merged", 0), "epochs": summary["epochs"],
            "log_bytes_per_token": (summary["log_bytes"] - prefill_bytes)
            / max(1, tokens["on"]),
            "kv_bytes_per_token": engine.model_config.kv_bytes_per_token,
            "executor_s": summary["executor_s"], "coalesced": summary["coalesced"]}


def _first_tokens(engine, ids: set[str]) -> float:
    """Step until every request in `ids` produced a token; seconds taken."""
    t0 = time.perf_counter()
    left = set(ids)
    while left:
        for out in engine.step():
            left.discard(out.request_id)
    return time.perf_counter() - t0


def recovery_at(model: str, ctx: int, args, tmp: Path, cold_start_s: float) -> dict:
    """One context length: crash an engine with `ctx`-token requests in flight, then time
    each way back to the next token."""
    from phoenixft.serve.engine.config import SamplingParams
    from phoenixft.serve.recovery.log import dir_bytes
    from phoenixft.serve.recovery.recorder import Recorder
    from phoenixft.serve.recovery.restore import recover

    max_len = min(max(ctx + 64, 512), 2304)
    gen = 16
    log_dir = tmp / f"log-{ctx}"
    crashed = _engine(model, max_len)
    crashed.recorder = Recorder(crashed, log_dir)
    _requests(crashed, args.requests, ctx - gen)
    for _ in range(gen):
        crashed.step()
    assert crashed.recorder.drain()
    state = {sid: list(s.token_ids) for sid, s in crashed.seqs.items()}
    log_bytes = dir_bytes(log_dir)
    crashed.recorder.close()
    del crashed
    # phoenixft: a warm standby replays the log, then decodes
    standby = _engine(model, max_len)
    standby.warm_up()
    t0 = time.perf_counter()
    report = recover(standby, log_dir)
    replay_s = time.perf_counter() - t0
    replay_next = replay_s + _first_tokens(standby, set(state))
    assert {sid: s.token_ids[:len(state[sid])] for sid, s in standby.seqs.items()} == state
    del standby
    # (b) a warm standby without a log: prefill each request's tokens again
    warm = _engine(model, max_len)
    warm.warm_up()
    t0 = time.perf_counter()
    for sid, toks in state.items():
        warm.add_request(sid, toks, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    reprefill = time.perf_counter() - t0 + _first_tokens(warm, set(state))
    del warm
    return {"context": ctx, "requests": args.requests, "replay_s": replay_s,
            "phoenixft_s": replay_next, "warm_reprefill_s": reprefill,
            "cold_restart_s": cold_start_s + reprefill,
            "vs_cold": (cold_start_s + reprefill) / replay_next,
            "vs_warm_reprefill": reprefill / replay_next,
            "log_bytes": log_bytes, "records": report.records}


def cold_start(model: str, threads: int) -> float:
    """A fresh process: interpreter, imports, the model loaded (what a restart pays before
    it can prefill anything)."""
    code = ("import time, sys; t=time.perf_counter(); import torch; "
            f"torch.set_num_threads({threads}); "
            "from phoenixft.serve.engine.llm_engine import LLMEngine; "
            f"LLMEngine({model!r}); print(time.perf_counter() - t)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def end_to_end(model: str, args, tmp: Path) -> dict:
    """`phoenixft serve` with streaming clients; the engine SIGKILLed mid-generation."""
    import signal
    import threading

    import httpx

    port = _free_port()
    run_dir = tmp / "e2e"
    proc = subprocess.Popen([sys.executable, "-m", "phoenixft.serve.server.cli", "serve", model,
                             "--port", str(port), "--threads", str(args.threads),
                             "--max-model-len", "1024", "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    arrivals: list[list[float]] = [[] for _ in range(args.requests)]
    try:
        _until(lambda: _ok(base) and json.loads((run_dir / "status.json").read_text())
               .get("standby_warm"), 180)
        rng = random.Random(3)
        bodies = [{"model": Path(model).name, "prompt": [rng.randrange(256) for _ in range(512)],
                   "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}
                  for _ in range(args.requests)]

        def client(i: int, body: dict) -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals[i].append(time.time())

        threads = [threading.Thread(target=client, args=(i, b), daemon=True)
                   for i, b in enumerate(bodies)]
        for t in threads:
            t.start()
        _until(lambda: min(len(a) for a in arrivals) >= 20, 120)
        pid = json.loads((run_dir / "status.json").read_text())["engine_pid"]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(300)
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        rec = next(e for e in events if e["event"] == "engine_recovered")
        # per stream: the first token the new engine computed (arriving after its ready;
        # tokens that were already on their way when the engine died arrive sooner), and
        # the stream's longest pause between two tokens against its usual pause
        nxt = [min(t for t in a if t > rec["t"]) - t_kill for a in arrivals]
        gaps = [[b - a for a, b in zip(a, a[1:])] for a in arrivals]
        return {"context": 512, "requests": args.requests,
                "kill_to_next_token_s": statistics.median(nxt),
                "kill_to_next_token_max_s": max(nxt),
                "stall_s": statistics.median(max(g) for g in gaps),
                "usual_gap_s": statistics.median(statistics.median(g) for g in gaps),
                "recover_s": rec["recover_s"], "replay_s": rec["report"]["seconds"],
                "processes": "front + engine + warm standby"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ok(base: str) -> bool:
    import httpx
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the end-to-end server did not reach its state in time")
        time.sleep(0.05)  # polling a state with a deadline


def cmd_serve_ft(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    contexts = [int(x) for x in args.contexts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="phoenixft-serve-ft-", dir="/dev/shm"))
    t_start = time.time()
    model = str(tmp / "model")
    desc = build_model(Path(model), args.tiny)
    print(f"[serve-ft] {desc}; {args.requests} requests; 1 process x {args.threads} torch "
          "thread(s) per engine", flush=True)
    overhead = log_overhead(model, args, tmp)
    print(f"[serve-ft] decode with the log: {overhead['ratio']:.3f}x", flush=True)
    cold = statistics.median(cold_start(model, args.threads) for _ in range(2))
    rows = []
    for ctx in contexts:
        rows.append(recovery_at(model, ctx, args, tmp, cold))
        r = rows[-1]
        print(f"[serve-ft] context {ctx}: replay+token {r['phoenixft_s']:.3f} s, warm re-prefill "
              f"{r['warm_reprefill_s']:.3f} s, cold restart {r['cold_restart_s']:.3f} s", flush=True)
    e2e = None if args.no_e2e else end_to_end(model, args, tmp)
    top = max(rows, key=lambda r: r["context"])
    goals = [
        {"name": "decode throughput with the log", "goal": ">= 0.97x without",
         "measured": f"{overhead['ratio']:.3f}x ± {overhead['se']:.3f}",
         "met": overhead["ratio"] >= 0.97},
        {"name": f"recovery vs cold restart at {top['context']} tokens", "goal": ">= 5x faster",
         "measured": f"{top['vs_cold']:.1f}x", "met": top["vs_cold"] >= 5},
        {"name": f"recovery vs warm re-prefill at {top['context']} tokens", "goal": ">= 2x faster",
         "measured": f"{top['vs_warm_reprefill']:.1f}x", "met": top["vs_warm_reprefill"] >= 2},
    ]
    result = {"benchmark": "serve-ft", "model": desc, "requests": args.requests,
              "threads": args.threads, "processes": "1 (engines one at a time) + 1 cold-start "
              "subprocess; end to end: front + engine + standby", "cpu_count": os.cpu_count(),
              "cold_start_s": cold, "log_overhead": overhead, "recovery": rows,
              "end_to_end": e2e, "goals": goals, "bench_wall_s": time.time() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"wrote {args.out}")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .harness import print_goals

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
    print_goals(console, result["goals"])

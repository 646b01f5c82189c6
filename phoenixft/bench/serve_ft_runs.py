"""The measurements of `phoenixft bench serve-ft` (see its docstring): the log's overhead in
alternating blocks, each way back from an engine's death at one context, a cold start in
a real subprocess, and the end-to-end SIGKILL of `phoenixft serve` under streaming clients."""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from phoenixft.platform import free_port


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
            "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
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

    port = free_port()
    run_dir = tmp / "e2e"
    proc = subprocess.Popen([sys.executable, "-m", "phoenixft.serve.server.cli", "serve", model,
                             "--port", str(port), "--threads", str(args.threads),
                             "--max-model-len", "1024", "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _ok(base) and json.loads((run_dir / "status.json").read_text())
               .get("standby_warm"), 180)
        rng = random.Random(3)
        bodies = [{"model": Path(model).name, "prompt": [rng.randrange(256) for _ in range(512)],
                   "max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}
                  for _ in range(args.requests)]
        arrivals, threads = _stream(base, bodies)
        _until(lambda: min(len(a) for a in arrivals) >= 20, 120)
        pid = json.loads((run_dir / "status.json").read_text())["engine_pid"]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(300)
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        rec = next(e for e in events if e["event"] == "engine_recovered")
        return {"context": 512, "requests": args.requests,
                **_after_kill(arrivals, rec, t_kill),
                "recover_s": rec["recover_s"], "replay_s": rec["report"]["seconds"],
                "processes": "front + engine + warm standby"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        # the log a front with --run-dir keeps for its restart: this one never restarts
        from phoenixft.serve.server.http import default_log_dir
        shutil.rmtree(default_log_dir(run_dir), ignore_errors=True)


def _stream(base: str, bodies: list[dict]) -> tuple[list[list[float]], list]:
    """One streaming client thread per body, started; each records its tokens' arrivals."""
    import threading

    import httpx

    arrivals: list[list[float]] = [[] for _ in bodies]

    def client(i: int, body: dict) -> None:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals[i].append(time.time())

    threads = [threading.Thread(target=client, args=(i, b), daemon=True)
               for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    return arrivals, threads


def _after_kill(arrivals: list[list[float]], rec: dict, t_kill: float) -> dict:
    """Per stream: the first token the new engine computed (arriving after its ready;
    tokens that were already on their way when the engine died arrive sooner), and the
    stream's longest pause between two tokens against its usual pause."""
    nxt = [min(t for t in a if t > rec["t"]) - t_kill for a in arrivals]
    gaps = [[b - a for a, b in zip(a, a[1:])] for a in arrivals]
    return {"kill_to_next_token_s": statistics.median(nxt),
            "kill_to_next_token_max_s": max(nxt),
            "stall_s": statistics.median(max(g) for g in gaps),
            "usual_gap_s": statistics.median(statistics.median(g) for g in gaps)}


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

"""`phoenixft bench serve --open-loop`: the benchmark users judge serving engines by.

Open loop, as vLLM's serving benchmark: requests arrive on their own clock (Poisson at
each `--rates` value, plus one burst with all of them at once), whatever the server is
doing, and each is timed from its arrival:

- lengths: a request's prompt and output token counts are drawn from the joint histogram
  of a public production trace kept in the repository (`bench/data/`: the Azure LLM
  inference trace 2023, conversation service, 19,366 requests, CC-BY; Patel et al.,
  Splitwise, ISCA 2024): a bin by its count, then a length uniform in it, times
  `--length-scale` (this 2-core CPU cannot serve the trace's median 1,020-token prompts
  at a useful rate: the default 0.25 keeps the shape, and 1 reproduces it), redrawn while
  prompt + output exceeds the model's context. Nothing is downloaded.
- systems, side by side in one invocation, on the same requests in the same order:
  the engine behind `phoenixft serve` over HTTP (streamed with httpx, token ids as the
  prompt, EOS ignored so every system produces what was asked), the same server with
  `--no-recovery` (no log, no standby), and transformers' `generate` in static batches
  (a batch is every request that has arrived when the previous batch ends, up to
  `--hf-batch`, left padded; its tokens are timed with a streamer), in the same dtype.
- reported as vLLM does: request throughput and output tokens/s (completed requests and
  their tokens over the time from the first arrival to the last completion), TTFT, TPOT
  ((end - first token) / (tokens - 1)) and ITL (gaps between streamed chunks) at p50 and
  p99. A system *sustains* a rate when it completes requests at >= 90% of it.
- memory: KV bytes a token and how many sequences of the model's context, and of the
  workload's mean length, fit in `--kv-cache-memory`, per dtype.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phoenixft.platform import free_port

LENGTHS = Path(__file__).parent / "data" / "azure_conv_2023_lengths.json"
SUSTAIN = 0.9  # completed requests/s over the offered rate that counts as keeping up
GOAL_VS_HF = 2.0
GOAL_BF16 = 1.5
GOAL_LOG = 0.97


# -- the workload -----------------------------------------------------------------------
def load_lengths(path: Path = LENGTHS) -> dict:
    return json.loads(Path(path).read_text())


def draw_requests(n: int, rng: random.Random, scale: float, max_len: int, vocab: int,
                  hist: dict | None = None) -> tuple[list[tuple[list[int], int]], int]:
    """n (prompt ids, output tokens) from the trace's joint histogram; also how many draws
    were redrawn for not fitting `max_len`."""
    hist = hist or load_lengths()
    edges = hist["bin_edges"]
    cells = [(tuple(map(int, k.split(","))), c) for k, c in hist["joint_counts"].items()]
    keys, weights = [k for k, _ in cells], [c for _, c in cells]
    out, redrawn = [], 0
    while len(out) < n:
        ci, gi = rng.choices(keys, weights)[0]
        p = max(1, round(rng.randrange(edges[ci], edges[ci + 1]) * scale))
        o = max(1, round(rng.randrange(edges[gi], edges[gi + 1]) * scale))
        if p + o > max_len:
            redrawn += 1
            if redrawn > 100 * n:
                raise SystemExit(f"phoenixft bench serve: almost no request of the trace fits "
                                 f"{max_len} tokens at --length-scale {scale}; lower it")
            continue
        out.append(([rng.randrange(3, min(vocab, 256)) for _ in range(p)], o))
    return out, redrawn


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the start: Poisson at `rate` requests/s, or all at 0 (rate inf)."""
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- metrics ----------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(recs: list[dict], rate: float) -> dict:
    """vLLM's figures for one run: `recs` has, per request, arrival, first (token time),
    end, tokens and chunk times (all absolute seconds), or an error."""
    done = [r for r in recs if r.get("error") is None]
    if not done:
        return {"completed": 0, "errors": len(recs), "sustained": False}
    start, end = min(r["arrival"] for r in recs), max(r["end"] for r in done)
    dur = max(end - start, 1e-9)
    ttft = [r["first"] - r["arrival"] for r in done]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    tokens = sum(r["tokens"] for r in done)
    req_s = len(done) / dur
    ms = lambda x: None if x is None else round(1e3 * x, 2)  # noqa: E731
    return {"completed": len(done), "errors": len(recs) - len(done), "duration_s": round(dur, 3),
            "request_throughput": round(req_s, 4), "output_tok_s": round(tokens / dur, 2),
            "output_tokens": tokens,
            "ttft_ms": {"mean": ms(statistics.fmean(ttft)), "p50": ms(_pct(ttft, .5)),
                        "p99": ms(_pct(ttft, .99))},
            "tpot_ms": {"mean": ms(statistics.fmean(tpot)) if tpot else None,
                        "p50": ms(_pct(tpot, .5)), "p99": ms(_pct(tpot, .99))},
            "itl_ms": {"mean": ms(statistics.fmean(itl)) if itl else None,
                       "p50": ms(_pct(itl, .5)), "p99": ms(_pct(itl, .99))},
            "sustained": math.isinf(rate) or (len(done) == len(recs)
                                              and req_s >= SUSTAIN * rate)}


# -- the engine, over HTTP --------------------------------------------------------------
def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float,
                 poll_s: float = 0.1) -> None:
    """Wait until the `phoenixft serve` process `proc` answers 200 at `base`/health;
    RuntimeError (with its stderr's tail) if it exits first, TimeoutError after
    `timeout_s`. Readiness is a state, polled with a deadline."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"phoenixft serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"phoenixft serve did not become ready in {timeout_s:g} s")
        time.sleep(poll_s)  # polling a state, bounded by the deadline


class ServerProc:
    """`phoenixft serve` in its own process group, stopped by PID (SIGKILL to the group)."""

    def __init__(self, model: str, *, dtype: str, threads: int, max_len: int, kv: str,
                 recovery: bool, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "phoenixft.serve.server.cli", "serve", model,
               "--port", str(self.port), "--dtype", dtype, "--threads", str(threads),
               "--max-model-len", str(max_len), "--kv-cache-memory", kv,
               "--max-num-seqs", "64", "--served-model-name", "bench",
               "--run-dir", str(run_dir)] + ([] if recovery else ["--no-recovery"])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        try:
            wait_healthy(self.proc, self.base, 300.0)
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        """Also the recovery log it left in /dev/shm: a front with --run-dir keeps it for a
        restart, which a benchmark never makes (four runs left 84 MB of host memory)."""
        from phoenixft.serve.server.http import default_log_dir

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(default_log_dir(self.run_dir), ignore_errors=True)


async def _request(client, base: str, prompt: list[int], max_tokens: int, at: float) -> dict:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    arrival = time.monotonic()
    rec: dict = {"arrival": arrival, "chunks": [], "tokens": 0, "error": None}
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    rec["chunks"].append(time.monotonic())
                if ev.get("usage"):
                    rec["tokens"] = ev["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        rec["error"] = repr(exc)
        return rec
    if not rec["chunks"]:
        rec["error"] = "no token streamed"
        return rec
    rec["first"], rec["end"] = rec["chunks"][0], rec["chunks"][-1]
    return rec


def run_http(base: str, reqs: list[tuple[list[int], int]], at: list[float]) -> list[dict]:
    import httpx

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=len(reqs) + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.monotonic() + 0.05
            return await asyncio.gather(*(_request(client, base, p, m, t0 + a)
                                          for (p, m), a in zip(reqs, at)))
    return asyncio.run(main())


# -- transformers, in static batches ----------------------------------------------------
def run_hf(model, reqs: list[tuple[list[int], int]], at: list[float], max_batch: int
           ) -> list[dict]:
    """Batches of the requests that have arrived, in arrival order, each through one
    `generate`; a request's tokens are those of the first `max_tokens` steps of its
    batch (timed by a streamer: each step's tokens come out together)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Steps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.first = True

        def put(self, value) -> None:
            if self.first:  # the prompt
                self.first = False
                return
            self.times.append(time.monotonic())

        def end(self) -> None:
            pass

    t0 = time.monotonic()
    arrive = [t0 + a for a in at]
    recs: list[dict] = [{} for _ in reqs]
    i = 0
    while i < len(reqs):
        time.sleep(max(0.0, arrive[i] - time.monotonic()))  # idle until the next arrives
        now = time.monotonic()
        batch = [j for j in range(i, min(len(reqs), i + max_batch)) if arrive[j] <= now]
        width = max(len(reqs[j][0]) for j in batch)
        ids = torch.tensor([[0] * (width - len(reqs[j][0])) + reqs[j][0] for j in batch])
        mask = torch.tensor([[0] * (width - len(reqs[j][0])) + [1] * len(reqs[j][0])
                             for j in batch])
        new = max(reqs[j][1] for j in batch)
        steps = Steps()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, streamer=steps, pad_token_id=0)
        for j in batch:
            m = reqs[j][1]
            ts = steps.times[:m]
            recs[j] = {"arrival": arrive[j], "chunks": ts, "tokens": len(ts), "first": ts[0],
                       "end": ts[-1], "error": None if len(ts) == m else "stopped early"}
        i = batch[-1] + 1
    return recs


# -- the whole benchmark ----------------------------------------------------------------
def kv_memory(model_dir: str, kv_bytes: int, max_len: int, mean_len: float) -> dict:
    """KV bytes a token and the sequences that fit `kv_bytes`, per dtype."""
    from phoenixft.serve.engine.config import DTYPES, ModelConfig

    mc = ModelConfig.from_hf(model_dir)
    out = {}
    for dt in ("float32", "bfloat16"):
        assert dt in DTYPES
        per = mc.kv_bytes_per_token(dt)
        out[dt] = {"kv_bytes_per_token": per,
                   "sequences_at_context": kv_bytes // (per * max_len),
                   "sequences_at_mean_length": int(kv_bytes // (per * mean_len))}
    return out


def measure_open(args) -> dict:
    import torch
    import transformers

    from phoenixft.bench.bench_models import build_bench_model
    from phoenixft.serve.server.cli import parse_bytes

    rng = random.Random(args.seed)
    torch.set_num_threads(args.threads)
    max_len = args.max_model_len
    kv_bytes = parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
    rates = [float(r) for r in args.rates] + [math.inf]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        desc = build_bench_model(Path(model_dir), args.size, max_positions=max_len)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        workloads = {}
        for r in rates:  # the same requests for every system and dtype at a rate
            reqs, redrawn = draw_requests(args.requests, rng, args.length_scale, max_len, vocab)
            workloads[r] = (reqs, arrivals(len(reqs), r, rng), redrawn)
        mean_len = statistics.fmean(len(p) + o for w in workloads.values() for p, o in w[0])
        results: dict = {}
        for dt in args.dtypes:
            print(f"[serve open-loop] {dt}", flush=True)
            hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
            hf = hf.to(getattr(torch, dt))
            res: dict = {"engine": {}, "engine_no_log": {}, "transformers": {}}
            for system, recovery in (("engine", True), ("engine_no_log", False)):
                srv = ServerProc(model_dir, dtype=dt, threads=args.threads, max_len=max_len,
                                 kv=args.kv_cache_memory, recovery=recovery,
                                 run_dir=Path(tmp) / f"run-{dt}-{system}")
                try:
                    warm = workloads[rates[0]][0][:2]
                    run_http(srv.base, warm, [0.0] * len(warm))  # first calls at new shapes
                    for r in rates:
                        reqs, at, _ = workloads[r]
                        res[system][_name(r)] = summarize(run_http(srv.base, reqs, at), r)
                        print(f"[serve open-loop] {dt} {system} {_name(r)}: "
                              f"{res[system][_name(r)].get('output_tok_s')} tok/s", flush=True)
                finally:
                    srv.stop()
            run_hf(hf, workloads[rates[0]][0][:2], [0.0, 0.0], args.hf_batch)  # warm-up
            for r in rates:
                reqs, at, _ = workloads[r]
                res["transformers"][_name(r)] = summarize(run_hf(hf, reqs, at, args.hf_batch), r)
                print(f"[serve open-loop] {dt} transformers {_name(r)}: "
                      f"{res['transformers'][_name(r)].get('output_tok_s')} tok/s", flush=True)
            results[dt] = res
        return {"model": desc, "size": args.size, "threads": args.threads,
                "requests": args.requests, "rates": [_name(r) for r in rates],
                "length_scale": args.length_scale, "max_model_len": max_len,
                "hf_batch": args.hf_batch, "lengths_source": load_lengths()["source"],
                "redrawn": {_name(r): w[2] for r, w in workloads.items()},
                "mean_request_tokens": round(mean_len, 1),
                "kv_cache_memory": args.kv_cache_memory,
                "memory": kv_memory(model_dir, kv_bytes, max_len, mean_len),
                "results": results}


def _name(rate: float) -> str:
    return "burst" if math.isinf(rate) else f"{rate:g}/s"


def comparisons(result: dict) -> dict:
    """The figures the goals read: engine over transformers at the highest rate both
    sustain (and in the burst: their capacities), bf16 over fp32, the log's cost."""
    out: dict = {}
    for dt, res in result["results"].items():
        both = [n for n in result["rates"] if n != "burst"
                and res["engine"][n].get("sustained") and res["transformers"][n].get("sustained")]
        top = both[-1] if both else None
        e, h = res["engine"], res["transformers"]

        def highest(runs: dict) -> float:  # the highest rate a system sustained (0: none)
            ok = [float(n.split("/")[0]) for n in result["rates"]
                  if n != "burst" and runs[n].get("sustained")]
            return max(ok, default=0.0)
        out[dt] = {"highest_common_rate": top,
                   "engine_sustains": highest(e), "transformers_sustains": highest(h),
                   "vs_hf_at_rate": (e[top]["output_tok_s"] / h[top]["output_tok_s"]
                                     if top else None),
                   "vs_hf_burst": e["burst"]["output_tok_s"] / h["burst"]["output_tok_s"],
                   "ttft_p99_ms_at_rate": ({"engine": e[top]["ttft_ms"]["p99"],
                                            "transformers": h[top]["ttft_ms"]["p99"]}
                                           if top else None),
                   "log_on_off_burst": (e["burst"]["output_tok_s"]
                                        / res["engine_no_log"]["burst"]["output_tok_s"])}
    if "float32" in out and "bfloat16" in out:
        r = result["results"]
        out["bf16_vs_fp32_burst"] = (r["bfloat16"]["engine"]["burst"]["output_tok_s"]
                                     / r["float32"]["engine"]["burst"]["output_tok_s"])
    return out


# -- report -----------------------------------------------------------------------------
def goals(result: dict):
    from phoenixft.observe.goals import Goal

    c = result.get("comparisons") or comparisons(result)
    out = []
    for dt in result["results"]:
        x = c[dt]
        rate = x["highest_common_rate"]
        out.append(Goal(f"{dt}: engine output tok/s over transformers' at the highest rate "
                        f"both sustain ({rate or 'none'}), {result['size']} model",
                        f">= {GOAL_VS_HF:g}x",
                        "-" if x["vs_hf_at_rate"] is None else f"{x['vs_hf_at_rate']:.2f}x",
                        x["vs_hf_at_rate"] is not None and x["vs_hf_at_rate"] >= GOAL_VS_HF,
                        note=f"burst (capacity): {x['vs_hf_burst']:.2f}x"))
        es, hs = x["engine_sustains"], x["transformers_sustains"]
        out.append(Goal(f"{dt}: the highest request rate the engine sustains over "
                        "transformers'", f">= {GOAL_VS_HF:g}x",
                        f"{es:g}/s vs {hs:g}/s", hs > 0 and es >= GOAL_VS_HF * hs,
                        note="at a rate both sustain, both deliver the offered load: the "
                             "rate each sustains and the burst are what tell them apart"))
        out.append(Goal(f"{dt}: recovery log on over off, output tok/s in the burst",
                        f">= {GOAL_LOG:g}x", f"{x['log_on_off_burst']:.3f}x",
                        x["log_on_off_burst"] >= GOAL_LOG))
    if "bf16_vs_fp32_burst" in c:
        v = c["bf16_vs_fp32_burst"]
        out.append(Goal("bfloat16 engine over float32 engine, output tok/s in the burst",
                        f">= {GOAL_BF16:g}x", f"{v:.2f}x", v >= GOAL_BF16))
    return out


def headline(result: dict) -> str:
    c = result.get("comparisons") or comparisons(result)
    parts = []
    for dt in result["results"]:
        x = c[dt]
        parts.append(f"{dt}: sustains {x['engine_sustains']:g} requests/s (transformers "
                     f"{x['transformers_sustains']:g}/s), {x['vs_hf_burst']:.2f}x transformers' "
                     f"output tok/s in a burst, log on/off {x['log_on_off_burst']:.2f}x")
    if "bf16_vs_fp32_burst" in c:
        parts.append(f"bf16 engine {c['bf16_vs_fp32_burst']:.2f}x fp32")
    return f"open loop, {result['size']} model: " + "; ".join(parts)


def _rows(result: dict) -> tuple[list[str], list[list[str]]]:
    cols = ["dtype", "system", "rate", "completed", "req/s", "output tok/s", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms", "ITL p50/p99 ms", "sustained"]
    rows = []
    for dt, res in result["results"].items():
        for system, runs in res.items():
            for rate, m in runs.items():
                if not m.get("completed"):
                    rows.append([dt, system, rate, "0", "-", "-", "-", "-", "-", "no"])
                    continue
                f = lambda d: f"{d['p50']}/{d['p99']}"  # noqa: E731
                rows.append([dt, system, rate, f"{m['completed']}", f"{m['request_throughput']:.2f}",
                             f"{m['output_tok_s']:.1f}", f(m["ttft_ms"]), f(m["tpot_ms"]),
                             f(m["itl_ms"]), "yes" if m["sustained"] else "no"])
    return cols, rows


def markdown(result: dict) -> list[str]:
    cols, rows = _rows(result)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    mem = result["memory"]
    lines += ["", f"KV cache in {result['kv_cache_memory']}: " + "; ".join(
        f"{dt} {m['kv_bytes_per_token']} bytes a token, {m['sequences_at_context']} sequences "
        f"of {result['max_model_len']} tokens or {m['sequences_at_mean_length']} of the "
        f"workload's mean {result['mean_request_tokens']}" for dt, m in mem.items()) + ".",
        "", f"Lengths: {result['lengths_source']}, times {result['length_scale']}; "
        f"{result['requests']} requests a rate; draws redrawn for not fitting "
        f"{result['max_model_len']} tokens: {result['redrawn']}."]
    return lines


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from phoenixft.observe.goals import print_goals

    cols, rows = _rows(result)
    t = Table(title=f"phoenixft bench serve --open-loop: {result['model']}, "
                    f"{result['threads']} threads a process")
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*r)
    c = Console(width=max(Console().width, 140))
    c.print(t)
    for line in markdown(result)[len(rows) + 2:]:
        if line:
            c.print(line)
    print_goals(c, goals(result))

"""`phoenixft bench serve`: our paged engine vs transformers' generate, same model, same CPU.

For 1, 8 and 32 concurrent clients it measures output tokens/s and time to first token
(TTFT), after an untimed warm-up of both systems (first calls at new shapes are slow).

Each level runs ``repeats`` times, alternating the two systems so that load from other
processes hits both alike; the table shows the median repeat (the JSON has all).

Workload, like real traffic: ``rounds`` x concurrency requests with prompts of 16..64
tokens, each asking for 16..128 new tokens (EOS ignored, so both systems produce exactly
what was asked). Each of the N clients sends its next request as soon as its previous one
returned (closed loop).
- engine: a finished request's client submits its next at once; it joins the running
  batch at the next step (continuous batching).
- transformers: requests go in waves of N through one batched ``generate`` call, left
  padded to the longest possible prompt so that every wave has the same shapes (with
  varying shapes, its first calls at each new shape cost seconds on this CPU); this is
  the best a server built on ``generate`` can do; a wave runs until its longest
  request is done, and the next wave starts after it. The JSON also gives the tokens it
  computed (``computed_tokens``, including those past a request's max_tokens), while
  tokens/s counts only the tokens requests asked for (``useful_tokens``).
TTFT is from a request's submission to its first token (for a wave: the wave's first
decoding step).

``ceiling`` = transformers' computed / useful tokens: the speedup of an engine whose
steps cost what generate's do and that computes no token nobody asked for. Where a step's
cost hardly depends on how many rows it holds (a model large enough that reading its
weights dominates, as the medium one on this CPU), that is about as far as batching
alone can go; beyond it an engine needs cheaper steps, not better scheduling.

``step_cost_ratio`` says how cheap the engine's steps are: one decoding step of N
sequences, transformers' over the engine's, each the median of ``STEP_SAMPLES`` steps,
the two measured in turn. The engine runs ``step()`` (scheduling, paged attention,
sampling) at the workload's mean context; transformers runs the forward that each step
of a wave runs: its prompts left-padded to the wave's width, with the attention mask, at
the wave's mean length, its KV cache reused (``generate``'s own bookkeeping per step, the
logits processors and stopping checks, is left out, which favours it a little).
``ceiling x step_cost_ratio`` estimates the most this workload can show (the engine's
batch also thins out at the end of a run, when the last clients have no request left).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from phoenixft.bench.bench_models import SIZES, build_bench_model
from phoenixft.bench.options import BenchOptions
from phoenixft.bench.runner import command
from phoenixft.observe.goals import Goal


@dataclass(kw_only=True)
class ServeBenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    rounds: int = 4
    repeats: int = 3
    threads: int = 2
    size: str = "tiny"  # the random model: tiny (2.9M params) or medium (~54M)
    prompt_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 128)
    model_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("rounds", "repeats", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")


def _workload(n: int, cfg: ServeBenchConfig, rng: random.Random, vocab: int
              ) -> list[tuple[list[int], int]]:
    """Random prompt ids below min(vocab, 256): bytes for the byte-vocab default model."""
    return [([rng.randrange(min(vocab, 256)) for _ in range(rng.randint(*cfg.prompt_len))],
             rng.randint(*cfg.output_len)) for _ in range(n)]


def _run_engine(llm, reqs: list[tuple[list[int], int]], clients: int, width: int = 0
                ) -> dict:
    from phoenixft.serve import SamplingParams

    eng, pending, seqs = llm.engine, list(reversed(reqs)), []

    def submit() -> None:
        prompt, m = pending.pop()
        seqs.append(eng.add_request(f"b{time.monotonic_ns()}-{len(seqs)}", prompt,
                                    SamplingParams(max_tokens=m, temperature=0.0,
                                                   ignore_eos=True)))

    t0 = time.monotonic()
    for _ in range(min(clients, len(pending))):
        submit()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished and pending:
                submit()
    wall = time.monotonic() - t0
    tokens = sum(s.num_completion_tokens for s in seqs)
    return {"wall_s": wall, "useful_tokens": tokens, "computed_tokens": tokens,
            "ttft_s": [s.first_token_time - s.arrival_time for s in seqs]}


def _hf_wave(model, reqs, width: int) -> dict:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        at: float | None = None

        def __call__(self, input_ids, scores):
            if self.at is None:
                self.at = time.monotonic()
            return scores

    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in reqs])
    new = max(m for _, m in reqs)
    rec = FirstToken()
    t0 = time.monotonic()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([rec]))
    if out.shape[1] != width + new:
        raise RuntimeError(f"transformers stopped early: {out.shape[1] - width} of {new}")
    return {"useful_tokens": sum(m for _, m in reqs), "computed_tokens": len(reqs) * new,
            "ttft_s": [rec.at - t0] * len(reqs)}


def _run_hf(model, reqs: list[tuple[list[int], int]], clients: int, width: int) -> dict:
    res = {"useful_tokens": 0, "computed_tokens": 0, "ttft_s": []}
    t0 = time.monotonic()
    for i in range(0, len(reqs), clients):
        wave = _hf_wave(model, reqs[i:i + clients], width)
        for k in res:
            res[k] += wave[k]
    return res | {"wall_s": time.monotonic() - t0}


STEP_SAMPLES = 12  # decoding steps timed per system and round (`step_cost_ratio`)


def _prompt(i: int, ctx: int, vocab: int) -> list[int]:
    return [(7 * i + j) % min(vocab, 256) for j in range(ctx)]


def _engine_step_s(llm, n: int, ctx: int, vocab: int) -> float:
    """Median seconds of one engine step decoding n sequences at about ctx tokens."""
    from phoenixft.serve import SamplingParams

    eng = llm.engine
    params = SamplingParams(max_tokens=4 * STEP_SAMPLES, temperature=0.0, ignore_eos=True)
    seqs: list = []
    try:
        for i in range(n):
            seqs.append(eng.add_request(f"cost-{time.monotonic_ns()}-{i}",
                                        _prompt(i, ctx, vocab), params))
        while any(s.num_computed_tokens < ctx for s in seqs):
            eng.step()  # the prefills
        times = []
        for _ in range(STEP_SAMPLES):
            if len(eng.scheduler.running) != n:
                raise RuntimeError(f"bench serve: {len(eng.scheduler.running)} of the {n} "
                                   f"sequences timed are still decoding")
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    finally:
        for s in seqs:
            eng.abort(s.seq_id)
    return statistics.median(times)


def _hf_step_s(model, n: int, width: int, length: int, vocab: int) -> float:
    """Median seconds of one transformers forward decoding n sequences as a wave does:
    prompts of width - 1 tokens and one left padding column at first, then `length` - width
    steps (with the mask, as ``generate`` passes it) before the timed ones."""
    import torch

    ids = torch.tensor([[0] + _prompt(i, width - 1, vocab) for i in range(n)])
    mask = torch.ones_like(ids)
    mask[:, 0] = 0
    times = []
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, use_cache=True)
        for k in range(length - width + STEP_SAMPLES):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            # transformers 5 calls the KV cache `cache` (`past_key_values` before)
            kv = {"cache": out["cache"]} if "cache" in out else {
                "past_key_values": out["past_key_values"]}
            t0 = time.perf_counter()
            out = model(nxt, attention_mask=mask, use_cache=True, **kv)
            if k >= length - width:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_costs(llm, hf, n: int, cfg: ServeBenchConfig, vocab: int, rounds: int = 2) -> dict:
    """Both systems' decoding step at batch n, in turn, `rounds` times; the medians. The
    engine at the workload's mean context (mean prompt + half the mean output), a wave
    at its mean length: its width + half its longest output (about the longest allowed)."""
    ctx = (sum(cfg.prompt_len) + sum(cfg.output_len) // 2) // 2
    width = cfg.prompt_len[1]
    length = width + cfg.output_len[1] // 2
    eng, ref = [], []
    for _ in range(rounds):
        eng.append(_engine_step_s(llm, n, ctx, vocab))
        ref.append(_hf_step_s(hf, n, width, length, vocab))
    e, h = statistics.median(eng), statistics.median(ref)
    return {"context": ctx, "wave_context": length, "engine_step_ms": round(1e3 * e, 3),
            "transformers_step_ms": round(1e3 * h, 3), "step_cost_ratio": h / e}


def _level(llm, hf, n: int, cfg: ServeBenchConfig, rng: random.Random, vocab: int,
           width: int) -> dict:
    """One concurrency level: `repeats` repeats of both systems in turn on the same
    requests (the median repeat, all in `repeats`), then their decoding steps' costs."""
    reps: dict[str, list[dict]] = {"engine": [], "transformers": []}
    for _ in range(cfg.repeats):
        reqs = _workload(n * cfg.rounds, cfg, rng, vocab)
        for name, fn, model in (("engine", _run_engine, llm),
                                ("transformers", _run_hf, hf)):
            res = fn(model, reqs, n, width)
            reps[name].append({
                "tokens_per_s": res["useful_tokens"] / res["wall_s"],
                "ttft_mean_ms": 1e3 * statistics.fmean(res["ttft_s"]),
                "ttft_p50_ms": 1e3 * statistics.median(res["ttft_s"]),
                "useful_tokens": res["useful_tokens"],
                "computed_tokens": res["computed_tokens"], "wall_s": res["wall_s"]})
    row: dict = {"concurrency": n, "requests_per_repeat": n * cfg.rounds}
    for name, runs in reps.items():
        median = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        row[name] = median | {"repeats": runs}
    row["speedup"] = row["engine"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
    waves = row["transformers"]
    row["ceiling"] = waves["computed_tokens"] / waves["useful_tokens"]
    row |= _step_costs(llm, hf, n, cfg, vocab)
    return row


def run(cfg: ServeBenchConfig) -> dict:
    import torch
    import transformers

    from phoenixft.serve import LLM, EngineConfig

    torch.set_num_threads(cfg.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, desc = cfg.model_dir, f"model from {cfg.model_dir}"
        if model_dir is None:
            model_dir = str(Path(tmp) / "model")
            desc = build_bench_model(Path(model_dir), cfg.size)
        llm = LLM(model_dir, EngineConfig(max_num_seqs=max(64, max(cfg.concurrency))))
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        hf.generation_config.pad_token_id = 0
        hf.generation_config.eos_token_id = None  # requests ignore EOS in both systems
        rng = random.Random(cfg.seed)
        vocab = llm.engine.model_config.vocab_size
        width = cfg.prompt_len[1]
        for n in cfg.concurrency:  # warm-up: first calls at new shapes are slow in both
            warm = _workload(n, cfg, rng, vocab)
            _run_engine(llm, warm, n)
            _run_hf(hf, warm, n, width)
        rows = [_level(llm, hf, n, cfg, rng, vocab, width) for n in cfg.concurrency]
        eng = llm.engine
        return {"bench": "serve", "model": desc, "config": asdict(cfg),
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "transformers": transformers.__version__, "machine": platform.machine(),
                "kv_bytes_per_token": eng.runner.kv_bytes_per_token,
                "kv_pool": {"blocks": eng.config.num_blocks, "block_size": eng.config.block_size,
                            "bytes": 2 * eng.runner.k_cache.numel()
                            * eng.runner.k_cache.element_size()},
                "results": rows}


def show(result: dict, opts: BenchOptions) -> None:
    """Per concurrency level: both systems' tokens/s and TTFT, the speedup and its ceiling
    (the open loop: `serve_open.show`)."""
    from rich.console import Console
    from rich.table import Table

    if result.get("bench") == "serve-open":
        from phoenixft.bench import serve_open

        serve_open.show(result)
        return

    t = Table(title=f"phoenixft bench serve: {result['model']}, {result['threads']} threads")
    for col in ("concurrent", "engine tok/s", "transformers tok/s", "speedup", "ceiling",
                "step cost ratio", "engine TTFT ms", "transformers TTFT ms"):
        t.add_column(col, justify="right")
    for r in result["results"]:
        e, h = r["engine"], r["transformers"]
        t.add_row(str(r["concurrency"]), f"{e['tokens_per_s']:.0f}",
                  f"{h['tokens_per_s']:.0f}", f"{r['speedup']:.2f}x", f"{r['ceiling']:.2f}x",
                  f"{r['step_cost_ratio']:.2f}x", f"{e['ttft_mean_ms']:.1f}",
                  f"{h['ttft_mean_ms']:.1f}")
    c = Console()
    c.print(t)
    c.print(f"engine KV cache: {result['kv_bytes_per_token']} bytes/token "
            f"(float32 K+V, all layers); pool {result['kv_pool']['blocks']} blocks x "
            f"{result['kv_pool']['block_size']} = {result['kv_pool']['bytes'] / 2**20:.1f} MiB")


def measure(opts: BenchOptions) -> dict:
    args = opts.own
    if args.open_loop:
        from phoenixft.bench import serve_open

        result = {"bench": "serve-open", **serve_open.measure_open(args)}
        result["comparisons"] = serve_open.comparisons(result)
        result["goals"] = [g.as_dict() for g in serve_open.goals(result)]
        return result
    return run(ServeBenchConfig(concurrency=args.concurrency, rounds=args.rounds, size=args.size,
                                repeats=args.repeats, threads=opts.threads, model_dir=args.model))


def goals(result: dict) -> list[Goal]:
    """The engine >= 2x transformers at 8 concurrent requests and more."""
    return [Goal(f"engine vs transformers at {r['concurrency']} concurrent (ceiling "
                 f"for equal step costs: {r['ceiling']:.2f}x"
                 + (f"; transformers' step / the engine's: {r['step_cost_ratio']:.2f}x"
                    if "step_cost_ratio" in r else "") + ")", ">= 2x",
                 round(r["speedup"], 2), r["speedup"] >= 2)
            for r in result["results"] if r["concurrency"] >= 8]


def headline(result: dict) -> str:
    size = result["model"].split(",")[1].strip()
    return size + ": " + ", ".join(f"{r['speedup']:.2f}x transformers at "
                                   f"{r['concurrency']}" for r in result["results"])


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser(
        "serve", help="paged engine vs transformers generate: tokens/s, TTFT, KV bytes")
    p.add_argument("--model", default=None,
                   help="model directory (default: build a random 4-layer Llama)")
    p.add_argument("--size", default="tiny", choices=list(SIZES),
                   help="the random model when --model is not given: tiny (2.9M params) or "
                        "medium (~54M, compute-bound)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=4,
                   help="requests per client in one repeat (default 4)")
    p.add_argument("--repeats", type=int, default=3,
                   help="repeats per level, alternating the systems; median shown")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    o = p.add_argument_group("open loop (--open-loop: Poisson arrivals and a burst, trace "
                             "lengths, over HTTP; see phoenixft/bench/serve_open.py)")
    o.add_argument("--open-loop", action="store_true")
    o.add_argument("--rates", nargs="+", default=["0.5", "1", "2"],
                   help="request rates (requests/s); a burst (all at once) is always added")
    o.add_argument("--requests", type=int, default=32, help="requests at each rate")
    o.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    o.add_argument("--length-scale", type=float, default=0.25,
                   help="the trace's lengths times this (1: as recorded)")
    o.add_argument("--max-model-len", type=int, default=2048)
    o.add_argument("--kv-cache-memory", default="256MiB")
    o.add_argument("--hf-batch", type=int, default=16,
                   help="transformers: the most requests in one static batch")
    o.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=command(measure, show))

"""`phoenixft serve` and `phoenixft generate`.

``register(subparsers)`` is called by ``phoenixft.cli``; ``main()`` runs the same two
commands standalone (``python -m phoenixft.serve.server.cli serve DIR``). Engine limits are
``EngineConfig`` fields; only the few that users commonly change are flags.
"""

from __future__ import annotations

import argparse
import sys


def _threads(text: str) -> int:
    """--threads: a number of torch threads >= 1 (torch raised on 0 or -1, deep inside)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="Hugging Face directory: config.json + *.safetensors")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, at most 2048)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    p.add_argument("--threads", type=_threads, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="tokens computed in one step (prefill chunks and decodes)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (auto: the checkpoint's "
                        "torch_dtype); sampling and logprobs are float32 whatever it is")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="KV-cache memory per engine, e.g. 512MiB or 2GB (default 256MiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share (0-1] of the device's memory (a GPU's, or this host's RAM on "
                        "CPU) one engine may use for weights + KV cache; the KV cache gets "
                        "what the weights leave. phoenixft serve runs two engines (active + "
                        "standby): keep F <= 0.45 on one device")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where weights, KV cache and compute live (on "
                        "a GPU the recovery log's executor runs as a thread of the engine)")
    p.add_argument("--tokenizer", default=None,
                   help="a directory with tokenizer.json (default: the model directory's)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, replacing the "
                        "tokenizer's")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--kv-cache-memory") -> int:
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag}: cannot read {text!r} (e.g. 512MiB, 2GB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _device_bytes(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise ValueError("--gpu-memory-utilization: cannot read this host's memory size")


def _kv_bytes(args: argparse.Namespace) -> int:
    from pathlib import Path
    if args.kv_cache_memory is not None and args.gpu_memory_utilization is not None:
        raise ValueError("give --kv-cache-memory or --gpu-memory-utilization, not both")
    if args.kv_cache_memory is not None:
        return parse_bytes(args.kv_cache_memory)
    if args.gpu_memory_utilization is None:
        return 256 * 2**20
    f = args.gpu_memory_utilization
    if not 0 < f <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {f}")
    weights = sum(p.stat().st_size for p in Path(args.model_dir).glob("*.safetensors"))
    kv = int(f * _device_bytes(args.device)) - weights
    if kv <= 0:
        raise ValueError(f"--gpu-memory-utilization {f}: the weights ({weights / 2**20:.0f} "
                         "MiB) leave no memory for the KV cache; raise it")
    return kv


def _engine_config(args: argparse.Namespace):
    from pathlib import Path

    import torch

    from phoenixft.serve.engine.config import EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    template = args.chat_template
    if template is not None and Path(template).is_file():
        template = Path(template).read_text()
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=args.block_size, kv_cache_bytes=_kv_bytes(args),
                        tokenizer=args.tokenizer, chat_template=template,
                        device=args.device, dtype=args.dtype)


def _serve(args: argparse.Namespace) -> int:
    import os

    from .front import bind, run
    from .http import build_app
    from .stale_logs import stale_logs
    try:
        sizes = {flag: parse_bytes(getattr(args, flag[2:].replace("-", "_")), flag)
                 for flag in ("--max-request-body", "--recovery-ring-bytes")}
        sock = bind(args.host, args.port)
    except ValueError as exc:
        print(f"phoenixft serve: {exc}", file=sys.stderr)
        return 2
    try:
        app = build_app(args.model_dir, _engine_config(args),
                        model_name=args.served_model_name, run_dir=args.run_dir,
                        log_dir=args.log_dir, threads=args.threads,
                        api_key=args.api_key or os.environ.get("PHOENIXFT_API_KEY")
                        or os.environ.get("VLLM_API_KEY"),
                        max_body_bytes=sizes["--max-request-body"],
                        ring_bytes=sizes["--recovery-ring-bytes"],
                        read_timeout_s=args.request_read_timeout,
                        keep_finished=args.keep_finished_requests,
                        keep_finished_s=args.keep_finished_seconds,
                        recovery=not args.no_recovery)
    except ValueError as exc:
        sock.close()
        print(f"phoenixft serve: {exc}", file=sys.stderr)
        return 2
    for log in stale_logs(exclude=app.state.log_dir):
        print(f"phoenixft serve: {log.advice()}", file=sys.stderr)
    return run(app, sock, model_dir=args.model_dir, log_level=args.log_level,
               read_timeout_s=args.request_read_timeout)


def _generate(args: argparse.Namespace) -> int:
    from phoenixft.serve.engine.config import SamplingParams
    from phoenixft.serve.engine.llm import LLM

    try:
        llm = LLM(args.model_dir, _engine_config(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=args.stop or [])
        prompts = args.prompt
        if args.chat:
            tok = llm.tokenizer
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                  add_special_tokens=False) for p in prompts]
        outs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"phoenixft generate: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outs):
        if len(outs) > 1:
            print(f"=== {prompt!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")
        print(out.text if args.chat or len(outs) > 1 else prompt + out.text, flush=True)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server for a model dir")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the `model` clients send (default: the directory's name)")
    s.add_argument("--log-level", default="warning")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (or set "
                        "PHOENIXFT_API_KEY / VLLM_API_KEY); /health and /metrics stay open")
    s.add_argument("--run-dir", default=None,
                   help="status.json, events.jsonl and accepted requests; restarting on the "
                        "same run dir resumes the requests a crash interrupted")
    s.add_argument("--log-dir", default=None,
                   help="where the engines keep their recovery log (default: /dev/shm, one "
                        "directory per run dir)")
    s.add_argument("--no-recovery", action="store_true",
                   help="serve without the recovery log and the standby engine: an engine "
                        "crash ends the requests in flight (to measure what recovery costs)")
    s.add_argument("--recovery-ring-bytes", default="16MiB", metavar="BYTES",
                   help="the shared-memory ring that carries each step's log records to the "
                        "log executor (default 16MiB, at least 1MiB); an adapter must fit it "
                        "to be loaded")
    s.add_argument("--max-request-body", default="4MiB", metavar="BYTES",
                   help="largest request body accepted (default 4MiB); larger ones get 413 "
                        "before they are read")
    s.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send a request's headers, and again its "
                        "body (default 30); then 408 and the connection is closed")
    s.add_argument("--keep-finished-requests", type=int, default=1000, metavar="N",
                   help="finished requests whose results are kept for Idempotency-Key "
                        "retries (in memory and in --run-dir), newest first (default 1000)")
    s.add_argument("--keep-finished-seconds", type=float, default=86400.0, metavar="S",
                   help="and for at most this long after they finished (default 86400)")
    s.set_defaults(func=_serve)

    g = subparsers.add_parser("generate", help="offline generation for one or more prompts")
    _engine_args(g)
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the chat template")
    g.set_defaults(func=_generate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="phoenixft")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`phoenixft serve` and `phoenixft generate`.

``register(subparsers)`` is called by ``phoenixft.cli``; ``main()`` runs the same two
commands standalone (``python -m phoenixft.serve.cli serve DIR``). Engine limits are
``EngineConfig`` fields; only the few that users commonly change are flags.
"""

from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="Hugging Face directory: config.json + *.safetensors")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's, at most 2048)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")


def _engine_config(args: argparse.Namespace):
    import torch

    from .config import EngineConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .config import EngineConfig
    from .http import build_app
    try:
        app = build_app(args.model_dir, EngineConfig(max_model_len=args.max_model_len,
                                                     max_num_seqs=args.max_num_seqs),
                        model_name=args.served_model_name, run_dir=args.run_dir,
                        log_dir=args.log_dir, threads=args.threads)
    except ValueError as exc:
        print(f"phoenixft serve: {exc}", file=sys.stderr)
        return 2
    spec = app.state.spec
    print(f"serving {args.model_dir} ({spec.model_config.model_type}, "
          f"max_model_len {spec.max_model_len}, {spec.config.num_blocks} KV blocks of "
          f"{spec.config.block_size}) on http://{args.host}:{args.port}; an engine process "
          f"and a warm standby, recovery log in {app.state.supervisor.log_dir}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .config import SamplingParams
    from .llm import LLM

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
    s.add_argument("--run-dir", default=None,
                   help="status.json, events.jsonl and accepted requests; restarting on the "
                        "same run dir resumes the requests a crash interrupted")
    s.add_argument("--log-dir", default=None,
                   help="where the engines keep their recovery log (default: /dev/shm, one "
                        "directory per run dir)")
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

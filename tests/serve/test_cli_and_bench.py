"""`phoenixft generate`, CLI registration, the engine thread's failure rule, bench smoke."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from phoenixft.serve import SamplingParams
from phoenixft.serve.engine.llm_engine import LLMEngine
from phoenixft.serve.server.errors import EngineDead, RequestFailed
from tests.support.async_engine import AsyncEngine


@pytest.mark.timeout(60)
def test_generate_cli_byte_model(tmp_path):
    from phoenixft.models.llama import LlamaForCausalLM, preset, save_hf

    torch.manual_seed(0)
    save_hf(LlamaForCausalLM(preset("tiny")), tmp_path / "m")
    cmd = [sys.executable, "-m", "phoenixft.serve.server.cli", "generate", str(tmp_path / "m"),
           "--prompt", "import os", "--max-tokens", "5", "--threads", "1"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("import os")
    bad = subprocess.run(cmd[:-4] + ["--max-tokens", "1000"], check=False, capture_output=True,
                         text=True, timeout=50)
    assert bad.returncode == 2 and "maximum context length" in bad.stderr


def test_commands_register_under_phoenixft_cli():
    from phoenixft.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "d"])
    assert (args.host, args.port, callable(args.func)) == ("127.0.0.1", 8000, True)
    assert parser.parse_args(["generate", "d", "--prompt", "x"]).temperature == 0.0
    bench = parser.parse_args(["bench", "serve", "--out", "x.json"])
    assert bench.threads == 2 and callable(bench.func)


@pytest.mark.parametrize("command", [["serve", "d"], ["generate", "d", "--prompt", "x"]])
@pytest.mark.parametrize("threads", ["-1", "0", "two"])
def test_threads_below_one_is_a_usage_error_not_torchs(command, threads, capsys):
    from phoenixft.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--threads", threads])
    assert exc.value.code == 2
    assert "argument --threads: must be" in capsys.readouterr().err


def test_engine_thread_failure_reaches_waiters(hf_models):
    engine = LLMEngine(hf_models["llama"][0])

    def boom():
        raise RuntimeError("injected step failure")

    engine.step = boom  # type: ignore[method-assign]
    runner = AsyncEngine(engine)
    runner.start()

    async def one():
        seq = engine.make_sequence("r1", [1, 2, 3], SamplingParams(max_tokens=2))
        return [o async for o in runner.generate(seq)]

    try:
        with pytest.raises(EngineDead, match="injected step failure"):
            asyncio.run(asyncio.wait_for(one(), 10))
        assert not runner.alive and "injected" in repr(runner.error)
    finally:
        runner.shutdown()


@pytest.mark.timeout(120)
def test_bench_serve_smoke(hf_models, tmp_path):
    from phoenixft.bench.serve import ServeBenchConfig, run

    cfg = ServeBenchConfig(concurrency=[1, 3], rounds=1, repeats=1, threads=1,
                           prompt_len=(4, 8), output_len=(2, 6),
                           model_dir=str(hf_models["llama"][0]))
    result = run(cfg)
    json.dumps(result)
    assert result["threads"] == 1 and result["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    for row in result["results"]:
        assert row["engine"]["useful_tokens"] == row["transformers"]["useful_tokens"]
        assert row["engine"]["tokens_per_s"] > 0 and row["transformers"]["tokens_per_s"] > 0
        hf = row["transformers"]
        assert row["ceiling"] == hf["computed_tokens"] / hf["useful_tokens"] >= 1
        assert row["context"] == (4 + 8 + (2 + 6) // 2) // 2  # the workload's mean
        assert row["wave_context"] == 8 + 6 // 2  # a wave: its width + half its longest
        assert row["engine_step_ms"] > 0 and row["transformers_step_ms"] > 0
        assert row["step_cost_ratio"] == pytest.approx(
            row["transformers_step_ms"] / row["engine_step_ms"], rel=1e-2)
    with pytest.raises(ValueError, match="concurrency"):
        ServeBenchConfig(concurrency=[0])


@pytest.mark.timeout(60)
def test_a_request_the_engine_fails_on_fails_alone(hf_models):
    """A fault that hits one request (a poison token reaching the model) fails that request;
    the requests batched with it get exactly the tokens they get without it."""
    path = hf_models["llama"][0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    clean = LLMEngine(path)
    expected = {rid: clean.add_request(rid, ids, params) for rid, ids in
                (("a", [3, 4, 5]), ("b", [9, 8, 7, 6]))}
    while clean.has_unfinished():
        clean.step()
    expected = {rid: s.completion_token_ids for rid, s in expected.items()}

    engine = LLMEngine(path)
    run = engine.runner.run

    def poisoned(seqs):
        if any(99 in s.token_ids for s in seqs):
            raise RuntimeError("kernel fault on token 99")
        return run(seqs)

    engine.runner.run = poisoned  # type: ignore[method-assign]
    failures = []
    runner = AsyncEngine(engine, on_step_failure=lambda exc, ids: failures.append(ids))
    runner.start()

    async def one(rid, ids):
        seq = engine.make_sequence(rid, ids, params)
        try:
            return [t for o in [o async for o in runner.generate(seq)] for t in o.new_token_ids]
        except RequestFailed as exc:
            return exc

    async def together():
        return await asyncio.gather(one("a", [3, 4, 5]), one("bad", [99, 1]),
                                    one("b", [9, 8, 7, 6]))

    try:
        a, bad, b = asyncio.run(asyncio.wait_for(together(), 30))
        assert isinstance(bad, RequestFailed) and "token 99" in str(bad)
        assert {"a": a, "b": b} == expected
        assert failures and all(ids == ["bad"] for ids in failures)
        assert runner.alive
        again = asyncio.run(asyncio.wait_for(one("c", [3, 4, 5]), 30))
        assert again == expected["a"]
    finally:
        runner.shutdown()


@pytest.mark.timeout(120)
def test_vllm_serve_flags(hf_models, tmp_path):
    """The flags `vllm serve` users type: each takes effect or is refused by name."""
    import os
    import signal
    import socket

    import httpx

    path, _ = hf_models["qwen2"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}<|system|> <|user|> {{ m['content'] }} {% endfor %}"
        "<|assistant|> ")
    cmd = [sys.executable, "-m", "phoenixft.serve.server.cli", "serve", str(path), "--port", str(port),
           "--max-model-len", "128", "--threads", "1", "--served-model-name", "tiny",
           "--api-key", "sk-test", "--block-size", "8", "--kv-cache-memory", "128KiB",
           "--max-num-batched-tokens", "256", "--chat-template", str(tmp_path / "t.jinja"),
           "--tokenizer", str(path)]
    bad = subprocess.run(cmd + ["--dtype", "float64"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--dtype" in bad.stderr and "float64" in bad.stderr
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        # 128 KiB of float32 KV, 512 bytes per token (2 layers x 2 heads x 16 dims x K,V):
        # 256 tokens = 32 blocks of 8 (one 128-token sequence needs 16)
        assert "32 KV blocks of 8" in line, line
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready"
            time.sleep(0.05)  # polling interval
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}],
                "max_tokens": 2}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200, r.text
        # the template's tokens: <|system|> <|user|> w1 w2 <|assistant|>
        assert r.json()["usage"]["prompt_tokens"] == 5
        assert httpx.get(base + "/metrics", timeout=5).status_code == 200  # stays open
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

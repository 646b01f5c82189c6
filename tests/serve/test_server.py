"""The real server (`phoenixft serve` in a subprocess) against the official openai client.

The server process is killed by PID in the fixture's finally; readiness is polled on
/health with a bounded deadline (no sleeps as synchronisation).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from phoenixft.serve import LLM, SamplingParams

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poll(url: str, deadline_s: float, proc: subprocess.Popen | None = None,
          pred=lambda r: r.status_code == 200) -> httpx.Response:
    end = time.monotonic() + deadline_s
    last: object = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            r = httpx.get(url, timeout=2)
            if pred(r):
                return r
            last = r.text
        except httpx.TransportError as exc:
            last = exc
        time.sleep(0.05)  # polling interval, not synchronisation
    raise TimeoutError(f"{url} not ready within {deadline_s}s: {last}")


@pytest.fixture(scope="module")
def server(hf_models):
    path, _ = hf_models["qwen2"]  # WordLevel tokenizer + chat template
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "phoenixft.serve.cli", "serve", str(path), "--port", str(port),
         "--max-model-len", "256", "--threads", "1", "--served-model-name", "tiny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _poll(base + "/health", 60, proc)
        yield base, path
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        proc.stderr.close()


@pytest.fixture(scope="module")
def client(server):
    base, _ = server
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def offline(server):
    return LLM(server[1], max_model_len=256)


PROMPT = "w1 w2 w3 w4 w5"


def test_completion_matches_offline_engine_with_usage(client, offline):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True))[0]
    assert r.choices[0].text == ref.text and ref.text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        5, 12, 17)
    s = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = list(s)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_completion_streaming_and_not(client, offline):
    msgs = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w9 w10"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                       temperature=0.7, seed=3)
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert ids[:3] == [5, 6 + 7, 6 + 8]  # <|system|> w7 w8
    ref = offline.generate([ids], SamplingParams(max_tokens=8, temperature=0.7, seed=3))[0]
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                            temperature=0.7, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.total_tokens == len(ids) + len(ref.token_ids)


def test_sse_ends_with_done_and_concurrent_requests_agree(server, client):
    base, _ = server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith(("data: ", "id: ")) for ln in lines)  # ids count the tokens

    def one(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                         temperature=1.0, seed=seed).choices[0].text

    seeds = [1, 2, 3, 4, 1, 2]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(one, seeds))
    assert together[:2] == together[4:] and [one(s) for s in seeds[:2]] == together[:2]


def test_bad_requests_get_400_and_server_keeps_serving(server, client):
    base, _ = server
    url = base + "/v1/completions"
    cases = [
        (b'{"model": "tiny", "prompt": ', "JSON"),
        (json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": "ten"}), "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": 5}), "prompt"),
        (json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": -1}), "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "w1", "temperature": -2}), "temperature"),
        (json.dumps({"model": "tiny", "prompt": " ".join(["w3"] * 300)}), "context length"),
        (json.dumps({"model": "tiny", "prompt": [1, 2, 999]}), "token ids"),
    ]
    for content, needle in cases:
        r = httpx.post(url, content=content, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, (content, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error"
        assert err["code"]
    r = httpx.post(url, json={"model": "tiny", "prompt": "w1", "max_tokens": 1000,
                              "stream": True}, timeout=30)
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", max_tokens=0,
                                       messages=[{"role": "user", "content": "w1"}])
    ok = client.completions.create(model="tiny", prompt="w1", max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_models_metrics_and_disconnect_aborts(server):
    base, _ = server
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    body = {"model": "tiny", "prompt": "w1", "max_tokens": 250, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        next(r.iter_lines())  # the request is running; leave without reading the rest

    def aborted(resp: httpx.Response) -> bool:
        return 'phoenixft_requests_total{endpoint="completions",outcome="aborted"} 1.0' in \
            resp.text
    metrics = _poll(base + "/metrics", 20, pred=aborted).text
    assert "phoenixft_generation_tokens_total" in metrics
    health = _poll(base + "/health", 20, pred=lambda r: r.json()["running"] == 0).json()
    assert health["waiting"] == 0


def test_hostile_requests_never_kill_the_engine(server, client):
    """Values that once killed the engine (overflow in the sampler, a subnormal
    temperature) and bodies that bypassed the error shape."""
    base, _ = server
    url = base + "/v1/completions"
    refused = [
        ({"top_k": 18446744073709551616}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 2**70}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"n": 2}, "n=1"),
    ]
    for extra, needle in refused:
        r = httpx.post(url, content=json.dumps({"model": "tiny", "prompt": "w1", **extra}),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        assert needle in r.json()["error"]["message"]
    # a subnormal temperature is greedy, not a crash
    tiny = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                     temperature=1e-320, extra_body={"ignore_eos": True})
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert tiny.choices[0].text == greedy.choices[0].text
    big_k = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                      extra_body={"top_k": 2**31 - 1})
    assert big_k.usage.completion_tokens >= 1
    for body, code in [(b"\xff\xfe{not utf-8", "invalid_json"),
                       (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
                       (b"", "invalid_type")]:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error", err
    r = httpx.get(base + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(base + "/health").json()["status"] == "ok"
    ok = client.completions.create(model="tiny", prompt="w1", max_tokens=3)
    assert ok.usage.completion_tokens >= 1

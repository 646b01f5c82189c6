"""The real server (`phoenixft serve` in a subprocess) against the official openai client.

The server process is killed by PID in the fixture's finally; readiness is polled on
/health with a bounded deadline (no sleeps as synchronisation).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from phoenixft.serve import LLM, SamplingParams
from tests.support.waiting import free_port

pytestmark = pytest.mark.timeout(120)


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
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "phoenixft.serve.server.cli", "serve", str(path), "--port", str(port),
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
        return ('phoenixft_requests_total{endpoint="completions",model_name="tiny",'
                'outcome="aborted"} 1.0') in resp.text
    metrics = _poll(base + "/metrics", 20, pred=aborted).text
    assert 'vllm:generation_tokens_total{model_name="tiny"}' in metrics
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
        ({"n": 65}, "n must be in"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
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


# -- the OpenAI fields: each honoured exactly, or refused by name --------------------------

def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the next-token logits after each prefix of `ids`."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def _check_logprobs(model, tok, prompt_ids, tokens, chosen, tops):
    ids = prompt_ids + tok.convert_tokens_to_ids(tokens)
    ref = _hf_logprobs(model, ids)
    for i, (lp, top) in enumerate(zip(chosen, tops)):
        row = ref[len(prompt_ids) + i - 1]
        assert abs(lp - float(row[ids[len(prompt_ids) + i]])) < 1e-4
        want = row.topk(len(top))
        got = sorted(top.items(), key=lambda kv: -kv[1])
        assert [t for t, _ in got] == tok.convert_ids_to_tokens(want.indices.tolist())
        assert max(abs(a - float(b)) for (_, a), b in zip(got, want.values)) < 1e-4


def test_logprobs_equal_transformers(server, client, hf_models, offline):
    from transformers import AutoTokenizer
    _, model = hf_models["qwen2"]
    tok = AutoTokenizer.from_pretrained(server[1])
    prompt_ids = offline.tokenizer.encode(PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=3, logprobs=4,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].logprobs
    assert len(full.tokens) == 6 and all(len(t) == 4 for t in full.top_logprobs)
    _check_logprobs(model, tok, prompt_ids, full.tokens, full.token_logprobs, full.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == full.tokens
    assert sum((s.token_logprobs for s in streamed), []) == full.token_logprobs

    msgs = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=4,
                                          logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    chat_ids = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(msgs),
                                        add_special_tokens=False)
    _check_logprobs(model, tok, chat_ids, [c.token for c in content],
                    [c.logprob for c in content],
                    [{t.token: t.logprob for t in c.top_logprobs} for c in content])
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=4,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    got = [e for c in stream if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in got] == [(c.token, c.logprob) for c in content]


def test_n_and_prompt_lists_equal_single_seeded_requests(client):
    kw = dict(model="tiny", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    many = client.completions.create(prompt=PROMPT, n=3, seed=11, **kw)
    singles = [client.completions.create(prompt=PROMPT, seed=11 + i, **kw).choices[0].text
               for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1  # the choices differ
    assert many.usage.prompt_tokens == client.completions.create(
        prompt=PROMPT, seed=11, **kw).usage.prompt_tokens
    two = client.completions.create(prompt=[PROMPT, "w9 w8"], n=2, seed=5, **kw)
    want = [client.completions.create(prompt=p, seed=5 + i, **kw).choices[0].text
            for p in (PROMPT, "w9 w8") for i in range(2)]
    assert [c.text for c in sorted(two.choices, key=lambda c: c.index)] == want
    streamed: dict[int, str] = {}
    for c in client.completions.create(prompt=PROMPT, n=3, seed=11, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert [streamed[i] for i in range(3)] == singles
    chat = client.chat.completions.create(model="tiny", n=2, seed=7, max_tokens=6,
                                          messages=[{"role": "user", "content": PROMPT}],
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 12


def _greedy_reference(model, ids, steps, presence=0.0, frequency=0.0, bias=None,
                      repetition=1.0):
    """Greedy decoding with OpenAI's presence/frequency penalties, a logit bias and the
    HF/vLLM repetition penalty, written from their definitions."""
    ids = list(ids)
    n_prompt = len(ids)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        for t in set(ids):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        gen = ids[n_prompt:]
        for t in set(gen):
            logits[t] -= frequency * gen.count(t) + presence
        for t, b in (bias or {}).items():
            logits[t] += b
        ids.append(int(logits.argmax()))
    return ids[n_prompt:]


def test_penalties_bias_and_stop_token_ids(client, hf_models, offline):
    from transformers import AutoTokenizer
    _, model = hf_models["qwen2"]
    tok = AutoTokenizer.from_pretrained(hf_models["qwen2"][0])
    prompt_ids = offline.tokenizer.encode(PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    cases = [dict(presence_penalty=1.5, frequency_penalty=0.7),
             dict(logit_bias={"40": 3.0, "41": -100}),
             dict(extra_body={"repetition_penalty": 1.8})]
    for case in cases:
        extra = dict(case.pop("extra_body", {}), ignore_eos=True)
        out = client.completions.create(**kw, **case, extra_body=extra).choices[0].text
        want = _greedy_reference(model, prompt_ids, 10,
                                 presence=case.get("presence_penalty", 0.0),
                                 frequency=case.get("frequency_penalty", 0.0),
                                 bias={int(k): v for k, v in case.get("logit_bias", {}).items()},
                                 repetition=extra.get("repetition_penalty", 1.0))
        assert out.split() == tok.convert_ids_to_tokens(want), case
    plain = _greedy_reference(model, prompt_ids, 10)
    assert _greedy_reference(model, prompt_ids, 10, presence=1.5, frequency=0.7) != plain
    stop_at = plain[3]
    first = plain.index(stop_at)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                    "stop_token_ids": [stop_at]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text.split() == tok.convert_ids_to_tokens(plain[:first])


def test_echo_and_unsupported_fields(server, client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True,
                                  temperature=0)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    base = server[0]
    refused = [("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
               ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of"),
               ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo"),
               ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
               ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"999": 1}}, "logit_bias"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                                         "tools": [{"type": "function"}]}, "tools"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}],
                                         "response_format": {"type": "json_object"}},
                "response_format"),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1",
                                                       "tool_calls": []}]}, "tool_calls")]
    for path, body, needle in refused:
        resp = httpx.post(base + path, json={"model": "tiny", **body}, timeout=30)
        assert resp.status_code == 400, (body, resp.text)
        assert needle in resp.json()["error"]["message"], resp.text
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "n": 2},
                   headers={"Idempotency-Key": "k1"}, timeout=30)
    assert r.status_code == 400 and "Idempotency-Key" in r.json()["error"]["message"]

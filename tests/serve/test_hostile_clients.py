"""What a hostile or careless client can do to a real `phoenixft serve` (a subprocess, raw
sockets where an HTTP library would be too polite): oversized and endless bodies,
slow-loris connections, adapter names that would take the base model away, a reused
Idempotency-Key, a Last-Event-ID past a stream's end, and a run directory that must
not keep every request forever. Each must get a prompt, clear answer, and the server
must keep serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from phoenixft.serve import LLM, EngineConfig, SamplingParams
from tests.support.serving import MAX_LEN, Server, SSEClient, free_port, write_adapter

pytestmark = pytest.mark.timeout(180)

LIMIT = 64 << 10
READ_TIMEOUT = 1.0
KEEP = 3


@pytest.fixture(scope="module")
def server(long_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("hostile") / "run"
    s = Server(long_model, run, free_port(), extra=(
        "--max-request-body", "64KiB", "--request-read-timeout", str(READ_TIMEOUT),
        "--keep-finished-requests", str(KEEP)))
    try:
        yield s
    finally:
        s.stop()


def raw(port: int, data: bytes, timeout: float = 20.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    return s


def read_response(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the
    socket's timeout: a server that never answers fails the test with a timeout)."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        out += chunk
    s.close()
    return out


def head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def assert_healthy(server: Server) -> None:
    assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    # Content-Length of 400 MB, and only a few bytes sent: the answer comes at once
    # (a server that waited for the body would answer 408 after --request-read-timeout, and
    # the socket's timeout fails a server that never answers: 413 is the state to see)
    s = raw(server.port, head("/v1/completions", "Content-Length: 400000000\r\n") + b'{"mo')
    reply = read_response(s)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"
    assert "65536" in body["error"]["message"] and "--max-request-body" in body["error"]["message"]
    # chunked, no Content-Length: counted as it comes, refused once past the limit while
    # the client is still sending (it never sends the last chunk)
    s = raw(server.port, head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
    chunk = b"x" * 8192
    try:
        for _ in range(LIMIT // len(chunk) + 2):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed while we were still sending
    reply = read_response(s)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # under the limit is served as before
    r = httpx.post(server.base + "/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": list(range(6, 106)), "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert_healthy(server)


def test_slow_loris_connections_are_closed(server):
    """Headers trickled a byte at a time (each byte would have reset a keep-alive timer)
    and a body that never comes both end with 408 and a closed connection."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    closed = False
    for byte in request:
        try:
            s.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        s.settimeout(0.2)  # the attacker's pace: one byte per 0.2 s, unless answered
        try:
            got = s.recv(65536)
        except TimeoutError:
            continue
        closed = True
        assert got.startswith(b"HTTP/1.1 408") or got == b"", got[:100]
        break
    s.close()
    # closed before the request was complete: a server that reset its timer on each byte
    # would have kept it open to the end
    assert closed, "the server kept a trickling connection open for 200 s"
    # a body announced but never sent
    s = raw(server.port, head("/v1/completions", "Content-Length: 100\r\n") + b'{"model"')
    reply = read_response(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--request-read-timeout" in reply
    assert_healthy(server)


def load(server: Server, name: str, path, **extra) -> httpx.Response:
    return httpx.post(server.base + "/v1/load_lora_adapter", timeout=60,
                      json={"lora_name": name, "lora_path": str(path), **extra})


def test_adapter_names_are_validated_and_never_shadow(server, long_model, tmp_path):
    a = write_adapter(long_model, tmp_path / "a.safetensors", 1)
    for bad in ("", "../../x", "x" * 10_000, "a b", "tiny/evil"):
        r = load(server, bad, a)
        assert r.status_code == 400, (bad[:20], r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_adapter_name" and "letters, digits" in err["message"]
        assert len(err["message"]) < 300  # a 10,000-character name is not echoed whole
    r = load(server, "tiny", a)  # the served model's name
    assert r.status_code == 400 and "served model" in r.json()["error"]["message"]
    assert load(server, "ad1", a).json() == {"lora_name": "ad1", "version": 1}
    r = load(server, "ad1", a)  # again, without saying it is a replacement
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    assert load(server, "ad1", a, load_inplace=True).json()["version"] == 2
    models = [m["id"] for m in httpx.get(server.base + "/v1/models", timeout=10).json()["data"]]
    assert models == ["tiny", "ad1"]
    r = httpx.post(server.base + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": [6, 7, 8], "max_tokens": 2})
    assert r.status_code == 200


def complete(server: Server, body: dict, key: str) -> httpx.Response:
    return httpx.post(server.base + "/v1/completions", json=body, timeout=60,
                      headers={"Idempotency-Key": key})


def test_an_idempotency_key_reused_with_another_body_is_refused(server):
    body = {"model": "tiny", "prompt": [6, 7, 8, 9], "max_tokens": 3, "temperature": 0.0}
    first = complete(server, body, "key-reuse")
    assert first.status_code == 200
    again = complete(server, dict(reversed(body.items())), "key-reuse")  # same body
    assert again.status_code == 200
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    other = complete(server, {**body, "prompt": [10, 11]}, "key-reuse")
    assert other.status_code == 422, other.text
    err = other.json()["error"]
    assert err["code"] == "idempotency_key_reused" and "'key-reuse'" in err["message"]
    assert "different body" in err["message"]


def test_finished_requests_are_kept_within_the_retention_limit(server):
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0.0}
    ids = [complete(server, {**body, "prompt": [6 + i]}, f"keep-{i}").headers["x-request-id"]
           for i in range(KEEP + 3)]
    stored = {p.stem for p in (server.run_dir / "requests").glob("*.json")}
    assert stored == set(ids[-KEEP:])
    # the newest are still answered from their stored result, the oldest computed again
    assert complete(server, {**body, "prompt": [6 + KEEP + 2]},
                    f"keep-{KEEP + 2}").headers["x-request-id"] == ids[-1]
    assert complete(server, {**body, "prompt": [6]}, "keep-0").headers["x-request-id"] != ids[0]


def test_last_event_id_past_the_end_answers_at_once(server, long_model):
    prompt = list(range(6, 106))
    max_tokens = 400
    llm = LLM(long_model, EngineConfig(max_model_len=MAX_LEN))
    sampling = {"temperature": 1.0, "seed": 5, "ignore_eos": True}
    ref = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **sampling))[0].token_ids
    # a token whose first appearance is late: stopping on it ends the stream there
    stop_at = next(i for i in range(200, max_tokens - 50) if ref[i] not in ref[:i])
    for last_id, stop in ((10**9, None), (max_tokens, None), (stop_at + 50, ref[stop_at])):
        body = {"model": "tiny", "prompt": prompt, "stream": True, "max_tokens": max_tokens,
                **sampling}
        if stop is not None:  # it ends after stop_at + 1 tokens, before last_id
            body["stop_token_ids"] = [stop]
        c = SSEClient(server.base, body)
        c.start()
        deadline = time.monotonic() + 60
        while not c.texts:  # the stream runs (a state), bounded
            assert c.error is None and time.monotonic() < deadline, c.error
            time.sleep(0.01)
        with httpx.stream("GET", f"{server.base}/v1/streams/{c.rid}", timeout=30,
                          headers={"Last-Event-ID": str(last_id)}) as r:
            lines = [ln for ln in r.iter_lines() if ln]
            status = r.status_code
        if last_id > max_tokens:
            assert status == 400, lines
            assert "past the end" in json.loads(lines[0])["error"]["message"]
        else:
            assert status == 200 and lines[-1] == "data: [DONE]", lines
            events = [json.loads(ln[6:]) for ln in lines[:-1] if ln.startswith("data: ")]
            if stop is None:  # it ended exactly where the client was: nothing to send
                assert events == []
            else:
                assert len(events) == 1 and "past the end" in events[0]["error"]["message"]
        c.join(60)
        assert c.error is None and c.done
    assert_healthy(server)

"""An engine that stops serving. `phoenixft serve --no-recovery` (one engine, no log, no
standby), its engine SIGKILLed under 32 streams: every client's request ends at once with
an error (they waited forever, /health counted them as running, and the front's watcher
died on the closed pidfd), and /health says the engine is gone. With recovery, the engine
SIGSTOPped under 32 streams: hung, not dead, it is found by its heartbeat's deadline and
replaced by the standby like a dead one."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.support.serving import (
    Server,
    SSEClient,
    free_port,
    params,
    prompts,
    reference,
    wait_tokens,
)


@pytest.mark.timeout(300)
def test_no_recovery_engine_killed_under_32_streams_every_request_ends_with_an_error(
        long_model, tmp_path):
    server = Server(long_model, tmp_path / "run", free_port(), ("--no-recovery",))
    try:
        clients = [SSEClient(server.base, {"model": "tiny", "prompt": p, "stream": True,
                                           **params(i, 500)})
                   for i, p in enumerate(prompts(32, 40))]
        for c in clients:
            c.start()
        wait_tokens(clients, 2)
        os.kill(server.status()["engine_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        for c in clients:
            c.join(60)
        assert not any(c.is_alive() for c in clients)
        ended_s = time.monotonic() - t0
        assert ended_s < 30, ended_s  # at once: no deadline of ours is involved
        assert not any(c.done for c in clients)  # none got a [DONE] it did not earn
        assert all(c.error is not None for c in clients)
        assert any("the engine stopped" in str(c.error) for c in clients), \
            [str(c.error)[:200] for c in clients[:3]]
        h = httpx.get(server.base + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["running"] == 0, h.json()
        assert "no engine could take over" in h.json()["error"]
        assert server.events("engine_lost")
        # a new request is refused at once, naming the cause
        r = httpx.post(server.base + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code >= 500 and "the engine stopped" in r.text, r.text
    finally:
        server.stop()


def _streaming(server: Server, ps: list[list[int]], max_tokens: int) -> list[SSEClient]:
    """One stream per prompt, started once the standby is warm; returns when every one
    has tokens and the recovery log holds them all running."""
    clients = [SSEClient(server.base, {"model": "tiny", "prompt": p, "stream": True,
                                       **params(i, max_tokens)}) for i, p in enumerate(ps)]
    server.wait_standby_warm()
    for c in clients:
        c.start()
    wait_tokens(clients, 3)
    server.wait_logged(len(ps))
    return clients


@pytest.mark.timeout(420)
def test_a_hung_engine_is_replaced_by_the_standby_and_32_streams_go_on(long_model, tmp_path):
    """The active engine SIGSTOPped mid-decode (every stream stalled until SIGCONT, and
    /health said ok): its heartbeat stands still, the front SIGKILLs it after its deadline
    (5 s), the standby replays the log, and every stream ends with the uninterrupted run's
    tokens, without a gap or a duplicate, and no prompt token computed again."""
    n, max_tokens = 32, 160  # (every stream still decoding when the engine stops)
    ps = prompts(n, 40)
    ref = reference(long_model, ps, max_tokens)
    server = Server(long_model, tmp_path / "run", free_port())
    pid = None
    try:
        clients = _streaming(server, ps, max_tokens)
        pid = server.status()["engine_pid"]
        os.kill(pid, signal.SIGSTOP)
        assert not any(c.done for c in clients)  # stopped mid-decode: all of them wait
        for c in clients:
            c.join(180)
        for i, c in enumerate(clients):
            assert c.error is None and c.done, (i, c.error)
            assert "".join(c.texts) == ref[i], i
            assert c.ids == list(range(1, max_tokens + 1))  # no gap, no duplicate
        [hung] = server.events("engine_hung")
        assert hung["pid"] == pid and hung["role"] == "active" and hung["silent_s"] > 5
        [rec] = server.events("engine_recovered")
        assert rec["report"]["resumed"] > 0  # (those that had not finished when it stopped)
        metrics = httpx.get(server.base + "/metrics", timeout=10).text
        assert re.search(r"phoenixft_prompt_tokens_recomputed\{[^}]*\} 0\.0", metrics)
        assert server.status()["engine_pid"] != pid
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)  # (gone by now when the front killed it)
            except ProcessLookupError:
                pass
        server.stop()


@pytest.mark.timeout(420)
def test_a_dead_log_executor_is_restarted_and_a_later_crash_recomputes_nothing(
        long_model, tmp_path):
    """The recovery log's executor SIGKILLed under 8 streams: a new one takes the log over
    (said on the console and in the event log) and the engine logs on, so the engine's
    own SIGKILL after it costs no prompt token (it recomputed 502 of them: nothing logged
    after the executor died), and every stream ends with the uninterrupted tokens."""
    n, max_tokens = 8, 900  # (the streams still decoding after the restart)
    ps = prompts(n, 60)
    ref = reference(long_model, ps, max_tokens)
    server = Server(long_model, tmp_path / "run", free_port())
    try:
        clients = _streaming(server, ps, max_tokens)
        engine = psutil.Process(server.status()["engine_pid"])
        [executor] = [p for p in engine.children()
                      if "phoenixft.serve.recovery.executor" in " ".join(p.cmdline())]
        executor.kill()
        deadline = time.monotonic() + 60
        while not server.events("log_executor_restarted"):
            assert time.monotonic() < deadline, "the dead executor was never replaced"
            time.sleep(0.05)  # polling the event log for a state, bounded
        server.wait_logged(n)  # the new executor commits epochs, all 8 still running
        server.kill_engine()
        for c in clients:
            c.join(180)
        for i, c in enumerate(clients):
            assert c.error is None and c.done, (i, c.error)
            assert "".join(c.texts) == ref[i], i
        [restart] = server.events("log_executor_restarted")
        assert f"code -{signal.SIGKILL}" in restart["error"] and restart["pid"] != executor.pid
        metrics = httpx.get(server.base + "/metrics", timeout=10).text
        assert re.search(r"phoenixft_prompt_tokens_recomputed\{[^}]*\} 0\.0", metrics), metrics
    finally:
        server.stop()

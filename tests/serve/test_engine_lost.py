"""`phoenixft serve --no-recovery`: one engine, no log, no standby. Its engine SIGKILLed
under 32 streams: every client's request ends at once with an error (they waited forever,
/health counted them as running, and the front's watcher died on the closed pidfd), and
/health says the engine is gone."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.support.serving import Server, SSEClient, free_port, params, prompts, wait_tokens


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

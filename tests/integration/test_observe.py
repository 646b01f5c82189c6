"""Watching a running job: the node agent's Prometheus metrics scraped during a run with
two injected kills, the PNG timeline of that run, and `status --watch` on it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest

from phoenixft.platform import free_port
from tests.support.jobs import PHOENIXFT, ROOT, kill_members, kill_tree, start, wait_until

pytestmark = [pytest.mark.integration]


def _value(text: str, name: str, labels: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(240)
def test_metrics_during_a_run_with_two_kills_then_its_timeline(tmp_path):
    port = free_port()
    p = start(tmp_path, "--nproc", "2", "--spares", "2", "--metrics-port", str(port),
              "--inject", "kill:rank=1:step=5", "--inject", "kill:rank=0:step=10", steps=2000)
    url = f"http://127.0.0.1:{port}/metrics"

    def scraped():
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.TransportError:
            return None
        failures = _value(text, "phoenixft_train_failures_total", '{kind="exit"}')
        step = _value(text, "phoenixft_train_step")
        return text if failures == 2 and step is not None and step >= 14 else None

    try:
        text = wait_until(scraped, 180, "two failures and step 14 in the metrics")
        assert p.poll() is None  # scraped while the job runs
        assert _value(text, "phoenixft_train_recovery_seconds_count") == 2
        assert _value(text, "phoenixft_train_detect_seconds_count") == 2
        assert _value(text, "phoenixft_train_generation") == 2
        assert _value(text, "phoenixft_train_world_size") == 2
        assert _value(text, "phoenixft_train_spares_available") == 0
        assert 0 <= _value(text, "phoenixft_train_lost_steps_total") <= 2
        assert _value(text, "phoenixft_train_steps_total") >= 14
        assert _value(text, "phoenixft_train_step_seconds_count") >= 10
        assert _value(text, "phoenixft_train_snapshot_bytes") > 0
        assert _value(text, "phoenixft_train_committed_step") >= 1
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path)
    out = tmp_path / "timeline.png"
    r = subprocess.run([*PHOENIXFT, "plot", str(tmp_path), "-o", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    w = subprocess.run([*PHOENIXFT, "status", str(tmp_path), "--watch"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)  # the job ended: returns
    assert w.returncode == 0 and "n0w" in w.stdout, w.stdout + w.stderr


def test_a_metrics_port_in_use_is_one_clear_line(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([*PHOENIXFT, "run", "--run-dir", str(tmp_path), "--metrics-port",
                            str(port), sys.executable], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 2 and f"--metrics-port {port}" in r.stderr, r.stderr

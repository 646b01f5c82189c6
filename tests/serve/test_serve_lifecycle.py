"""`phoenixft serve` starting, failing to start and stopping, with real processes: bad
input is one line naming the cause (no traceback, no "serving" first), and nothing the
server made is left in /tmp or /dev/shm however it ends (clean SIGTERM, SIGKILL of the
front, a start that fails). Each server gets a TMPDIR of its own, so what is left is
this test's, not another test's running beside it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from phoenixft.serve.server.http import default_log_dir
from tests.support.serving import MAX_LEN, Server, free_port, write_adapter

pytestmark = pytest.mark.timeout(180)


def serve_cmd(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "phoenixft.serve.server.cli", "serve", str(model), "--port",
            str(port), "--threads", "1", "--max-model-len", str(MAX_LEN), *extra]


def env_with_tmp(tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phoenixft serve: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def wait_for(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # polling a state, bounded


def leftovers(tmp: Path, log_dir: str | None, front: int | None = None) -> list[str]:
    """What a server left: in its TMPDIR, its log, and (a TMPDIR too deep for a Unix
    socket's path puts the socket's directory there) in /tmp under its front's pid."""
    left = [str(p) for p in tmp.glob("phoenixft-serve-*")]
    if front is not None:
        left += [str(p) for p in Path("/tmp").glob(f"phoenixft-serve-{front}-*")]
    return left + ([log_dir] if log_dir and os.path.exists(log_dir) else [])


def test_bad_port_corrupt_weights_and_port_in_use_are_one_line(long_model, tmp_path):
    env = env_with_tmp(tmp_path / "tmp")
    r = subprocess.run(serve_cmd(long_model, 70000), capture_output=True, text=True, env=env,
                       timeout=60)
    one_line_error(r, "--port 70000", "1-65535")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in long_model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    r = subprocess.run(serve_cmd(bad, free_port()), capture_output=True, text=True, env=env,
                       timeout=60)
    one_line_error(r, str(weights), "not a readable safetensors file")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(serve_cmd(long_model, port), capture_output=True, text=True,
                           env=env, timeout=60)
    one_line_error(r, f"port {port}", "already in use", "--port")
    assert leftovers(tmp_path / "tmp", None) == []  # nothing was made: all checked first


def test_a_start_that_fails_in_the_engine_leaves_nothing(long_model, tmp_path):
    """The front's checks pass, the engines cannot load the model (config.json names a
    layer the weights do not have): one line with the engine's cause, nothing left."""
    bad = tmp_path / "mismatch"
    bad.mkdir()
    for f in long_model.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(serve_cmd(bad, free_port(), "--run-dir", str(run_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env_with_tmp(tmp_path / "tmp"))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 1 and out == "" and "Traceback" not in err, (out, err)
    [line] = err.strip().splitlines()
    assert "model.layers.2" in line and "does not match config.json" in line, line
    log_dir = str(default_log_dir(run_dir))
    wait_for(lambda: leftovers(tmp_path / "tmp", log_dir, proc.pid) == [],
             f"left behind: {leftovers(tmp_path / 'tmp', log_dir, proc.pid)}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_nothing_is_left_after_the_front_ends(long_model, tmp_path, sig):
    tmp = tmp_path / "tmp"
    port = free_port()
    proc = subprocess.Popen(serve_cmd(long_model, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env_with_tmp(tmp))
    pids: list[int] = []
    try:
        wait_for(lambda: proc.poll() is None and _ok(port), "server not ready", 120)
        [status_file] = tmp.glob("phoenixft-serve-run-*/status.json")
        status = json.loads(status_file.read_text())
        log_dir = status["log_dir"]
        assert os.path.isdir(log_dir)
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, sig)
        proc.wait(60)
        wait_for(lambda: leftovers(tmp, log_dir, proc.pid) == [],
                 f"left behind: {leftovers(tmp, log_dir, proc.pid)}")
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids),
                 "engines, executors or the janitor outlived the front")
    finally:
        for pid in [proc.pid, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)
        proc.stderr.close()


def _ok(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_an_adapter_too_large_for_the_log_is_refused_and_changes_nothing(long_model, tmp_path):
    """An adapter the recovery ring could never carry (16 MiB by default) is refused
    before it is installed, naming its size and the flag; the engine goes on serving the
    adapters it has, a successor after a crash has the same ones, and /v1/models lists
    exactly those."""
    cfg = json.loads((long_model / "config.json").read_text())
    hd = cfg["head_dim"]
    per_rank = cfg["num_hidden_layers"] * 4 * (2 * cfg["hidden_size"] + cfg[
        "num_attention_heads"] * hd + cfg["num_key_value_heads"] * hd)  # A and B of q and v
    big = write_adapter(long_model, tmp_path / "big.safetensors", 3,
                        rank=(16 << 20) // per_rank + 64)
    small = write_adapter(long_model, tmp_path / "small.safetensors", 1)
    server = Server(long_model, tmp_path / "run", free_port())
    try:
        def load(name, path):
            return httpx.post(server.base + "/v1/load_lora_adapter", timeout=120,
                              json={"lora_name": name, "lora_path": str(path)})

        def models():
            return [m["id"] for m in httpx.get(server.base + "/v1/models", timeout=10).json()["data"]]

        def complete(model):
            return httpx.post(server.base + "/v1/completions", timeout=60, json={
                "model": model, "prompt": [6, 7, 8], "max_tokens": 4, "temperature": 0.0})

        assert load("small", small).status_code == 200
        r = load("big", big)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "--recovery-ring-bytes" in msg and "MiB" in msg and "big" in msg, msg
        first = complete("small")
        assert first.status_code == 200, first.text
        assert complete("big").status_code == 404
        assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
        assert models() == ["tiny", "small"]
        server.wait_standby_warm()
        server.kill_engine()
        wait_for(lambda: server.events("engine_recovered"), "no engine took over", 120)
        wait_for(lambda: _ok(server.port), "not healthy after the takeover")
        assert models() == ["tiny", "small"]
        again = complete("small")
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        [rec] = server.events("engine_recovered")
        assert rec["report"]["adapters"] == 1
    finally:
        server.stop()

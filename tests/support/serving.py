"""A real `phoenixft serve` for tests (a front, engine processes, a recovery log), killed by
PID when done, and the clients and references the serving tests compare against."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from phoenixft.bench.serve_open import wait_healthy
from phoenixft.serve import LLM, EngineConfig, SamplingParams
from phoenixft.serve.server.http import default_log_dir
from tests.support.waiting import free_port as free_port

MAX_LEN = 1024


class Server:
    """`phoenixft serve` in a subprocess; killed by PID (front, engines) when done."""

    def __init__(self, model: Path, run_dir: Path, port: int, extra: tuple[str, ...] = ()) -> None:
        self.run_dir, self.port = run_dir, port
        self.base = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "phoenixft.serve.server.cli", "serve", str(model), "--port", str(port),
             "--max-model-len", str(MAX_LEN), "--threads", "1", "--run-dir", str(run_dir),
             "--served-model-name", "tiny", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_healthy(self.proc, self.base, 120.0, poll_s=0.05)

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def events(self, name: str) -> list[dict]:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]

    def wait_standby_warm(self) -> None:
        deadline = time.monotonic() + 120
        while not self.status().get("standby_warm"):
            if time.monotonic() > deadline:
                raise TimeoutError("the standby engine never became warm")
            time.sleep(0.05)  # polling status.json for a state, bounded

    def wait_logged(self, running: int, timeout: float = 120) -> None:
        """Wait for a state worth a crash: the active engine (the one status.json names)
        runs `running` requests, and its log executor committed two more epochs after that
        was seen (so the log holds them all)."""
        deadline = time.monotonic() + timeout

        def health() -> dict:
            h = httpx.get(self.base + "/health", timeout=5).json()
            return h if h.get("engine_pid") == self.status()["engine_pid"] else {}
        while health().get("running", 0) < running:
            assert time.monotonic() < deadline, f"{running} requests never ran together"
            time.sleep(0.05)  # polling the engine's state, bounded
        seen = health().get("log_committed_epoch", -1)  # an epoch id: monotonic across engines
        while health().get("log_committed_epoch", -1) < seen + 2:
            assert time.monotonic() < deadline, (
                f"the recovery log made no progress: {seen} epochs, then /health "
                f"{httpx.get(self.base + '/health', timeout=5).json()}, status {self.status()}, "
                f"log failures {self.events('log_failed')}")
            time.sleep(0.05)  # polling the log's progress, bounded

    def kill_engine(self) -> int:
        """SIGKILL the active engine. A standby that is still starting makes the takeover
        slower (it is waited for), never wrong."""
        pid = self.status()["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        return pid

    def pids(self) -> list[int]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, keep_log: bool = False) -> None:
        """SIGKILL the front and its engines, then (unless a successor is to resume from
        it) remove the recovery log they leave in /dev/shm on purpose."""
        try:
            status = self.status()
        except (OSError, ValueError):  # (read while the front rewrote it)
            status = {}
        # (the run directory names its log: status.json may be unreadable at this moment,
        # and its log then stayed in /dev/shm for good)
        log_dir = status.get("log_dir") or default_log_dir(self.run_dir)
        janitor = status.get("janitor_pid")
        for pid in self.pids():
            if pid == janitor:
                continue  # it cleans up once the front and the engines are gone
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.proc.stderr.close()
        if janitor:
            try:
                psutil.Process(janitor).wait(60)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                os.kill(janitor, signal.SIGKILL)
        if log_dir and not keep_log:
            shutil.rmtree(log_dir, ignore_errors=True)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 128) for _ in range(length + 7 * i)] for i in range(n)]


def params(i: int, max_tokens: int) -> dict:
    """Greedy for even requests, seeded sampling for odd ones."""
    return ({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}) | {
        "max_tokens": max_tokens, "ignore_eos": True}


def reference(model: Path, ps: list[list[int]], max_tokens: int) -> list[str]:
    llm = LLM(model, EngineConfig(max_model_len=MAX_LEN))
    sps = [SamplingParams(**params(i, max_tokens)) for i in range(len(ps))]
    return [o.text for o in llm.generate(ps, sps)]


class SSEClient(threading.Thread):
    """One streaming request read event by event: its texts, and its event ids."""

    def __init__(self, base: str, body: dict | None = None, *, resume: tuple[str, int] | None = None):
        super().__init__(daemon=True)
        self.base, self.body, self.resume = base, body, resume
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.rid: str | None = None
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.resume is None:
                req = ("POST", self.base + "/v1/completions", {"json": self.body})
            else:
                rid, after = self.resume
                req = ("GET", f"{self.base}/v1/streams/{rid}",
                       {"headers": {"Last-Event-ID": str(after)}})
            with httpx.stream(req[0], req[1], timeout=120, **req[2]) as r:
                assert r.status_code == 200, r.read()
                self.rid = r.headers["x-request-id"]
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        self.ids.append(int(line[4:]))
                    elif line.startswith("data: {"):
                        d = json.loads(line[6:])
                        assert "error" not in d, d
                        if d["choices"]:
                            self.texts.append(d["choices"][0]["text"])
                    elif line == "data: [DONE]":
                        self.done = True
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc


def wait_tokens(clients, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while min(len(c.texts) for c in clients) < n:
        assert not any(c.done for c in clients), "a stream finished before the fault"
        if time.monotonic() > deadline:
            raise TimeoutError(f"streams did not reach {n} tokens")
        time.sleep(0.01)  # polling the clients' progress (a state), bounded


def write_adapter(model: Path, out: Path, seed: int, rank: int = 4) -> Path:
    """Random LoRA tensors of the model's shapes (adapters.py's file format)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    width = {"q": cfg["num_attention_heads"] * hd, "v": cfg["num_key_value_heads"] * hd}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for p, w in width.items():
            tensors[f"layers.{i}.{p}.lora_A"] = torch.randn(rank, hidden, generator=g) * 0.3
            tensors[f"layers.{i}.{p}.lora_B"] = torch.randn(w, rank, generator=g) * 0.3
    save_file(tensors, str(out), metadata={"scale": "2.0"})
    return out



"""`python -m phoenixft.serve.server.engine_proc`: one serving engine process, supervised by the
HTTP front (`supervisor.py`).

It loads the model (imports paid, weights loaded, one warm-up generation run), connects to
the front's socket and says hello with its role. The *active* engine serves at once,
recovering first from the log if one is there (the whole server was restarted); a warm
*standby* waits for `activate`, then rebuilds the crashed engine's requests from the log it
left (`recovery/restore.py`) and serves them on. Either way it keeps the recovery log itself
(`recorder.py`), through a log executor process started with the engine (`executor.py`).
It dies with the front (parent-death signal), and its executor with it.

Messages (wire.py), front -> engine: add {id, prompt, params, seed}, abort {id}, activate,
shutdown. Engine -> front: hello {pid, role}, ready {report, resumed}, out {outs, stats},
log_failed {error}.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

from phoenixft.platform import die_with_parent


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="{}", help="EngineConfig fields as JSON")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--role", choices=["active", "standby"], required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ring-bytes", type=int, default=16 << 20)
    ap.add_argument("--compact-bytes", type=int, default=256 << 20)
    ap.add_argument("--parent", type=int, required=True)
    return ap.parse_args(argv)


class EngineServer:
    def __init__(self, engine, channel, args: argparse.Namespace, executor) -> None:
        self.engine, self.ch, self.args, self.executor = engine, channel, args, executor
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._consecutive_failures = 0
        self.recorder = None  # the engine's StepRecorder, kept here for its summary

    def start_recording(self) -> dict:
        from phoenixft.serve.recovery.log import lock_log, segments
        from phoenixft.serve.recovery.recorder import Recorder
        from phoenixft.serve.recovery.restore import RecoveryReport, recover

        lock = lock_log(self.args.log_dir, wait_s=10.0)  # the crashed engine's executor is gone
        try:
            report = recover(self.engine, self.args.log_dir) if segments(self.args.log_dir) \
                else RecoveryReport()
        finally:
            os.close(lock)  # this engine's executor takes it when it starts writing
        self.recorder = self.engine.recorder = Recorder(
            self.engine, self.args.log_dir, first_epoch=report.last_commit + 1,
            first_seq=report.next_seq, compact_bytes=self.args.compact_bytes,
            executor=self.executor,
            on_error=lambda msg: self.ch.send({"op": "log_failed", "error": msg}))
        resumed = [{"id": s.seq_id, "prompt_tokens": s.num_prompt_tokens,
                    "completion": s.completion_token_ids, "emitted": s.emitted}
                   for s in self.engine.seqs.values()]
        return {"report": report.as_dict(), "resumed": resumed,
                "adapters": dict(self.engine.adapters.current)}

    def read(self) -> None:
        """Reader thread: the front's commands; the front gone means this process ends."""
        while True:
            msg = self.ch.recv()
            if msg is None or msg.get("op") == "shutdown":
                os._exit(0)
            self.commands.put(msg)
            self.wake.set()

    def _drain(self) -> None:
        from phoenixft.serve.engine.config import SamplingParams
        while True:
            try:
                msg = self.commands.get_nowait()
            except queue.Empty:
                return
            if msg["op"] == "add":
                try:
                    seq = self.engine.spec.make_sequence(msg["id"], msg["prompt"],
                                                         SamplingParams(**msg["params"]))
                    seq.seed, seq.adapter = msg["seed"], msg.get("adapter")
                    seq.adapter_version = msg.get("adapter_version") or 0
                    self.engine.add_sequence(seq)
                except ValueError as exc:
                    self.ch.send({"op": "failed", "ids": [msg["id"]], "error": str(exc),
                                  "client": True})
            elif msg["op"] == "abort":
                self.engine.abort(msg["id"])
            elif msg["op"] == "load_adapter":
                try:
                    version = self.engine.load_adapter(msg["name"], msg["path"],
                                                       replace=bool(msg.get("replace")))
                    self.ch.send({"op": "adapter", "token": msg["token"], "name": msg["name"],
                                  "version": version})
                except ValueError as exc:
                    self.ch.send({"op": "adapter_error", "token": msg["token"], "error": str(exc)})

    def _step(self) -> list:
        try:
            outs = self.engine.step()
            self._consecutive_failures = 0
            return outs
        except Exception as exc:  # noqa: BLE001 - one request's failure is not the engine's
            self._consecutive_failures += 1
            if self._consecutive_failures >= 3:
                raise
            outs, ids = self.engine.isolate_failed_step()
            self.ch.send({"op": "failed", "ids": ids, "error": repr(exc)})
            return outs

    def stats(self) -> dict:
        e = self.engine
        return {"pid": os.getpid(),
                "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
                "kv_usage": e.block_manager.usage, "preemptions": e.scheduler.num_preemptions,
                "generated": e.num_generated_tokens,
                "log": self.recorder.summary() if self.recorder is not None else None}

    def serve(self) -> None:
        threading.Thread(target=self.read, daemon=True, name="phoenixft-engine-reader").start()
        last_stats = 0.0
        while True:
            self._drain()
            if not self.engine.has_unfinished():
                self.wake.wait(0.5)
                self.wake.clear()
                if time.monotonic() - last_stats > 0.5:
                    self.ch.send({"op": "out", "outs": [], "stats": self.stats()})
                    last_stats = time.monotonic()
                continue
            outs = self._step()
            msg = {"op": "out", "outs": [[o.request_id, o.new_token_ids, o.new_text,
                                          o.num_completion_tokens, o.finished, o.finish_reason,
                                          o.prompt_computed, o.num_prompt_tokens, o.logprobs]
                                         for o in outs]}
            if time.monotonic() - last_stats > 0.5:
                msg["stats"] = self.stats()
                last_stats = time.monotonic()
            if not self.ch.send(msg):
                os._exit(0)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    die_with_parent(args.parent)
    import torch

    from phoenixft.serve.engine.config import EngineConfig
    from phoenixft.serve.engine.llm_engine import LLMEngine
    from phoenixft.serve.recovery.executor import start_executor

    from . import wire

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = LLMEngine(args.model, EngineConfig(**json.loads(args.config)))
    except ValueError as exc:  # a bad model directory: one line, the front reports it
        sys.stderr.write(f"phoenixft engine: {exc}\n")
        os._exit(2)
    executor = start_executor(engine.runner, args.log_dir, args.ring_bytes)  # warm, idle
    engine.warm_up()
    ch = wire.connect(args.socket)
    ch.send({"op": "hello", "pid": os.getpid(), "role": args.role})
    if args.role == "standby":
        msg = ch.recv()
        if msg is None or msg.get("op") != "activate":
            os._exit(0)
    server = EngineServer(engine, ch, args, executor)
    t0 = time.perf_counter()
    ready = server.start_recording()
    ready["report"]["activate_s"] = round(time.perf_counter() - t0, 4)
    ch.send({"op": "ready", "pid": os.getpid(), **ready})
    try:
        server.serve()
    except BaseException as exc:  # noqa: BLE001 - told to the front, then the process ends
        ch.send({"op": "fatal", "error": repr(exc)})
        sys.stderr.write(f"phoenixft engine {os.getpid()}: {exc!r}\n")
        os._exit(1)


if __name__ == "__main__":
    main()

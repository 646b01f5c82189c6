"""`python -m phoenixft.serve.server.engine_proc`: one serving engine process, supervised by the
HTTP front (`supervisor.py`).

It loads the model (imports paid, weights loaded, one warm-up generation run), connects to
the front's socket and says hello with its role. The *active* engine serves at once,
recovering first from the log if one is there (the whole server was restarted); a warm
*standby* waits for `activate`, then rebuilds the crashed engine's requests from the log it
left (`recovery/restore.py`) and serves them on. Either way it keeps the recovery log itself
(`recorder.py`), through a log executor process started with the engine (`executor.py`).
It dies with the front (parent-death signal), and its executor with it.

Messages (`messages.py`, over `wire.py`), front -> engine: Add, Abort, LoadAdapter,
Activate. Engine -> front: Hello, Ready, Outputs, Failed, AdapterLoaded/AdapterRefused,
LogFailed, Fatal. The front closing the connection ends the process.
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

from .messages import (
    BEAT_S,
    Abort,
    Activate,
    AdapterLoaded,
    AdapterRefused,
    Add,
    Beat,
    EngineRole,
    Failed,
    Fatal,
    Hello,
    LoadAdapter,
    LogFailed,
    LogRestarted,
    Outputs,
    Ready,
    Resumed,
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="{}", help="EngineConfig fields as JSON")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--role", type=EngineRole, choices=list(EngineRole), required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ring-bytes", type=int, default=16 << 20)
    ap.add_argument("--compact-bytes", type=int, default=256 << 20)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--no-log", action="store_true", help="no recovery log (--no-recovery)")
    return ap.parse_args(argv)


class EngineServer:
    def __init__(self, engine, channel, args: argparse.Namespace, executor) -> None:
        self.engine, self.ch, self.args, self.executor = engine, channel, args, executor
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self._consecutive_failures = 0
        self.recorder = None  # the engine's StepRecorder, kept here for its summary

    def start_recording(self) -> Ready:
        from phoenixft.serve.recovery.log import lock_log, segments
        from phoenixft.serve.recovery.recorder import Recorder
        from phoenixft.serve.recovery.restore import RecoveryReport, recover

        if self.args.no_log:  # serving without recovery: nothing to resume, nothing kept
            return Ready(os.getpid(), RecoveryReport().as_dict(), [],
                         dict(self.engine.adapters.current))
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
            on_error=lambda msg: self.ch.send(LogFailed(msg)),
            on_restart=lambda why, pid: self.ch.send(LogRestarted(why, pid)))
        resumed = [Resumed(s.seq_id, s.num_prompt_tokens, s.completion_token_ids, s.emitted)
                   for s in self.engine.seqs.values()]
        return Ready(os.getpid(), report.as_dict(), resumed, dict(self.engine.adapters.current))

    def read(self) -> None:
        """Reader thread: the front's commands; the front gone means this process ends."""
        while True:
            msg = self.ch.recv()
            if msg is None:
                os._exit(0)
            self.commands.put(msg)
            self.wake.set()

    def _drain(self) -> None:
        while True:
            try:
                msg = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Add):
                try:
                    seq = self.engine.spec.make_sequence(msg.id, msg.prompt, msg.params)
                    seq.seed, seq.adapter = msg.seed, msg.adapter
                    seq.adapter_version = msg.adapter_version or 0
                    self.engine.add_sequence(seq)
                except ValueError as exc:
                    self.ch.send(Failed([msg.id], str(exc), client=True))
            elif isinstance(msg, Abort):
                self.engine.abort(msg.id)
            elif isinstance(msg, LoadAdapter):
                try:
                    version = self.engine.load_adapter(msg.name, msg.path,
                                                       replace=bool(msg.replace))
                    self.ch.send(AdapterLoaded(msg.token, msg.name, version))
                except ValueError as exc:
                    self.ch.send(AdapterRefused(msg.token, str(exc)))

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
            self.ch.send(Failed(ids, repr(exc)))
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
                    if self.recorder is not None:
                        self.recorder.check()
                    self.ch.send(Outputs([], self.stats()))
                    last_stats = time.monotonic()
                continue
            msg = Outputs(self._step())
            if time.monotonic() - last_stats > 0.5:
                msg.stats = self.stats()
                last_stats = time.monotonic()
            if not self.ch.send(msg):
                os._exit(0)


def _beat(ch) -> None:
    """This process is alive, said every BEAT_S on its own thread (a busy decode loop
    beats on: torch releases the GIL; a stopped or wedged process does not)."""
    while ch.send(Beat()):
        time.sleep(BEAT_S)  # a heartbeat's period, not a wait for a state


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
    executor = (None if args.no_log  # warm, idle
                else start_executor(engine.runner, args.log_dir, args.ring_bytes))
    engine.warm_up()
    ch = wire.connect(args.socket)
    ch.send(Hello(os.getpid(), args.role))
    threading.Thread(target=_beat, args=(ch,), daemon=True, name="phoenixft-beat").start()
    if args.role is EngineRole.STANDBY and not isinstance(ch.recv(), Activate):
        os._exit(0)
    server = EngineServer(engine, ch, args, executor)
    t0 = time.perf_counter()
    ready = server.start_recording()
    ready.report["activate_s"] = round(time.perf_counter() - t0, 4)
    ch.send(ready)
    try:
        server.serve()
    except BaseException as exc:  # noqa: BLE001 - told to the front, then the process ends
        ch.send(Fatal(repr(exc)))
        sys.stderr.write(f"phoenixft engine {os.getpid()}: {exc!r}\n")
        os._exit(1)


if __name__ == "__main__":
    main()

"""The engine processes behind the HTTP front: one active, one warm standby (PHOENIX's spare,
applied to serving).

Both are `engine_proc` processes that load the model and pay their imports and first-call
costs at start. The active one serves and keeps the recovery log; the standby waits. When
the active one dies (seen at once through its pidfd), the standby is told to activate: it
replays the log and takes the crashed engine's requests over; a new standby is started
behind it. A standby that dies is replaced. If an engine cannot start at all (the model
does not load), the front reports it on /health and answers 503: nothing waits forever.

Timings go to the run directory's event log: `engine_crash` (detect_s), `engine_recovered`
(recover_s from detection to the new engine's ready, with the replay report).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .messages import Activate, Beat, EngineRole, Hello, Message, Ready
from .wire import Channel


@dataclass
class EngineProc:
    role: EngineRole
    popen: subprocess.Popen
    pidfd: int
    log: Path
    channel: Channel | None = None
    ready: Ready | None = None
    # set once the front has taken this engine over (caught its clients up from the log):
    # the engine's outputs are read only then, so none can overtake the catch-up
    settled: threading.Event = field(default_factory=threading.Event)
    heard: float = field(default_factory=time.monotonic)  # its last message (a Beat at least)

    @property
    def pid(self) -> int:
        return self.popen.pid


SOCK_PREFIX = "phoenixft-serve-"  # + the front's pid + "-": its engines' socket directory


SOCK_NAME = "engines.sock"
_SUN_PATH_MAX = 107  # a Unix socket's path is at most 108 bytes, NUL included


def _socket_base() -> str:
    """Where socket directories go: the temporary directory, or /tmp when its path is
    too long for a Unix socket's (a deep TMPDIR)."""
    base = tempfile.gettempdir()
    room = _SUN_PATH_MAX - len(f"/{SOCK_PREFIX}{os.getpid()}-xxxxxxxx/{SOCK_NAME}")
    return base if len(base.encode()) <= room else "/tmp"


def make_socket_dir() -> str:
    """A private directory for this front's engines' socket (its name starts with the
    front's pid, which `remove_stale_socket_dirs` reads)."""
    return tempfile.mkdtemp(prefix=f"{SOCK_PREFIX}{os.getpid()}-", dir=_socket_base())


def remove_stale_socket_dirs() -> list[str]:
    """Remove the socket directories of fronts that are gone (a SIGKILLed front cannot
    clean up after itself; its janitor normally has): those whose pid no longer exists
    and whose socket nobody listens on. Returns what was removed."""
    gone = []
    for d in Path(_socket_base()).glob(f"{SOCK_PREFIX}*-*"):
        pid = d.name[len(SOCK_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not d.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: not ours to remove)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _listening(d / SOCK_NAME):
            continue  # a front in another pid namespace that shares this directory
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            gone.append(str(d))
    return gone


def _listening(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:  # refused (nobody listens) or no socket there
        return False
    finally:
        probe.close()


def _last_line(path: Path) -> str:
    """The cause an engine that failed to start gave (the last line of its log)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip() if lines else "it wrote nothing"


class EngineSupervisor:
    def __init__(self, model_dir: str | Path, engine_config: dict, log_dir: str | Path,
                 work_dir: str | Path, *, threads: int | None = None,
                 on_message: Callable[[Message], None], on_ready: Callable[[Ready, dict], None],
                 emit: Callable[..., None], ring_bytes: int = 16 << 20,
                 compact_bytes: int = 256 << 20, sock_dir: str | None = None,
                 recovery: bool = True, hang_timeout_s: float = 5.0) -> None:
        # recovery off (`--no-recovery`): one engine, no recovery log, no standby; its crash
        # ends the requests in flight
        self.model_dir, self.engine_config = str(model_dir), engine_config
        self.log_dir, self.work_dir = Path(log_dir), Path(work_dir)  # log: outlives engines
        self.threads, self.ring_bytes, self.compact_bytes = threads, ring_bytes, compact_bytes
        self.recovery = recovery
        # an engine not heard from for this long (its heartbeat thread beats every BEAT_S)
        # is hung: SIGKILLed, so it is replaced like a dead one
        self.hang_timeout_s = hang_timeout_s
        self.on_message, self.on_ready, self.emit = on_message, on_ready, emit
        remove_stale_socket_dirs()
        self._sock_dir = sock_dir or make_socket_dir()
        self.sock_path = os.path.join(self._sock_dir, SOCK_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.sock_path)
        self._listener.listen(8)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.active: EngineProc | None = None
        self.standby: EngineProc | None = None
        self.crashes = 0
        self.error: str | None = None
        self._stopped = False
        self._pending_hello: dict[int, EngineProc] = {}
        self.on_change: Callable[[], None] = lambda: None  # e.g. rewrite status.json
        # no engine serves any more (`error` says why): fail the requests in flight
        self.on_lost: Callable[[str], None] = lambda error: None

    # -- processes -----------------------------------------------------------------------
    def _spawn(self, role: EngineRole) -> EngineProc:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "phoenixft.serve.server.engine_proc", "--socket", self.sock_path,
               "--model", self.model_dir, "--config", json.dumps(self.engine_config),
               "--log-dir", str(self.log_dir), "--role", role.value, "--parent", str(os.getpid()),
               "--ring-bytes", str(self.ring_bytes), "--compact-bytes", str(self.compact_bytes)]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if not self.recovery:
            cmd += ["--no-log"]
        log = logs / f"engine-{role}-{int(time.time() * 1000)}.log"
        with log.open("wb") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc = EngineProc(role, p, os.pidfd_open(p.pid), log)
        with self._lock:
            self._pending_hello[p.pid] = proc
        return proc

    def start(self, timeout_s: float = 300.0) -> Ready:
        """Start the active engine and its standby; returns the active one's `ready`
        (once: a second call returns the same)."""
        if self.active is not None:
            return self._await_ready(self.active, timeout_s)
        threading.Thread(target=self._accept, daemon=True, name="phoenixft-accept").start()
        self.active = self._spawn(EngineRole.ACTIVE)
        self.standby = self._spawn(EngineRole.STANDBY) if self.recovery else None
        threading.Thread(target=self._watch, daemon=True, name="phoenixft-engine-watch").start()
        ready = self._await_ready(self.active, timeout_s)
        try:
            self.on_ready(ready, {"recover_s": None})
        finally:
            self.active.settled.set()
        return ready

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            ch = Channel(conn)
            hello = ch.recv()
            if not isinstance(hello, Hello):
                ch.close()
                continue
            with self._lock:
                proc = self._pending_hello.pop(hello.pid, None)
            if proc is None:
                ch.close()
                continue
            proc.channel = ch
            threading.Thread(target=self._read, args=(proc,), daemon=True,
                             name=f"phoenixft-engine-{proc.pid}").start()
            with self._lock:
                self._ready.notify_all()
            if proc.role is EngineRole.STANDBY:
                self.emit("standby_ready", pid=proc.pid)
                self.on_change()

    def _read(self, proc: EngineProc) -> None:
        while True:
            msg = proc.channel.recv()
            if msg is None:
                return
            proc.heard = time.monotonic()
            if isinstance(msg, Beat):
                continue
            if isinstance(msg, Ready):
                with self._lock:
                    proc.ready = msg
                    self._ready.notify_all()
                while not proc.settled.wait(1.0):  # outputs wait for on_ready (see settled)
                    if self._stopped or proc.popen.poll() is not None:
                        return
                proc.heard = time.monotonic()  # (its beats were not read meanwhile)
                continue
            if proc is self.active:
                self.on_message(msg)

    def _await_ready(self, proc: EngineProc, timeout_s: float) -> Ready:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while proc.ready is None:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"the engine process exited with {proc.popen.returncode} "
                                       f"before it was ready: {_last_line(proc.log)} (its "
                                       f"log: {proc.log})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the engine process was not ready within {timeout_s:.0f}s; "
                                       f"see {proc.log}")
                self._ready.wait(min(left, 0.5))
            return proc.ready

    def _await_channel(self, proc: EngineProc, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while proc.channel is None:
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the standby engine never connected; see {proc.log}")
                self._ready.wait(0.5)

    # -- failures ------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopped:
            # (an engine whose exit was handled has no pidfd: selecting its closed one
            # raised EBADF and ended this thread)
            procs = [p for p in (self.active, self.standby) if p is not None and p.pidfd >= 0]
            self._kill_hung(procs)
            ready, _, _ = select.select([p.pidfd for p in procs], [], [], 0.5)
            for p in procs:
                if p.pidfd in ready:
                    p.popen.wait()
                    os.close(p.pidfd)
                    p.pidfd = -1
                    if self._stopped:
                        return
                    if p is self.active:
                        try:
                            self._failover(p)
                        except Exception as exc:  # noqa: BLE001 - the watcher must outlive it
                            self.emit("failover_error", pid=p.pid, error=repr(exc))
                    elif p is self.standby:
                        self.emit("standby_lost", pid=p.pid, rc=p.popen.returncode)
                        self.standby = self._spawn(EngineRole.STANDBY)

    def _kill_hung(self, procs: list[EngineProc]) -> None:
        """SIGKILL an engine whose heartbeat stood still for `hang_timeout_s` (a SIGSTOP,
        a wedged device): its exit is then seen like any other and the standby takes
        over. Only engines being read are judged: one connected, and an active one once
        the front took it over (`settled`; its beats wait unread before that)."""
        now = time.monotonic()
        for p in procs:
            if p.channel is None or (p is self.active and not p.settled.is_set()):
                continue
            silent = now - p.heard
            if silent > self.hang_timeout_s and p.popen.poll() is None:
                self.emit("engine_hung", pid=p.pid, role=p.role, silent_s=round(silent, 3))
                try:
                    p.popen.kill()
                except ProcessLookupError:
                    pass

    def _failover(self, dead: EngineProc) -> None:
        t_detect = time.time()
        self.crashes += 1
        rc = dead.popen.returncode
        self.emit("engine_crash", pid=dead.pid, rc=rc, crashes=self.crashes)
        standby = self.standby
        try:
            if standby is None:
                raise RuntimeError("no standby engine" if self.recovery else
                                   "serving with --no-recovery (no log, no standby)")
            self._await_channel(standby, 300.0)
            standby.channel.send(Activate())
            self.active, self.standby = standby, None
            ready = self._await_ready(standby, 300.0)
        except RuntimeError as exc:
            self.error = f"engine {dead.pid} died ({rc}) and no engine could take over: {exc}"
            self.emit("engine_lost", error=self.error)
            if standby is not None:
                standby.settled.set()
            self.on_lost(self.error)  # every request in flight ends now, with the error
            self.on_change()
            return
        recover_s = round(time.time() - t_detect, 4)
        self.emit("engine_recovered", pid=standby.pid, recover_s=recover_s,
                  activate_s=ready.report.get("activate_s"), report=ready.report)
        try:
            self.on_ready(ready, {"recover_s": recover_s})  # streams go on before anything else
        finally:  # a failing hook must not leave the job without its next standby
            standby.settled.set()
            self.standby = self._spawn(EngineRole.STANDBY)

    # -- commands ------------------------------------------------------------------------
    def send(self, msg: Message) -> bool:
        a = self.active
        return a is not None and a.channel is not None and a.channel.send(msg)

    def pids(self) -> dict:
        s = self.standby
        return {"engine_pid": self.active.pid if self.active else None,
                "standby_pid": s.pid if s else None,
                "standby_warm": s is not None and s.channel is not None}

    def stop(self) -> None:
        self._stopped = True
        for p in (self.active, self.standby):
            if p is not None and p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()
        self._listener.close()
        try:
            os.unlink(self.sock_path)
            os.rmdir(self._sock_dir)
        except OSError:
            pass

"""Start workers as forks of a process that has already imported torch and phoenixft.

Importing torch costs about 3 s of CPU per process on a small machine, so a node with N
workers and S spares spent (N + S) x 3 s starting, and every replacement worker another
3 s. With the default ``--start-method forkserver`` the agent starts one fork server per
node (``python -m phoenixft.launch.forkserver FD``) that imports torch, numpy and phoenixft's
training side once; each worker, spare and replacement is then a fork of it and reaches the
user's script in milliseconds, sharing the imported pages copy-on-write.

Why forking here is safe: the server never runs a torch operation, initialises no
accelerator (CUDA is initialised lazily, by the worker), opens no process group and starts
no thread of its own; the one thread numpy's BLAS may start handles fork itself. The worker
then runs exactly as ``python -m phoenixft.launch.worker SCRIPT ARGS`` would: its own
environment, working directory, log file, session and argv.

Process tree: the agent is a child subreaper (``PR_SET_CHILD_SUBREAPER``) and the server
forks twice, so each worker becomes the agent's own child: the agent waits on it and reads
its exit status as it would a ``subprocess.Popen`` child, and the worker's parent-death
signal is armed only once its parent is the agent. ``--start-method spawn`` starts each
worker as a fresh interpreter instead (a script that needs one, or a different Python).

Protocol (a ``SOCK_SEQPACKET`` socket pair, one datagram per message): the agent sends
``{"args", "env", "cwd"}`` with the worker's log file descriptor attached; the server
answers ``{"pid"}`` or ``{"error"}``. The server exits when the agent closes its end, and
dies with the agent.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback

from phoenixft.launch.config import LaunchError
from phoenixft.platform import become_subreaper, die_with_parent

# imported in this order, torch_internals.PRELOAD_MODULES between the two (read by the
# server: importing torch_internals here would import torch into `phoenixft run` before
# it has checked its arguments)
PRELOAD_TORCH = ("numpy", "torch", "torch.distributed", "torch.nn", "torch.optim")
PRELOAD_OURS = ("phoenixft.train.session", "phoenixft.launch.worker")
_MAX_MSG = 1 << 20


def worker_env_defaults(env: dict[str, str]) -> dict[str, str]:
    """What every worker's environment gets unless the user set it (the fork server's
    too, since libraries read some of it at import)."""
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store-wait timeouts are expected
    env["PYTHONUNBUFFERED"] = "1"
    return env


_SPAWN_HINT = "; --start-method spawn starts workers without it"


class ForkServerError(LaunchError):
    """The fork server cannot be used or refused a worker; the message names why and the
    way around it (its own output, an import error say, is on the agent's stderr)."""


class Forked:
    """A forked worker, waited on like a `subprocess.Popen` (it is the agent's child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is not None:
            try:
                fd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                fd = None
            if fd is not None:
                try:
                    if not select.select([fd], [], [], timeout)[0]:
                        raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
                finally:
                    os.close(fd)
        try:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped elsewhere: the status is lost
            self.returncode = -signal.SIGKILL
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkServer:
    """The agent's end: start the server, ask it for workers, close it."""

    def __init__(self, python: str, timeout_s: float) -> None:
        """Start the server (it imports in the background; the first `spawn` waits for it).
        Its own output (an import error, say) goes to the agent's stderr."""
        if not become_subreaper():
            raise ForkServerError("this kernel refused PR_SET_CHILD_SUBREAPER" + _SPAWN_HINT)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = worker_env_defaults(dict(os.environ))
        env["PHOENIXFT_AGENT_PID"] = str(os.getpid())
        self.proc = subprocess.Popen(
            [python, "-m", "phoenixft.launch.forkserver", str(theirs.fileno())], env=env,
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._sock.settimeout(timeout_s)

    def spawn(self, args: list[str], env: dict[str, str], cwd: str, log_fd: int) -> Forked:
        """A worker running `python -m phoenixft.launch.worker ARGS` (SCRIPT and its
        arguments) with this environment, working directory and log."""
        msg = json.dumps({"args": args, "env": env, "cwd": cwd}).encode()
        try:
            socket.send_fds(self._sock, [msg], [log_fd])
            data = self._sock.recv(_MAX_MSG)
        except (OSError, TimeoutError) as exc:
            raise ForkServerError(f"the fork server did not answer ({exc})"
                                  + _SPAWN_HINT) from None
        if not data:
            raise ForkServerError(f"the fork server exited (status {self.proc.poll()}; "
                                  "its output is above)" + _SPAWN_HINT)
        reply = json.loads(data)
        if "error" in reply:
            raise ForkServerError(f"the fork server could not start a worker: {reply['error']}"
                                  + _SPAWN_HINT)
        return Forked(reply["pid"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        self._sock.close()  # the server exits on EOF
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the server's side ----------------------------------------------------------------
def _become_worker(req: dict, log_fd: int, sock: socket.socket, agent: int, mid: int) -> None:
    """In the forked worker: wait to be the agent's child, then run as a fresh worker."""
    while os.getppid() == mid:  # our parent is exiting; the kernel reparents us to the agent
        time.sleep(0.0005)
    die_with_parent(agent)  # exits at once if the agent is gone already
    os.setsid()
    sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    from phoenixft.launch import worker
    sys.argv = [worker.__file__, *req["args"]]
    if "numpy" in sys.modules:  # numpy's global generator is not reseeded at fork
        sys.modules["numpy"].random.seed()
    worker.main()  # ends the process (os._exit)


def _fork_worker(req: dict, log_fd: int, sock: socket.socket, agent: int) -> int:
    r, w = os.pipe()
    mid = os.fork()
    if mid == 0:  # the intermediate: fork the worker, tell its pid, exit (orphaning it)
        code = 0
        try:
            os.close(r)
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                os.close(w)
                try:
                    _become_worker(req, log_fd, sock, agent, me)
                except BaseException:  # noqa: BLE001 - the worker's log says why
                    traceback.print_exc()
                    sys.stderr.flush()
                os._exit(1)
            os.write(w, str(pid).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(mid, 0)
    if not data:
        raise RuntimeError("the intermediate process failed to fork the worker")
    return int(data)


def serve(fd: int) -> None:
    agent = int(os.environ["PHOENIXFT_AGENT_PID"])
    die_with_parent(agent)
    sock = socket.socket(fileno=fd)
    import importlib

    from phoenixft.torch_internals import PRELOAD_MODULES  # (torch's, that a first
    # optimizer step imports: 2.8 s)
    for name in (*PRELOAD_TORCH, *PRELOAD_MODULES, *PRELOAD_OURS):
        importlib.import_module(name)
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, 1)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:
            os._exit(0)
        try:
            if len(fds) != 1:
                raise RuntimeError(f"expected the worker's log descriptor, got {len(fds)}")
            reply = {"pid": _fork_worker(json.loads(data), fds[0], sock, agent)}
        except Exception as exc:  # noqa: BLE001 - answered to the agent, which names it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for f in fds:
                os.close(f)
        sock.send(json.dumps(reply).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))

"""`python -m phoenixft.launch.worker SCRIPT [ARGS...]`: how an agent runs the user's script.

The script runs as ``__main__``, exactly as ``python SCRIPT ARGS`` would run it (its
directory first on ``sys.path``, ``sys.argv`` as given), or as ``python -m MODULE`` with
``PHOENIXFT_MODULE=1``. Around it this module:

- stops a script that builds its own process groups (``init_process_group``, DDP) at
  once, with one line saying what to change;
- makes the process die with its agent: the kernel sends SIGKILL when the agent exits
  (``PR_SET_PDEATHSIG``), so a killed agent leaves no orphan spinning on a dead store;
- reports the outcome to the job store before the process ends: an uncaught exception's
  traceback (`Keys.error`: the leader stops the job and shows it, since a spare would only
  raise it again), and the exit code (`Keys.exit`);
- ends with that exit code through ``os._exit`` once the script's ``atexit`` handlers
  have run: phoenixft's daemon threads may sit in C++ waits (a store wait, an abandoned
  gloo collective), and interpreter teardown under them can abort the process.
"""

from __future__ import annotations

import atexit
import errno
import os
import runpy
import sys
import traceback

from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.config import ConfigError
from phoenixft.faults.inject import InjectSpecError
from phoenixft.platform import die_with_parent

# what the user changes (flags, setup's arguments): one line, not our traceback
ONE_LINE = (ConfigError, InjectSpecError)


class _RoomlessTolerant:
    """A worker's sys.stdout / sys.stderr: a write its log's disk has no room for is
    dropped instead of raising into the user's training loop (a `print` on a full
    run-directory disk would otherwise stop the job). Other errors still raise."""

    NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

    def __init__(self, inner) -> None:
        self._inner = inner
        self.dropped = 0  # characters not written

    def write(self, s: str) -> int:
        try:
            return self._inner.write(s)
        except OSError as exc:
            if exc.errno not in self.NO_ROOM:
                raise
            self.dropped += len(s)
            return len(s)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as exc:
            if exc.errno not in self.NO_ROOM:
                raise

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def exit_code(code: object) -> int:
    """The process exit status Python gives `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


class ScriptNeedsChange(RuntimeError):
    """The script does something phoenixft does for it; the message says what to change."""


def refuse_own_process_groups() -> None:
    """Under `phoenixft run` the process groups are phoenixft's (rebuilt each generation):
    a script that builds its own would hang or collide with them, so it stops at once
    with one line saying what to change (docs/migrating.md)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    def init_process_group(*_a, **_k):
        raise ScriptNeedsChange(
            "this script calls torch.distributed.init_process_group(): under phoenixft run "
            "remove it (phoenixft builds the process groups, and rebuilds them after a "
            "failure) and drive the loop with phoenixft.Session: sess.setup(model, "
            "optimizer factory), for step in sess.steps(N), step.backward(loss); see "
            "docs/migrating.md")

    def ddp_init(self, *_a, **_k):
        raise ScriptNeedsChange(
            "this script wraps its model in DistributedDataParallel: under phoenixft run "
            "pass the plain model to sess.setup() (phoenixft reduces the gradients); see "
            "docs/migrating.md")

    init_process_group.__wrapped__ = dist.init_process_group  # phoenixft's own groups use it
    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group
    DistributedDataParallel.__init__ = ddp_init


def run_script(script: str, args: list[str], module: bool = False) -> tuple[int, str | None]:
    """Run `script` (a path, or a module name) as __main__; returns (exit code, traceback
    text of an uncaught exception or None)."""
    sys.argv = [script, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        if module:
            sys.path.insert(0, os.getcwd())  # as `python -m` does
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except (ScriptNeedsChange, *ONE_LINE) as exc:
        text = f"phoenixft: {exc}"
        print(text, file=sys.stderr)
        return 1, text
    except SystemExit as exc:
        return exit_code(exc.code), None
    except KeyboardInterrupt:
        return 130, None
    except BaseException:  # noqa: BLE001 - reported to the leader, then the process ends
        text = traceback.format_exc()
        sys.stderr.write(text)
        return 1, text
    return 0, None


def report(wid: str, store_addr: str, code: int, error: str | None) -> None:
    """Best effort: the store may be gone (then the agent reports the exit alone)."""
    try:
        store = kv.connect(store_addr, timeout_s=5)
        if error is not None:
            store.set(Keys.error(wid), error[-4000:])
        store.set(Keys.exit(wid), str(code))
    except Exception:
        pass


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m phoenixft.launch.worker SCRIPT [ARGS...]", file=sys.stderr)
        os._exit(2)
    env = os.environ
    if "PHOENIXFT_AGENT_PID" in env:
        die_with_parent(int(env["PHOENIXFT_AGENT_PID"]))
    if "PHOENIXFT_STORE" in env:
        refuse_own_process_groups()
        sys.stdout, sys.stderr = _RoomlessTolerant(sys.stdout), _RoomlessTolerant(sys.stderr)
    code, error = run_script(sys.argv[1], sys.argv[2:], module=env.get("PHOENIXFT_MODULE") == "1")
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a failing handler must not hide the outcome
        traceback.print_exc()
    if "PHOENIXFT_STORE" in env:
        report(env["PHOENIXFT_WORKER_ID"], env["PHOENIXFT_STORE"], code, error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

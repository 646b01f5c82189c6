"""The fork server: workers forked from one process that imported torch are the agent's
own children, run with their own environment, directory, argv and log, report their exit
status like a Popen child, and die with the agent. A driver process plays the agent (it
becomes a subreaper, which the test process itself should not)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

DRIVER = textwrap.dedent("""
    import json, os, sys
    from phoenixft.launch.forkserver import ForkServer
    out_dir, mode = sys.argv[1], sys.argv[2]
    server = ForkServer(sys.executable, 120)
    script = os.path.join(out_dir, "script.py")
    results = []
    for i, args in enumerate([["3"], ["kill"], ["sleep"]] if mode == "die" else [["3"], ["kill"]]):
        env = dict(os.environ, ROLE=f"w{i}", PHOENIXFT_AGENT_PID=str(os.getpid()))
        with open(os.path.join(out_dir, f"w{i}.log"), "wb") as log:
            p = server.spawn([script, *args], env, out_dir, log.fileno())
        if args == ["sleep"]:
            print(json.dumps({"sleeper": p.pid}), flush=True)
            os.read(0, 1)  # the test SIGKILLs us here
        results.append({"pid": p.pid, "rc": p.wait(timeout=120)})
    server.close()
    print(json.dumps({"results": results, "server_rc": server.proc.returncode}), flush=True)
""")

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch  # preloaded by the server: no second import
    info = {"argv": sys.argv[1:], "ppid": os.getppid(), "role": os.environ["ROLE"],
            "cwd": os.getcwd(), "session_leader": os.getsid(0) == os.getpid(),
            "threads": torch.get_num_threads()}
    print(json.dumps(info), flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "sleep":
        while True:
            time.sleep(1)
    sys.exit(int(sys.argv[1]))
""")


def _driver(tmp_path, mode: str) -> subprocess.Popen:
    (tmp_path / "script.py").write_text(SCRIPT)
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _log(tmp_path, i: int) -> dict:
    return json.loads((tmp_path / f"w{i}.log").read_text().splitlines()[0])


@pytest.mark.timeout(180)
def test_forked_workers_are_the_callers_children_with_their_own_setup(tmp_path):
    d = _driver(tmp_path, "exit")
    try:
        out, _ = d.communicate(timeout=150)
    finally:
        d.kill()
    assert d.returncode == 0, out
    done = json.loads(out.splitlines()[-1])
    [ok, killed] = done["results"]
    assert ok["rc"] == 3 and killed["rc"] == -signal.SIGKILL  # as Popen.returncode reads
    assert done["server_rc"] == 0  # it left when its socket closed
    for i, args in enumerate([["3"], ["kill"]]):
        info = _log(tmp_path, i)
        assert info["argv"] == args and info["role"] == f"w{i}"
        assert info["ppid"] == d.pid  # reparented to the driver, which waited on it
        assert info["cwd"] == str(tmp_path) and info["threads"] == 1
        assert info["session_leader"]  # its own session, as start_new_session gives


@pytest.mark.timeout(180)
def test_a_forked_worker_dies_with_its_agent(tmp_path):
    d = _driver(tmp_path, "die")
    try:
        line = d.stdout.readline()
        sleeper = json.loads(line)["sleeper"]
        deadline = time.monotonic() + 60
        while not (tmp_path / "w2.log").exists() or not (tmp_path / "w2.log").read_text():
            assert time.monotonic() < deadline, "the sleeping worker never started"
            time.sleep(0.05)
        worker = psutil.Process(sleeper)
        assert worker.ppid() == d.pid
        d.send_signal(signal.SIGKILL)
        d.wait(30)
        _, alive = psutil.wait_procs([worker], timeout=30)
        assert not alive, "the worker outlived its agent"
    finally:
        d.kill()
        try:
            psutil.Process(sleeper).kill()
        except (psutil.NoSuchProcess, NameError):
            pass

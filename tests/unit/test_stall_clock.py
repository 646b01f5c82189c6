"""The stall clock sees a process stopped with SIGSTOP, whole, and not a busy one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from phoenixft.train.stall_clock import StallClock

CHILD = r"""
import sys, time
from phoenixft.train.stall_clock import StallClock
clock = StallClock()
t0 = time.perf_counter()
print("ready", flush=True)
sys.stdin.readline()  # the parent stopped and continued this process meanwhile
print(clock.stalled_s(t0, time.perf_counter()), flush=True)
"""


@pytest.mark.timeout(60)
def test_a_process_stopped_with_sigstop_counts_the_stop_as_a_stall():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.3)  # the fault's length, not a wait for a state
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("\n")
        child.stdin.flush()
        stalled = float(child.stdout.readline())
        assert 0.25 <= stalled < 5.0, stalled
    finally:
        child.kill()
        child.wait()


def test_a_running_process_has_no_stalls():
    clock = StallClock()
    try:
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < 0.3:  # busy in Python: the GIL changes hands
            x += 1
        assert clock.stalled_s(t0, time.perf_counter()) == 0.0
    finally:
        clock.stop()


def test_a_tick_must_be_shorter_than_a_gap():
    with pytest.raises(ValueError, match="tick_s < gap_s"):
        StallClock(tick_s=0.1, gap_s=0.05)


FROZEN = r"""
import os, sys, time
from phoenixft.faults import freezer
from phoenixft.train.stall_clock import StallClock
clock = StallClock()
t0 = time.perf_counter()
helper = freezer.start(os.getpid(), 100, 200)
while clock.stalled_s(t0, time.perf_counter()) < 0.25:  # three stops or so
    time.sleep(0.01)
print(helper.pid, flush=True)
"""


@pytest.mark.timeout(60)
def test_the_freeze_faults_stops_are_stalls_and_its_helper_leaves_with_its_worker():
    """A worker that fired `freeze:...:ms=100:period=200` is stopped by its helper again
    and again (its stall clock adds them up), and the helper continues nothing and leaves
    once the worker is gone."""
    import psutil
    child = subprocess.run([sys.executable, "-c", FROZEN], capture_output=True, text=True,
                           timeout=50)
    assert child.returncode == 0, child.stderr
    helper = int(child.stdout.split()[0])
    try:
        psutil.Process(helper).wait(timeout=10)  # re-parented: it sees its worker gone
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(helper) or psutil.Process(helper).status() == "zombie"

"""`python -m phoenixft.launch.janitor AGENT_PID SHM_DIR`: cleans up after an agent that
could not clean up itself (SHM_DIR is the node's directory under the job's one).

An agent removes its node's shared memory when it ends, but a SIGKILLed agent (or a
killed process group) ends without running any code. So each agent starts this small
process in a session of its own (a signal to the agent's process group does not reach
it): it waits for the agent's exit through a pidfd, then removes SHM_DIR and exits. It
imports nothing heavy and holds nothing; the workers need no janitor, they die with the
agent by their parent-death signal.
"""

from __future__ import annotations

import os
import shutil
import sys

from phoenixft.platform import wait_for_exit


def main() -> None:
    agent_pid, shm_dir = int(sys.argv[1]), sys.argv[2]
    wait_for_exit(agent_pid)
    remove_node_shm(shm_dir)


def remove_node_shm(shm_dir: str) -> None:
    """Remove a node's directory, then the job's directory if no other node's is left in
    it (agents of several nodes may share one machine, and so one /dev/shm)."""
    shutil.rmtree(shm_dir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(shm_dir))
    except OSError:
        pass


if __name__ == "__main__":
    main()

"""The torchft side's process trees for `phoenixft bench torchft`: a lighthouse and a
replica group per member (`torchft_job`; with `--hsdp`, `TorchftHsdpRun`: a torchrun of
S FSDP2 ranks per group, `torchft_hsdp_job`), a SIGKILLed replica restarted at once."""

from __future__ import annotations

import os
import time
from pathlib import Path

from phoenixft.bench.faults import ProcessTree
from phoenixft.bench.goodput_jobs import ENV, Workload, fresh_run_dir
from phoenixft.bench.harness import ROOT
from phoenixft.platform import free_port


class TorchftRun:
    """A lighthouse and R replica groups, each its own process tree; a replica that dies is
    restarted at once (attempt + 1). Everything it started is SIGKILLed by PID at the end."""

    def __init__(self, python: str, run_dir: Path, work: Workload, *, kill_step: int | None,
                 heartbeat_timeout_s: float) -> None:
        self.python, self.run_dir, self.work = python, fresh_run_dir(run_dir), work
        self.kill_step, self.hb = kill_step, heartbeat_timeout_s
        self.env = {**ENV, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.trees: list[ProcessTree] = []
        self.restarts: list[dict] = []

    def _spawn(self, args: list[str], log: str) -> ProcessTree:
        tree = ProcessTree([self.python, "-m", "phoenixft.bench.torchft_job", *args],
                           log=self.run_dir / log, env=self.env)
        self.trees.append(tree)
        return tree

    def _replica(self, r: int, attempt: int, lighthouse: str) -> ProcessTree:
        w = self.work
        args = ["replica", "--replica", str(r), "--replicas", str(w.nproc), "--attempt",
                str(attempt), "--lighthouse", lighthouse, "--steps", str(w.steps),
                "--preset", w.preset, "--microbatches", str(w.microbatches),
                "--seed", str(w.seed), "--events", str(self.run_dir / "events.jsonl"),
                "--go-file", str(self.run_dir / "go"), "--timeout", str(max(10.0, 5 * self.hb))]
        if self.kill_step is not None and r == w.nproc - 1:
            args += ["--kill-at", str(self.kill_step)]
        return self._spawn(args, f"replica{r}.{attempt}.log")

    def run(self, timeout_s: float = 900) -> list[dict]:
        from phoenixft.observe.events import read_events

        addr_file = self.run_dir / "lighthouse.addr"
        lh = self._spawn(["lighthouse", "--addr-file", str(addr_file), "--heartbeat-timeout",
                          str(self.hb)], "lighthouse.log")
        deadline = time.monotonic() + timeout_s
        try:
            while not addr_file.exists():  # the lighthouse is up: a state, bounded
                self._check(lh, deadline, "lighthouse")
                time.sleep(0.05)
            addr = addr_file.read_text().strip()
            reps = {r: self._replica(r, 0, addr) for r in range(self.work.nproc)}
            attempts = dict.fromkeys(reps, 0)
            events = self.run_dir / "events.jsonl"
            while sum(e["event"] == "ready" for e in read_events(events)) < len(reps):
                for r, t in reps.items():
                    self._check(t, deadline, f"replica {r}")
                time.sleep(0.05)  # every group built its manager: start them together
            (self.run_dir / "go").touch()
            while True:
                done = {e["replica"] for e in read_events(events) if e["event"] == "done"}
                for r, tree in reps.items():
                    rc = tree.popen.poll()
                    if rc is None or r in done:
                        continue
                    if not self._killed(r, rc) or attempts[r] >= 1:
                        raise RuntimeError(f"torchft replica {r} exited with {rc}; see "
                                           f"{self.run_dir}/replica{r}.{attempts[r]}.log")
                    attempts[r] += 1  # SIGKILLed: restart it, as torchelastic would
                    self.restarts.append({"t": time.time(), "replica": r})
                    reps[r] = self._replica(r, attempts[r], addr)
                if len(done) == len(reps) and all(t.popen.poll() is not None for t in reps.values()):
                    return list(read_events(events))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"torchft job in {self.run_dir} ran past {timeout_s:.0f}s")
                time.sleep(0.05)  # polling process states, bounded
        finally:
            for t in self.trees:
                t.kill()

    def _killed(self, replica: int, rc: int) -> bool:
        """Whether replica group `replica` ended by the injected SIGKILL."""
        return rc == -9

    @staticmethod
    def _check(tree: ProcessTree, deadline: float, what: str) -> None:
        if tree.popen.poll() is not None:
            raise RuntimeError(f"torchft {what} exited with {tree.popen.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchft {what} never got ready")


class TorchftHsdpRun(TorchftRun):
    """HSDP: each replica group a torchrun of `shard` ranks (`torchft_hsdp_job`), on a
    loopback port of its own; a group whose rank was SIGKILLed (torchrun then stops the
    group and exits non-zero) is started again as a fresh torchrun on a new port, as
    torchelastic restarting the group would (torchrun's own --max-restarts restarts it in
    place, and then torchft 0.2.0's Manager can read the dead attempt's address from
    torchrun's store: the restarted group hangs in its first all-gather)."""

    def __init__(self, python: str, run_dir: Path, work: Workload, *, shard: int,
                 kill_step: int | None, heartbeat_timeout_s: float) -> None:
        super().__init__(python, run_dir, work, kill_step=kill_step,
                         heartbeat_timeout_s=heartbeat_timeout_s)
        self.shard = shard

    def _replica(self, r: int, attempt: int, lighthouse: str) -> ProcessTree:
        w = self.work
        args = ["--replica", str(r), "--attempt", str(attempt), "--lighthouse", lighthouse,
                "--steps", str(w.steps), "--preset", w.preset, "--seed", str(w.seed),
                "--events", str(self.run_dir / "events.jsonl"), "--go-file",
                str(self.run_dir / "go"), "--timeout", str(max(10.0, 5 * self.hb))]
        if self.kill_step is not None and r == w.nproc - 1:
            args += ["--kill-at", str(self.kill_step), "--kill-rank", str(self.shard - 1)]
        tree = ProcessTree([self.python, "-m", "torch.distributed.run", "--nproc-per-node",
                            str(self.shard), "--master-addr", "127.0.0.1", "--master-port",
                            str(free_port()), "-m", "phoenixft.bench.torchft_hsdp_job", *args],
                           log=self.run_dir / f"replica{r}.{attempt}.log", env=self.env)
        self.trees.append(tree)
        return tree

    def _killed(self, replica: int, rc: int) -> bool:
        from phoenixft.observe.events import read_events

        return rc != 0 and any(e["event"] == "inject" and e["replica"] == replica
                               and e["attempt"] == 0
                               for e in read_events(self.run_dir / "events.jsonl"))


"""The two kinds of job `phoenixft bench goodput` launches, as `faults.Job`s.

`PhoenixJob` runs `phoenixft run ... examples/train_gpt.py --data ids` and reads its run
directory (events.jsonl for steps, status.json for the PIDs of active workers).
`TorchrunJob` runs `torchrun --max-restarts R phoenixft/bench/torchrun_baseline.py` (or
the FSDP2 + dcp.async_save one, torchrun_fsdp_baseline.py) and
reads the baseline's own JSON-lines log; its workers are found among the torchrun
process's descendants by their command line and `RANK` environment variable.
Both bind 127.0.0.1 only and run 1 torch thread per worker.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from phoenixft.bench.faults import JsonlTail, ProcessTree, StepFault
from phoenixft.bench.harness import EXAMPLE
from phoenixft.observe.steps import StepEvent
from phoenixft.platform import free_port

BASELINE = Path(__file__).with_name("torchrun_baseline.py")
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


@dataclass(kw_only=True)
class Workload:
    """What every mode trains: same model, steps and microbatches per step."""

    preset: str
    steps: int
    microbatches: int
    nproc: int
    seed: int = 0

    def script_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--preset", self.preset, "--seed", str(self.seed),
                "--microbatches", str(self.microbatches), "--threads", "1"]


def fresh_run_dir(run_dir: Path) -> Path:
    """An empty run directory: stale events from an earlier run must not count."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return run_dir


@dataclass(kw_only=True)
class PhoenixJob:
    """`phoenixft run --nproc N [launcher flags] examples/train_gpt.py --data ids ...`."""

    run_dir: Path
    work: Workload
    launcher_args: list[str]
    script: Path = EXAMPLE
    script_extra: list[str] = field(default_factory=lambda: ["--data", "ids"])
    phase: str | None = None  # where in the step a fault fires (faults/inject.py); None: its start
    tree: ProcessTree | None = None
    events: list[dict] = field(default_factory=list)
    step_faults: list[StepFault] = field(default_factory=list)

    def argv(self) -> list[str]:
        where = f":phase={self.phase}" if self.phase else ""
        inject = [a for f in self.step_faults
                  for a in ("--inject", f"kill:rank={f.rank}:step={f.step}{where}")]
        return [sys.executable, "-m", "phoenixft.cli", "run", "--nproc", str(self.work.nproc),
                *self.launcher_args, *inject, "--quiet", "--run-dir", str(self.run_dir),
                str(self.script), *self.work.script_args(), *self.script_extra]

    def start(self, step_faults: list[StepFault]) -> ProcessTree:
        fresh_run_dir(self.run_dir)
        self.step_faults = list(step_faults)
        self._tail = JsonlTail(self.run_dir / "events.jsonl")
        self.tree = ProcessTree(self.argv(), log=self.run_dir / "launcher.log", env=ENV)
        return self.tree

    def injected(self) -> list[dict]:
        """The `--inject` faults that fired, from the workers' `inject` events."""
        return [{"t": e["t"], "rank": e["rank"], "pid": e["pid"], "step": e["step"] - 1,
                 "epoch": e.get("gen", 0), "world_size": e.get("world_size")}
                for e in self.events if e.get("event") == "inject"]

    def new_steps(self) -> list[StepEvent]:
        new = self._tail.read_new()
        self.events += new
        return [StepEvent(e["t"], e["step"], e.get("gen", 0), e.get("world_size", 0))
                for e in new if e.get("event") == "step"]

    def victims(self) -> dict[int, int]:
        try:
            status = json.loads((self.run_dir / "status.json").read_text())
        except (OSError, json.JSONDecodeError):  # not written yet, or mid-rename
            return {}
        return {m["rank"]: m["pid"] for m in status.get("members", [])
                if m.get("role") == "active" and m.get("state") == "running"
                and m.get("pid") and self.tree.owns(m["pid"])}

    def summary(self) -> dict:
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}


@dataclass(kw_only=True)
class TorchrunJob:
    """`torchrun --nproc-per-node N --max-restarts R torchrun_baseline.py ...` (DDP, gloo)."""

    run_dir: Path
    work: Workload
    max_restarts: int
    ckpt_every: int
    script: Path = BASELINE  # or torchrun_fsdp_baseline.py (FSDP2 + dcp.async_save)
    ckpt: str = "ckpt.pt"  # under run_dir: the baseline's --ckpt
    script_extra: list[str] = field(default_factory=list)  # e.g. --dp-shard for HSDP
    init: str = "per-attempt"  # see torchrun_baseline.init_process_group
    pg_timeout_s: float = 60.0
    port: int = field(default_factory=free_port)
    tree: ProcessTree | None = None
    events: list[dict] = field(default_factory=list)
    step_faults: list[StepFault] = field(default_factory=list)

    def argv(self) -> list[str]:
        # torchrun's default (static) rendezvous, its store on loopback at a free port.
        kills = [a for f in self.step_faults for a in ("--kill-at", f"{f.rank}:{f.step}")]
        return [sys.executable, "-m", "torch.distributed.run",
                "--nproc-per-node", str(self.work.nproc), "--max-restarts", str(self.max_restarts),
                "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                str(self.script), *self.work.script_args(), "--ckpt-every", str(self.ckpt_every),
                "--ckpt", str(self.run_dir / self.ckpt), "--events", str(self.run_dir / "events.jsonl"),
                "--init", self.init, "--pg-timeout", str(self.pg_timeout_s), *kills,
                *self.script_extra]

    def start(self, step_faults: list[StepFault]) -> ProcessTree:
        fresh_run_dir(self.run_dir)
        self.step_faults = list(step_faults)
        self._tail = JsonlTail(self.run_dir / "events.jsonl")
        self.tree = ProcessTree(self.argv(), log=self.run_dir / "torchrun.log", env=ENV)
        return self.tree

    def injected(self) -> list[dict]:
        """The `--kill-at` faults that fired, from the baseline's `inject` events."""
        return [{"t": e["t"], "rank": e["rank"], "pid": e["pid"], "step": e["step"] - 1,
                 "epoch": e["attempt"], "world_size": e["world_size"]}
                for e in self.events if e.get("event") == "inject"]

    def new_steps(self) -> list[StepEvent]:
        new = self._tail.read_new()
        self.events += new
        return [StepEvent(e["t"], e["step"], e["attempt"], e["world_size"])
                for e in new if e.get("event") == "step"]

    def victims(self) -> dict[int, int]:
        import psutil  # the bench extra (not at module level: the CLI imports this module)

        out = {}
        for p in self.tree.refresh():
            try:
                if self.script.name in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                    rank = p.environ().get("RANK")
                    if rank is not None:
                        out[int(rank)] = p.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def restart_report(self) -> dict:
        """Restart attempts seen, which of them never completed a step, and the gloo errors
        the workers printed (docs/notes.md: restarts often die on the dead worker's old port)."""
        attempts = sorted({e["attempt"] for e in self.events if e.get("event") == "start"})
        stepped = {e["attempt"] for e in self.events if e.get("event") == "step"}
        log = (self.run_dir / "torchrun.log").read_text(errors="replace") \
            if (self.run_dir / "torchrun.log").exists() else ""
        return {"attempts": attempts, "attempts_without_a_step": [a for a in attempts if a not in stepped],
                "connection_refused_lines": log.count("Connection refused"),
                "timeout_lines": log.count("timed out") + log.count("Timed out"),
                "checkpoints": sum(1 for e in self.events if e.get("event") == "checkpoint"),
                "resumed_from": [e["step"] for e in self.events
                                 if e.get("event") == "resumed" and e.get("rank") == 0]}

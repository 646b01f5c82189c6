"""Prometheus metrics of a training run, served by its node agent (`phoenixft run
--metrics-port P`, 127.0.0.1 unless `--metrics-host` says otherwise).

The figures come from the run's own record: each scrape reads the events appended to
`events.jsonl` since the last one and the agent's `status.json`, so the exporter needs no
hook in the training processes and shows exactly what the event log says.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from phoenixft.observe.steps import StepEvent, follows, from_events

_STEP = (.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_RECOVER = (.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 300)


class TrainMetrics(CollectorRegistry):
    """A registry that catches up with the run directory whenever it is collected."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.run_dir = Path(run_dir)
        self._pos = 0
        self._lock = threading.Lock()
        self._last_step: StepEvent | None = None
        self._gens_recovered: set[int] = set()
        self.steps = Counter("phoenixft_train_steps", "optimizer steps completed (steps redone "
                             "after a recovery count again)", registry=self)
        self.step = Gauge("phoenixft_train_step", "newest step completed", registry=self)
        self.step_time = Histogram("phoenixft_train_step_seconds", "wall time of one step",
                                   registry=self, buckets=_STEP)
        self.loss = Gauge("phoenixft_train_loss", "the newest step's loss", registry=self)
        self.failures = Counter("phoenixft_train_failures", "worker failures by kind",
                                ["kind"], registry=self)
        self.detect = Histogram("phoenixft_train_detect_seconds", "failure -> noticed",
                                registry=self, buckets=_RECOVER)
        self.recover = Histogram("phoenixft_train_recovery_seconds", "noticed -> training "
                                 "again (new membership, state restored)", registry=self,
                                 buckets=_RECOVER)
        self.lost = Counter("phoenixft_train_lost_steps", "steps computed again after "
                            "recoveries", registry=self)
        self.generation = Gauge("phoenixft_train_generation", "current generation",
                                registry=self)
        self.world = Gauge("phoenixft_train_world_size", "active ranks", registry=self)
        self.spares = Gauge("phoenixft_train_spares_available", "warm spares waiting",
                            registry=self)
        self.snap_bytes = Gauge("phoenixft_train_snapshot_bytes", "host memory of one rank's "
                                "snapshots and the replicas it holds", registry=self)
        self.committed = Gauge("phoenixft_train_committed_step", "newest step whose snapshot "
                               "is committed (every rank's copy and replica)", registry=self)
        self.snap_copy = Counter("phoenixft_train_snapshot_copy_seconds", "snapshot copy "
                                 "time, summed over ranks (reported when a rank finishes)",
                                 registry=self)
        self.replicate = Counter("phoenixft_train_replication_seconds", "replication time, "
                                 "summed over ranks (reported when a rank finishes)",
                                 registry=self)
        self.persisted = Gauge("phoenixft_train_persisted_step", "newest step durable in "
                               "persistent storage (-1: none)", registry=self)
        self.persisted.set(-1)
        self.quarantined = Gauge("phoenixft_train_quarantined_workers", "workers replaced as "
                                 "stragglers or for silent data corruption (never re-admitted)",
                                 registry=self)

    def collect(self):
        self.refresh()
        yield from super().collect()

    def refresh(self) -> None:
        with self._lock:
            path = self.run_dir / "events.jsonl"
            if path.exists():
                with path.open("rb") as f:
                    f.seek(self._pos)
                    data = f.read()
                end = data.rfind(b"\n") + 1  # a line being written waits for the next scrape
                self._pos += end
                for line in data[:end].splitlines():
                    try:
                        self.feed(json.loads(line))
                    except (ValueError, KeyError, TypeError):
                        continue
            self._status()

    def _status(self) -> None:
        try:
            st = json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return
        if st.get("committed_step") is not None:
            self.committed.set(st["committed_step"])
        self.quarantined.set(len(st.get("quarantined", [])))
        members = st.get("members", [])
        self.spares.set(sum(1 for m in members if m.get("role") == "spare"
                            and m.get("state") not in ("exited", "dead")))

    def feed(self, e: dict) -> None:
        kind = e["event"]
        if kind == "step":
            self.steps.inc()
            self.step.set(e["step"])
            self.loss.set(e["loss"])
            step = from_events([e])[0]
            last = self._last_step
            if last is not None and follows(last, step):
                self.step_time.observe(step.t - last.t)
            self._last_step = step
            if "world_size" in e:
                self.world.set(e["world_size"])
        elif kind == "failure":
            self.failures.labels(e.get("kind", "unknown")).inc()
            if e.get("detect_s") is not None:
                self.detect.observe(e["detect_s"])
        elif kind == "recovered" and e.get("gen") not in self._gens_recovered:
            self._gens_recovered.add(e.get("gen"))  # one record per recovery, not per rank
            self.recover.observe(e.get("recover_s", 0.0))
            self.lost.inc(e.get("lost_steps", 0))
        elif kind == "generation":
            self.generation.set(e["gen"])
            if e.get("kind") == "run":
                self.world.set(e.get("world_size", 0))
        elif kind == "snapshot_size":
            self.snap_bytes.set(e.get("host_bytes_per_rank", 0))
        elif kind == "snapshot_stats":
            self.snap_copy.inc(e.get("copy_s", 0.0))
            self.replicate.inc(e.get("replicate_s", 0.0))
        elif kind == "persisted":
            self.persisted.set(e["step"])


def serve_metrics(run_dir: str | Path, host: str, port: int):
    """Start the exporter; returns (server, registry). The caller shuts the server down."""
    from prometheus_client import start_http_server

    reg = TrainMetrics(run_dir)
    server, _thread = start_http_server(port, addr=host, registry=reg)
    return server, reg

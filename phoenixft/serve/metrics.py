"""The server's Prometheus metrics: one registry per app (no process-global state),
updated by the handlers and, after each step, by the engine thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("phoenixft_requests", "finished requests by endpoint and "
                                "outcome", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("phoenixft_prompt_tokens", "prompt tokens", registry=r)
        self.gen_tokens = Counter("phoenixft_generation_tokens", "generated tokens",
                                  registry=r)
        self.ttft = Histogram("phoenixft_time_to_first_token_seconds", "time to first token",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.running = Gauge("phoenixft_running_requests", "running sequences", registry=r)
        self.waiting = Gauge("phoenixft_waiting_requests", "waiting sequences", registry=r)
        self.kv_usage = Gauge("phoenixft_kv_cache_usage_ratio", "share of KV blocks in use",
                              registry=r)
        self.preemptions = Gauge("phoenixft_preemptions", "preemptions so far", registry=r)
        self.crashes = Gauge("phoenixft_engine_crashes", "engine processes that died (each "
                             "replaced by the standby)", registry=r)
        self.recomputed = Gauge("phoenixft_prompt_tokens_recomputed", "prompt tokens computed "
                                "again after a crash (0: every prompt's KV came from the log)",
                                registry=r)
        self.log_bytes = Gauge("phoenixft_recovery_log_bytes", "bytes the active engine wrote "
                               "to its recovery log", registry=r)

    def update(self, backend) -> None:
        """Gauges from the front's latest view of the active engine."""
        st = backend.stats
        self.running.set(st.get("running", 0))
        self.waiting.set(st.get("waiting", 0))
        self.kv_usage.set(st.get("kv_usage", 0.0))
        self.preemptions.set(st.get("preemptions", 0))
        log = st.get("log") or {}
        self.log_bytes.set(log.get("log_bytes", 0))
        self.recomputed.set(backend.recomputed_prompt_tokens)
        if backend.supervisor is not None:
            self.crashes.set(backend.supervisor.crashes)

"""The server's Prometheus metrics: one registry per app (no process-global state).

Names, types and labels follow vLLM's (`vllm:` prefix, counters ending in `_total`, a
`model_name` label), so dashboards and alerts written for vLLM read phoenixft unchanged.
What only phoenixft has (engine crashes, prompt tokens recomputed after one, the recovery
log) is under `phoenixft_`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (.01, .025, .05, .1, .25, .5, .75, 1, 2.5, 5, 10, 20, 40, 80)
_PER_TOKEN = (.001, .005, .01, .02, .04, .06, .08, .1, .15, .2, .3, .4, .5, .75, 1, 2.5)


class ServeMetrics:
    def __init__(self, model_name: str = "model") -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]
        self.success = Counter("vllm:request_success", "finished requests by finish reason",
                               [*m, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens", m, registry=r)
        self.gen_tokens = Counter("vllm:generation_tokens", "generated tokens", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "time to first token", m,
                              registry=r, buckets=_LATENCY)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "time per output token "
                              "after the first", m, registry=r, buckets=_PER_TOKEN)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "end-to-end request latency",
                             m, registry=r, buckets=_LATENCY)
        self.running = Gauge("vllm:num_requests_running", "running sequences", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting sequences", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "share of KV blocks in use (0-1)",
                              m, registry=r)
        self.preemptions = Gauge("vllm:num_preemptions", "preemptions so far", m, registry=r)
        self.requests = Counter("phoenixft_requests", "finished requests by endpoint and "
                                "outcome", [*m, "endpoint", "outcome"], registry=r)
        self.crashes = Gauge("phoenixft_engine_crashes", "engine processes that died (each "
                             "replaced by the standby)", m, registry=r)
        self.recomputed = Gauge("phoenixft_prompt_tokens_recomputed", "prompt tokens computed "
                                "again after a crash (0: every prompt's KV came from the log)",
                                m, registry=r)
        self.log_bytes = Gauge("phoenixft_recovery_log_bytes", "bytes the active engine wrote "
                               "to its recovery log", m, registry=r)
        self.log_epochs = Gauge("phoenixft_recovery_log_epochs", "epochs the active engine's "
                                "log executor has committed (what a crash now would resume)",
                                m, registry=r)

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(self.model_name, endpoint, outcome).inc()

    def finished(self, endpoint: str, last, t_arrival: float, t_first: float | None,
                 t_end: float) -> None:
        """One choice finished: counters and latencies (monotonic times)."""
        name = self.model_name
        self.outcome(endpoint, "ok")
        self.success.labels(name, last.finish_reason or "abort").inc()
        self.prompt_tokens.labels(name).inc(last.num_prompt_tokens)
        self.gen_tokens.labels(name).inc(last.num_completion_tokens)
        self.e2e.labels(name).observe(t_end - t_arrival)
        if t_first is not None:
            self.ttft.labels(name).observe(t_first - t_arrival)
            if last.num_completion_tokens > 1:
                self.tpot.labels(name).observe((t_end - t_first) / (last.num_completion_tokens - 1))

    def update(self, backend) -> None:
        """Gauges from the front's latest view of the active engine."""
        st, name = backend.stats, self.model_name
        self.running.labels(name).set(st.get("running", 0))
        self.waiting.labels(name).set(st.get("waiting", 0))
        self.kv_usage.labels(name).set(st.get("kv_usage", 0.0))
        self.preemptions.labels(name).set(st.get("preemptions", 0))
        log = st.get("log") or {}
        self.log_bytes.labels(name).set(log.get("log_bytes", 0))
        self.log_epochs.labels(name).set(log.get("epochs", 0))
        self.recomputed.labels(name).set(backend.recomputed_prompt_tokens)
        if backend.supervisor is not None:
            self.crashes.labels(name).set(backend.supervisor.crashes)

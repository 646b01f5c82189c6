"""The server's Prometheus metrics: one registry per app (no process-global state),
updated by the handlers and, after each step, by the engine thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .engine import LLMEngine


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
        self.step_failures = Counter("phoenixft_engine_step_failures", "engine steps that "
                                     "raised (their requests failed, serving went on)",
                                     registry=r)

    def on_step(self, engine: LLMEngine) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(engine.block_manager.usage)
        self.preemptions.set(engine.scheduler.num_preemptions)

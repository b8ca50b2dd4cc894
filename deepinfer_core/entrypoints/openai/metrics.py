"""Prometheus metrics of the server: requests, tokens, TTFT, time per output token, end-to-end latency,
queue length, KV cache usage, prefix-cache hits and, when the engine speculates, its drafts (vLLM's
``spec_decode_*`` counters). Each app has its own registry."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, async_llm: Any, model_name: str):
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.requests = Counter("deepinfer_requests", "HTTP API requests by route and status code",
                                ["route", "code"], registry=registry)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "generated tokens of finished requests",
                                         registry=registry)
        self.finished = Counter("deepinfer_request_finished", "engine requests by how they ended",
                                ["finish_reason"], registry=registry)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds",
                              "mean time between generated tokens after the first", buckets=_LATENCY_BUCKETS,
                              registry=registry)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        gauges = {
            "deepinfer_num_requests_running": ("requests that have produced output and are not finished",
                                               lambda: async_llm.num_running),
            "deepinfer_num_requests_waiting": ("requests queued that have produced no output yet",
                                               lambda: async_llm.num_pending - async_llm.num_running),
            "deepinfer_kv_cache_usage_ratio": ("fraction of KV cache blocks in use (0 when idle)",
                                               lambda: async_llm.stats.get("kv_cache_usage", 0.0)),
            "deepinfer_prefix_cache_query_tokens": ("prompt tokens looked up in the prefix cache",
                                                    lambda: async_llm.stats.get("prefix_cache_query_tokens", 0.0)),
            "deepinfer_prefix_cache_hit_tokens": ("prompt tokens served from the prefix cache",
                                                  lambda: async_llm.stats.get("prefix_cache_hit_tokens", 0.0)),
            "deepinfer_prefix_cache_hit_rate": ("hit tokens over query tokens",
                                                lambda: async_llm.stats.get("prefix_cache_hit_rate", 0.0)),
            "deepinfer_engine_steps": ("engine steps run", lambda: async_llm.num_steps),
            "deepinfer_engine_step_failures": ("engine steps that raised", lambda: async_llm.num_step_failures),
        }
        for name, (doc, fn) in gauges.items():
            g = Gauge(name, doc, list(labels), registry=registry)
            g.labels(**labels).set_function(fn)
        registry.register(_SpecDecodeCollector(async_llm, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class _SpecDecodeCollector:
    """The engine's speculative decoding counters as the engine thread last read them (nothing when it does
    not speculate)."""

    COUNTERS = (
        ("num_drafts", "verifications: a sequence's step that verified at least one draft"),
        ("num_draft_tokens", "drafts verified"),
        ("num_accepted_tokens", "drafts accepted"),
        ("num_proposed_tokens", "drafts the drafter proposed, verified or not"),
    )

    def __init__(self, async_llm: Any, model_name: str):
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self):
        stats = self.async_llm.spec_decode_stats
        if stats is None:
            return
        for key, doc in self.COUNTERS:
            family = CounterMetricFamily(f"deepinfer_spec_decode_{key}", doc, labels=["model_name"])
            family.add_metric([self.model_name], stats[key])
            yield family
        per_pos = CounterMetricFamily("deepinfer_spec_decode_num_accepted_tokens_per_pos",
                                      "drafts accepted by their position in the verification (0: the first)",
                                      labels=["model_name", "position"])
        for position, count in enumerate(stats["accepted_per_position"]):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos


class RequestTracker:
    """Timing of one engine request, fed with each of its outputs."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.done = False

    def observe(self, out: Any) -> None:
        now = time.monotonic()
        num = max((len(c.token_ids) for c in out.outputs), default=0)
        if self.first is None and num:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        if out.finished and not self.done:
            self.done = True
            m = self.metrics
            m.e2e.observe(now - self.arrival)
            if self.first is not None and num > 1:
                m.tpot.observe((now - self.first) / (num - 1))
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            m.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
            for c in out.outputs:
                m.finished.labels(str(c.finish_reason)).inc()

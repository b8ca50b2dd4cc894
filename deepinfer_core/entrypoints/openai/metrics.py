"""Prometheus metrics of the server: HTTP requests by route template and status code; the engine's requests
(tokens, how they ended, aborted ones included), TTFT, time per output token, end-to-end latency, queue
length, KV cache usage, prefix-cache hits and, when the engine speculates, its drafts.

Each figure is exposed under our ``deepinfer_`` name and, where vLLM has the same figure, under vLLM's
``vllm:`` name with vLLM's labels (``model_name``, ``engine``) and buckets, so that dashboards made for
vLLM read this server as they are. Each app has its own registry."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
# vLLM's buckets, so that its dashboards' quantiles mean the same
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
_VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0)
VLLM_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values (its request_success labels)


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, async_llm: Any, model_name: str, max_model_len: int | None = None):
        self.registry = registry = CollectorRegistry()
        self.async_llm = async_llm
        labels = {"model_name": model_name}
        vllm = (model_name, "0")  # the values of VLLM_LABELS: one engine
        self.requests = Counter("deepinfer_requests", "HTTP requests by route template and status code",
                                ["route", "code"], registry=registry)
        self.finished: collections.Counter[str] = collections.Counter()  # engine requests by finish reason
        token_buckets = _one_two_five(max_model_len or 1 << 20)

        def counter(name: str, vllm_name: str, doc: str) -> tuple[Any, Any]:
            return (Counter(name, doc, registry=registry),
                    Counter(vllm_name, doc, VLLM_LABELS, registry=registry).labels(*vllm))

        def histogram(name: str | None, vllm_name: str, doc: str, vllm_buckets: Any) -> tuple[Any, ...]:
            ours = (Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=registry),) if name else ()
            theirs = Histogram(vllm_name, doc, VLLM_LABELS, buckets=vllm_buckets, registry=registry)
            return (*ours, theirs.labels(*vllm))

        self.prompt_tokens = counter("deepinfer_prompt_tokens", "vllm:prompt_tokens",
                                     "prompt tokens of the requests that started")
        self.generation_tokens = counter("deepinfer_generation_tokens", "vllm:generation_tokens",
                                         "tokens generated (by finished and aborted requests alike)")
        self.ttft = histogram("deepinfer_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                              "arrival to the first generated token", _VLLM_TTFT_BUCKETS)
        self.tpot = histogram("deepinfer_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                              "a request's mean time between generated tokens after the first", _VLLM_TPOT_BUCKETS)
        self.e2e = histogram("deepinfer_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                             "arrival to the last token", _VLLM_E2E_BUCKETS)
        self.request_prompt_tokens = histogram(None, "vllm:request_prompt_tokens", "prompt tokens of a finished "
                                               "request", token_buckets)
        self.request_generation_tokens = histogram(None, "vllm:request_generation_tokens",
                                                   "tokens a finished request generated", token_buckets)
        running, waiting = (lambda: async_llm.num_running), (lambda: async_llm.num_pending - async_llm.num_running)
        kv_usage = lambda: async_llm.stats.get("kv_cache_usage", 0.0)  # noqa: E731
        gauges = {
            "deepinfer_num_requests_running": ("requests that have produced output and are not finished", running),
            "deepinfer_num_requests_waiting": ("requests queued that have produced no output yet", waiting),
            "deepinfer_kv_cache_usage_ratio": ("fraction of KV cache blocks in use (0 when idle)", kv_usage),
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
            Gauge(name, doc, list(labels), registry=registry).labels(**labels).set_function(fn)
        pools = Gauge("deepinfer_cache_pool_usage_ratio", "fraction of a cache pool in use (0 when idle): compressed "
                      "KV blocks, sliding-window blocks, compressor state slots", [*labels, "pool"], registry=registry)
        for pool in ("compressed", "window", "state"):
            pools.labels(**labels, pool=pool).set_function(lambda p=pool: async_llm.stats.get(f"{p}_pool_usage", 0.0))
        vllm_gauges = {
            "vllm:num_requests_running": ("requests that have produced output and are not finished", running),
            "vllm:num_requests_waiting": ("requests queued that have produced no output yet", waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage; 1 means 100 percent", kv_usage),
            "vllm:gpu_cache_usage_perc": ("KV-cache usage; 1 means 100 percent (vLLM's older name)", kv_usage),
        }
        for name, (doc, fn) in vllm_gauges.items():
            Gauge(name, doc, VLLM_LABELS, registry=registry).labels(*vllm).set_function(fn)
        registry.register(_EngineCountersCollector(self, model_name))
        registry.register(_SpecDecodeCollector(async_llm, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class _EngineCountersCollector:
    """Counters kept outside prometheus_client's: requests by how they ended (the trackers' finished ones
    plus those the engine front counted as aborted, which never report a finished output) and the prefix
    cache's token counts (the engine's own running totals)."""

    def __init__(self, metrics: ServerMetrics, model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def collect(self) -> Iterator[Metric]:
        async_llm = self.metrics.async_llm
        ended = collections.Counter(self.metrics.finished)
        ended["abort"] += async_llm.num_aborted
        ours = CounterMetricFamily("deepinfer_request_finished", "engine requests by how they ended",
                                   labels=["finish_reason"])
        theirs = CounterMetricFamily("vllm:request_success", "engine requests by how they ended",
                                     labels=[*VLLM_LABELS, "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(ended)):
            ours.add_metric([reason], ended[reason])
            theirs.add_metric([self.model_name, "0", reason], ended[reason])
        yield ours
        yield theirs
        for key, name, doc in (("query", "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
                               ("hit", "vllm:prefix_cache_hits", "prompt tokens served from the prefix cache")):
            family = CounterMetricFamily(name, doc, labels=list(VLLM_LABELS))
            family.add_metric([self.model_name, "0"], async_llm.stats.get(f"prefix_cache_{key}_tokens", 0.0))
            yield family


class _SpecDecodeCollector:
    """The engine's speculative decoding counters as the engine thread last read them (nothing when it does
    not speculate), under our names and vLLM's."""

    COUNTERS = (
        ("num_drafts", "verifications: a sequence's step that verified at least one draft"),
        ("num_draft_tokens", "drafts verified"),
        ("num_accepted_tokens", "drafts accepted"),
        ("num_proposed_tokens", "drafts the drafter proposed, verified or not"),
    )
    PER_POS = "drafts accepted by their position in the verification (0: the first)"

    def __init__(self, async_llm: Any, model_name: str):
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.async_llm.spec_decode_stats
        if stats is None:
            return
        for prefix, labels in (("deepinfer_spec_decode_", [self.model_name]),
                               ("vllm:spec_decode_", [self.model_name, "0"])):
            names = ["model_name", "engine"][: len(labels)]
            for key, doc in self.COUNTERS:
                family = CounterMetricFamily(prefix + key, doc, labels=names)
                family.add_metric(labels, stats[key])
                yield family
            per_pos = CounterMetricFamily(prefix + "num_accepted_tokens_per_pos", self.PER_POS,
                                          labels=[*names, "position"])
            for position, count in enumerate(stats["accepted_per_position"]):
                per_pos.add_metric([*labels, str(position)], count)
            yield per_pos


class RequestTracker:
    """Timing and tokens of one engine request, fed with each of its (cumulative) outputs: tokens are counted
    as they come, so an aborted request's count too; latencies and the finish reason once it finishes."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.started = False  # its prompt tokens are counted
        self.num_generated = 0  # tokens already counted
        self.done = False

    def observe(self, out: Any) -> None:
        if self.done:
            return
        now, m = time.monotonic(), self.metrics
        if not self.started:
            self.started = True
            _inc(m.prompt_tokens, len(out.prompt_token_ids))
        generated = sum(len(c.token_ids) for c in out.outputs)
        _inc(m.generation_tokens, generated - self.num_generated)
        self.num_generated = generated
        num = max((len(c.token_ids) for c in out.outputs), default=0)
        if self.first is None and num:
            self.first = now
            _observe(m.ttft, now - self.arrival)
        if not out.finished:
            return
        self.done = True
        _observe(m.e2e, now - self.arrival)
        if self.first is not None and num > 1:
            _observe(m.tpot, (now - self.first) / (num - 1))
        _observe(m.request_prompt_tokens, len(out.prompt_token_ids))
        _observe(m.request_generation_tokens, generated)
        for c in out.outputs:
            m.finished[str(c.finish_reason)] += 1


def _inc(counters: tuple[Any, ...], amount: float) -> None:
    for c in counters:
        c.inc(amount)


def _observe(histograms: tuple[Any, ...], value: float) -> None:
    for h in histograms:
        h.observe(value)

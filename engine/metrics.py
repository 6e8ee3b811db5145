"""Prometheus metrics with vLLM's names (design.md §4), label ``model_name``, in a per-app ``CollectorRegistry``.

Two sources:
- ``EngineStats`` snapshots (gauges, the engine's cumulative counters and ``vllm:iteration_tokens_total``, its
  steps by tokens computed), read at scrape time by a custom collector, so the exported counters equal the
  engine's own totals.
- ``RequestOutput``s observed after every step (on the engine thread): per-request latencies (TTFT, ITL, e2e,
  queue, prefill, decode and inference time, time per output token; all in seconds), prompt and generation token
  counts and ``vllm:request_success_total{finished_reason}``, per completion of n (vLLM V1 runs each completion as a
  request of its own), and per request its ``n``, its ``max_tokens`` (the one in force, as vLLM's server sets it
  where the request has none) and its completions' most generated tokens.

``vllm:iteration_tokens_total`` counts the tokens each step computes (every prefill chunk in its own step, prefix-cache
hits left out, steps that compute none left out), where vLLM V1 adds up each iteration's prompt and generation tokens.

"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                            InfoMetricFamily, Metric)
from prometheus_client.registry import Collector

from engine.config import DEFAULT_MAX_MODEL_LEN
from engine.outputs import RequestOutput
from engine.stats import EngineStats, TokenHistogram

disable_created_metrics()  # no `*_created` series, as in vLLM (process-wide setting of prometheus_client)

#: the finish reasons whose ``vllm:request_success_total`` series exist (at 0) before any request finishes
FINISH_REASONS = ("stop", "length", "abort")

# vLLM's bucket boundaries (seconds), so existing dashboards' quantiles line up.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
N_BUCKETS = [1, 2, 5, 10, 20]


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets of token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10

# (name without _total, help, EngineStats attribute) of the engine's cumulative counters.
_STATS_COUNTERS = [
    ("vllm:prompt_tokens", "Prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Generation tokens produced.", "generation_tokens_total"),
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions_total"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", "prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_hits_total"),
]
_STATS_GAUGES = [
    ("vllm:num_requests_running", "Requests in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = every block used).", "kv_cache_usage"),
]


class _StatsCollector(Collector):
    """Exports the latest ``EngineStats`` snapshot at scrape time (zeros before the engine is loaded)."""

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats | None], cache_config: dict):
        self._model = model_name
        self._stats_fn = stats_fn
        self._cache_config = cache_config

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        for name, doc, attr in _STATS_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(getattr(stats, attr, 0) or 0))
            yield family
        for name, doc, attr in _STATS_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], float(getattr(stats, attr, 0) or 0))
            yield family
        yield self._iteration_tokens(stats.iteration_tokens if stats is not None else TokenHistogram())
        if stats is not None:
            info = {"block_size": str(stats.block_size), "num_gpu_blocks": str(stats.num_blocks),
                    **{k: str(v) for k, v in self._cache_config.items()}}
            yield InfoMetricFamily("vllm:cache_config", "Information of the KV cache.", value=info)

    def _iteration_tokens(self, hist: TokenHistogram) -> HistogramMetricFamily:
        """``vllm:iteration_tokens_total``: the engine's steps by the tokens each computed (cumulative buckets)."""
        family = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine step.",
                                       labels=["model_name"])
        total, buckets = 0, []
        for bound, count in zip((*map(float, hist.bounds), "+Inf"), hist.counts):
            total += count
            buckets.append((str(bound), total))
        family.add_metric([self._model], buckets, sum_value=hist.sum)
        return family


class EngineMetrics:
    """All of one server's collectors. ``observe`` is thread-safe (called on the engine thread)."""

    def __init__(self, model_name: str, stats_fn: Callable[[], EngineStats | None],
                 cache_config: dict | None = None, registry: CollectorRegistry | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self.registry.register(_StatsCollector(model_name, stats_fn, dict(cache_config or {})))
        labels = ["model_name"]
        kw = {"labelnames": labels, "registry": self.registry}
        self.request_success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                       labelnames=labels + ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM: a dashboard's rate() reads 0, not "no data"
            self.request_success.labels(model_name, reason)
        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, buckets=buckets, **kw).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                     REQUEST_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.",
                                        REQUEST_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Decode time / (generation tokens - 1), per request (0 for one token).", ITL_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of a finished request.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Tokens a finished request generated.",
                                           tokens)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Most tokens generated by one of a request's n completions.", tokens)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                                           tokens)
        #: (request_id, completion index) -> (tokens so far, time of its last token, finished, time of its first)
        self._progress: dict[tuple[str, int], tuple[int, float, bool, float]] = {}
        self._lock = threading.Lock()

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Record one engine step's outputs, per completion (vLLM V1 runs each of n as a request of its own): TTFT at
        its first token (also of one aborted later, as vLLM V1), an ITL sample each time it advanced; when it
        finishes ``request_success``, and e2e latency, queue, prefill, decode and inference time, time per output
        token, prompt and generation tokens (queue time is the request's first scheduling: the completions of one
        request are admitted together); an aborted completion (finish reason "abort", or none when its request
        ends) counts in ``request_success`` only. A request that finishes with a completion not aborted adds its
        ``n``, its ``max_tokens`` and its completions' most generated tokens (vLLM's parent request)."""
        now = time.monotonic()
        with self._lock:
            for out in outputs:
                t = (out.metrics.last_token_time if out.metrics else None) or now
                for c in out.outputs:
                    self._observe_completion(out, c, t)
                if out.finished:
                    for c in out.outputs:
                        if not self._progress.pop((out.request_id, c.index), (0, 0.0, False, 0.0))[2]:
                            self.request_success.labels(self.model_name, "abort").inc()
                    if not out.outputs:
                        self.request_success.labels(self.model_name, "abort").inc()
                    elif any(c.finish_reason not in (None, "abort") for c in out.outputs):
                        self.params_n.observe(len(out.outputs))
                        self.max_generation_tokens.observe(max(len(c.token_ids) for c in out.outputs))
                        if out.metrics is not None and out.metrics.max_tokens is not None:
                            self.params_max_tokens.observe(out.metrics.max_tokens)

    def _observe_completion(self, out: RequestOutput, c, t: float) -> None:
        key, n = (out.request_id, c.index), len(c.token_ids)
        prev_n, prev_t, done, first_t = self._progress.get(key, (0, 0.0, False, 0.0))
        m = out.metrics
        if n > prev_n:
            if prev_n > 0:
                self.itl.observe(max(0.0, t - prev_t))
            else:
                first_t = t
                if m is not None:
                    self.ttft.observe(max(0.0, t - m.arrival_time))
            prev_n, prev_t = n, t
        if c.finish_reason and not done:
            done = True
            self.request_success.labels(self.model_name, c.finish_reason).inc()
            if m is not None and c.finish_reason != "abort":  # an abort's latencies would skew the histograms
                self._finished(out, m, n, first_t, prev_t, t)
        self._progress[key] = (prev_n, prev_t, done, first_t)

    def _finished(self, out: RequestOutput, m, n: int, first_t: float, last_t: float, t: float) -> None:
        """The histograms of a completion that finished (not aborted) at ``t`` with ``n`` tokens, its first at
        ``first_t`` and its last at ``last_t`` (vLLM V1's FinishedRequestStats: a completion with no token has no
        decode time)."""
        self.e2e.observe(max(0.0, t - m.arrival_time))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(n)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if n:
                self.prefill_time.observe(max(0.0, first_t - m.first_scheduled_time))
                self.inference_time.observe(max(0.0, last_t - m.first_scheduled_time))
        decode = max(0.0, last_t - first_t) if n else 0.0
        self.decode_time.observe(decode)
        self.tpot.observe(decode / (n - 1) if n > 1 else 0.0)

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept of requests that ended without a finished output (a failed step)."""
        gone = set(request_ids)
        with self._lock:
            for key in [k for k in self._progress if k[0] in gone]:
                del self._progress[key]

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

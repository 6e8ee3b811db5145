"""What ``appliance top`` shows, from the server's ``GET /metrics`` (Prometheus text, vLLM's metric names:
engine/metrics.py) and ``GET /v1/kv`` (the block map), with no engine import: the dashboard talks HTTP only.

A :class:`Scrape` is one reading of /metrics; :func:`view` turns the newest reading and an older one into rates
and latency percentiles over the time between them (the dashboard keeps a sliding window of readings).
:func:`block_map` folds the block map into a fixed grid of cells.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: The latency histograms shown, by metric name (without ``_seconds``).
LATENCIES = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "request_queue_time")

#: Cell shades of :func:`block_map`, by the fraction f of its blocks in use: 0, (0, 1/4), [1/4, 1/2), [1/2, 3/4),
#: [3/4, 1), 1.
SHADES = "·░▒▓▇█"


@dataclass
class Histogram:
    """One Prometheus histogram: ``buckets`` = (upper bound in seconds, cumulative count), ascending, the last
    bound +inf; ``count`` observations summing to ``total`` seconds."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float = 0.0
    total: float = 0.0

    def minus(self, older: Histogram | None) -> Histogram:
        """The observations made since ``older`` (same buckets), or self when there is none."""
        if older is None or len(older.buckets) != len(self.buckets):
            return self
        return Histogram([(le, c - o) for (le, c), (_, o) in zip(self.buckets, older.buckets)],
                         self.count - older.count, self.total - older.total)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 < q < 1) in seconds, interpolated linearly inside its bucket as Prometheus's
        ``histogram_quantile`` does; the largest finite bound when it falls in the +inf bucket; None without
        observations."""
        if self.count <= 0 or not self.buckets:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = le, cum
        return lower


@dataclass
class Scrape:
    """One reading of /metrics at ``time`` (seconds, monotonic). Counters are totals since the server started."""

    time: float
    model: str = ""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    finished: dict[str, float] = field(default_factory=dict)  # by finish reason
    cache: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info labels
    latencies: dict[str, Histogram] = field(default_factory=dict)  # LATENCIES

    def restarted_since(self, older: Scrape) -> bool:
        """True when a counter is below its value in ``older``: the server started again in between."""
        totals = [(getattr(self, a), getattr(older, a)) for a in _COUNTERS.values()]
        totals += [(sum(self.finished.values()), sum(older.finished.values()))]
        totals += [(h.count, older.latencies[n].count) for n, h in self.latencies.items() if n in older.latencies]
        return any(new < old for new, old in totals)


_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}
_COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens",
             "vllm:num_preemptions": "preemptions", "vllm:prefix_cache_queries": "prefix_queries",
             "vllm:prefix_cache_hits": "prefix_hits"}


def parse_metrics(text: str, time: float) -> Scrape:
    """A :class:`Scrape` from the Prometheus text exposition ``text`` read at ``time``. Metrics it does not know
    are skipped; ValueError when the text is not Prometheus's format."""
    scrape = Scrape(time=time)
    for family in text_string_to_metric_families(text):
        name = family.name
        for sample in family.samples:
            scrape.model = sample.labels.get("model_name", scrape.model)
            if name in _GAUGES:
                value = sample.value if math.isfinite(sample.value) else 0.0
                setattr(scrape, _GAUGES[name], value if name == "vllm:kv_cache_usage_perc" else int(value))
            elif name in _COUNTERS and sample.name.endswith("_total"):
                setattr(scrape, _COUNTERS[name], sample.value)
            elif name == "vllm:request_success" and sample.name.endswith("_total"):
                scrape.finished[sample.labels.get("finished_reason", "?")] = sample.value
            elif name in ("vllm:cache_config", "vllm:cache_config_info"):  # the parser names an info a gauge
                scrape.cache = {k: v for k, v in sample.labels.items() if k != "model_name"}
            elif name.startswith("vllm:") and name[5:].removesuffix("_seconds") in LATENCIES:
                hist = scrape.latencies.setdefault(name[5:].removesuffix("_seconds"), Histogram())
                if sample.name.endswith("_bucket"):
                    hist.buckets.append((float(sample.labels["le"]), sample.value))
                elif sample.name.endswith("_count"):
                    hist.count = sample.value
                elif sample.name.endswith("_sum"):
                    hist.total = sample.value
    for hist in scrape.latencies.values():
        hist.buckets.sort()
    return scrape


@dataclass
class View:
    """The dashboard's numbers: rates over ``seconds`` between two scrapes (tokens per second), latency
    percentiles (seconds, None without observations) of the requests that finished or advanced in that time,
    the newest gauges, and totals since the server started."""

    seconds: float
    prompt_tok_s: float
    generation_tok_s: float
    requests_per_s: float
    prefix_hit_rate: float | None  # hit tokens / queried tokens in the window
    percentiles: dict[str, tuple[float | None, float | None]]  # LATENCIES -> (p50, p95)
    running: int
    waiting: int
    kv_usage: float
    preemptions: float
    finished: float


def view(old: Scrape | None, new: Scrape) -> View:
    """The numbers between ``old`` and ``new`` (``old`` None, or as new as ``new``: totals since the server
    started, no rates)."""
    seconds = new.time - old.time if old is not None else 0.0

    def rate(attr: str) -> float:
        return (getattr(new, attr) - getattr(old, attr)) / seconds if seconds > 0 else 0.0

    queries = new.prefix_queries - (old.prefix_queries if old else 0.0)
    hits = new.prefix_hits - (old.prefix_hits if old else 0.0)
    finished = sum(new.finished.values())
    done = finished - (sum(old.finished.values()) if old else 0.0)
    pcts = {}
    for name in LATENCIES:
        hist = new.latencies.get(name, Histogram()).minus(old.latencies.get(name) if old else None)
        pcts[name] = (hist.quantile(0.5), hist.quantile(0.95))
    return View(seconds=seconds, prompt_tok_s=rate("prompt_tokens"), generation_tok_s=rate("generation_tokens"),
                requests_per_s=done / seconds if seconds > 0 else 0.0,
                prefix_hit_rate=hits / queries if queries > 0 else None, percentiles=pcts, running=new.running,
                waiting=new.waiting, kv_usage=new.kv_usage, preemptions=new.preemptions, finished=finished)


def block_map(states: str, cells: int) -> str:
    """The block map of /v1/kv (one character per block: ``.`` free, ``#`` used, ``c`` cached) folded into at
    most ``cells`` cells, each covering the same number of consecutive blocks (the last maybe fewer): a shade of
    :data:`SHADES` by the fraction in use (a cell is full only when every block is), or ``c`` for a cell with cached
    blocks and none in use. Empty for an empty map."""
    if not states or cells < 1:
        return ""
    per = -(-len(states) // cells)
    out = []
    for i in range(0, len(states), per):
        chunk = states[i:i + per]
        used = chunk.count("#")
        if used == 0:
            out.append("c" if "c" in chunk else SHADES[0])
        elif used == len(chunk):
            out.append(SHADES[-1])
        else:
            out.append(SHADES[min(4, 1 + (4 * used) // len(chunk))])
    return "".join(out)

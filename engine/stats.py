"""Engine statistics: a snapshot of gauges and cumulative counters, read by ``/metrics`` and ``/v1/kv``."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

#: Bounds of the tokens-per-step histogram (``vllm:iteration_tokens_total``): vLLM V1's list with enforce_eager
#: (its ``build_cudagraph_buckets``; 8096, not 8192, as vLLM has it), so that dashboards' quantiles line up
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8096)


@dataclass(frozen=True)
class TokenHistogram:
    """Engine steps by the tokens each computed (prefill and decode tokens together). ``counts[i]``: the steps of
    more than ``bounds[i - 1]`` and at most ``bounds[i]`` tokens, ``counts[-1]`` those above the last bound;
    ``sum``: all their tokens. Immutable (a snapshot shares it); ``+`` adds two of the same bounds."""

    bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    counts: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    sum: int = 0

    def observe(self, tokens: int) -> TokenHistogram:
        """This histogram with one more step of ``tokens`` tokens."""
        i = bisect_left(self.bounds, tokens)  # the first bound >= tokens, or len(bounds): above them all
        counts = self.counts[:i] + (self.counts[i] + 1,) + self.counts[i + 1:]
        return TokenHistogram(self.bounds, counts, self.sum + tokens)

    def __add__(self, other: TokenHistogram) -> TokenHistogram:
        if not isinstance(other, TokenHistogram):
            return NotImplemented
        if other.bounds != self.bounds:
            raise ValueError(f"histograms of other bounds: {self.bounds} and {other.bounds}")
        return TokenHistogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)),
                              self.sum + other.sum)


@dataclass
class EngineStats:
    """One consistent snapshot, taken between engine steps.

    Counters (``*_total``) only grow over the engine's life; the Prometheus layer exports them as counters, and
    ``iteration_tokens`` (steps by tokens computed) as a histogram.
    ``block_states`` has one character per KV block: ``.`` free, ``#`` used by a running request,
    ``c`` cached (holds a reusable prefix, evictable). ``running`` lists (request_id, number of blocks held).
    ``kv_cache_usage`` = used blocks / all blocks, in [0, 1].
    """

    num_running: int
    num_waiting: int
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    iteration_tokens: TokenHistogram = field(default_factory=TokenHistogram)
    running: list[tuple[str, int]] = field(default_factory=list)
    block_states: str = ""

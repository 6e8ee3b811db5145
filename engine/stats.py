"""Engine statistics: a snapshot of gauges and cumulative counters, read by ``/metrics`` and ``/v1/kv``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """One consistent snapshot, taken between engine steps.

    Counters (``*_total``) only grow over the engine's life; the Prometheus layer exports them as counters.
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
    running: list[tuple[str, int]] = field(default_factory=list)
    block_states: str = ""

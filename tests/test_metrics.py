"""engine.metrics per completion of n, on hand-made outputs: each completion's TTFT, ITL, e2e and finish reason at
its own step (vLLM V1's child requests), aborts in request_success only, and requests a failed step ended
forgotten."""
from __future__ import annotations

from engine.metrics import EngineMetrics
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(t: float, tokens: list[int], reasons: list[str | None], request_id: str = "r") -> RequestOutput:
    """Request ``request_id`` (arrived at 0, first scheduled at 0.5) after a step at time ``t``: completion i has
    ``tokens[i]`` tokens and finish reason ``reasons[i]``."""
    outs = [CompletionOutput(i, "", [0] * n, reason) for i, (n, reason) in enumerate(zip(tokens, reasons))]
    return RequestOutput(request_id, None, [1], outs, all(reasons), RequestMetrics(0.0, 0.5, 1.0, t, max_tokens=16))


def samples(metrics: EngineMetrics, name: str) -> dict[str, float]:
    return {s.name.removeprefix(name): s.value for m in metrics.registry.collect() if m.name == name
            for s in m.samples if s.name.endswith(("_count", "_sum", "_total"))}


def test_each_completion_is_timed_at_its_own_steps():
    metrics = EngineMetrics("m", lambda: None)
    metrics.observe([output(1.0, [1, 0], [None, None])])  # completion 1's prefill spilled into the next step
    metrics.observe([output(2.0, [2, 1], [None, None])])
    metrics.observe([output(3.0, [3, 2], ["stop", None])])
    metrics.observe([output(5.0, [3, 3], ["stop", "length"])])
    assert samples(metrics, "vllm:time_to_first_token_seconds") == {"_count": 2.0, "_sum": 1.0 + 2.0}
    assert samples(metrics, "vllm:inter_token_latency_seconds") == {"_count": 4.0, "_sum": 1 + 1 + 1 + 2.0}
    assert samples(metrics, "vllm:e2e_request_latency_seconds") == {"_count": 2.0, "_sum": 3.0 + 5.0}
    assert samples(metrics, "vllm:request_queue_time_seconds") == {"_count": 2.0, "_sum": 0.5 + 0.5}
    # scheduled at 0.5; completion 0's tokens at 1, 2, 3; completion 1's at 2, 3, 5
    assert samples(metrics, "vllm:request_prefill_time_seconds") == {"_count": 2.0, "_sum": 0.5 + 1.5}
    assert samples(metrics, "vllm:request_decode_time_seconds") == {"_count": 2.0, "_sum": 2.0 + 3.0}
    assert samples(metrics, "vllm:request_inference_time_seconds") == {"_count": 2.0, "_sum": 2.5 + 4.5}
    assert samples(metrics, "vllm:request_time_per_output_token_seconds") == {"_count": 2.0, "_sum": 1.0 + 1.5}
    assert samples(metrics, "vllm:request_prompt_tokens") == {"_count": 2.0, "_sum": 2.0}
    assert samples(metrics, "vllm:request_generation_tokens") == {"_count": 2.0, "_sum": 6.0}
    assert samples(metrics, "vllm:request_params_n") == {"_count": 1.0, "_sum": 2.0}  # one request of n=2
    assert samples(metrics, "vllm:request_max_num_generation_tokens") == {"_count": 1.0, "_sum": 3.0}
    assert samples(metrics, "vllm:request_params_max_tokens") == {"_count": 1.0, "_sum": 16.0}  # once per request
    assert success(metrics) == {"stop": 1.0, "length": 1.0, "abort": 0.0}
    assert metrics._progress == {}


def success(metrics: EngineMetrics) -> dict[str, float]:
    """vllm:request_success_total by finish reason."""
    return {s.labels["finished_reason"]: s.value for m in metrics.registry.collect()
            if m.name == "vllm:request_success" for s in m.samples if s.name.endswith("_total")}


def test_an_abort_counts_in_request_success_only_and_a_failed_request_is_forgotten():
    metrics = EngineMetrics("m", lambda: None)
    metrics.observe([output(1.0, [1, 1], [None, None])])
    metrics.observe([output(2.0, [2, 1], ["abort", "abort"])])
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens"):
        assert samples(metrics, name)["_count"] == 0.0, name
    assert samples(metrics, "vllm:time_to_first_token_seconds")["_count"] == 2.0  # as vLLM V1: at the token
    assert success(metrics) == {"stop": 0.0, "length": 0.0, "abort": 2.0}  # each completion of n (vLLM V1)
    metrics.observe([output(1.0, [1], [None], "failing"), output(1.0, [1], [None], "other")])
    metrics.forget(["failing"])
    assert set(metrics._progress) == {("other", 0)}


def test_one_token_and_token_count_buckets_as_vllm():
    """A completion of one token has no decode time and a time per output token of 0 (vLLM V1); the token-count
    histograms' buckets are vLLM's 1-2-5 series up to max_model_len."""
    from engine.metrics import token_buckets

    metrics = EngineMetrics("m", lambda: None, max_model_len=100)
    metrics.observe([output(2.0, [1], ["length"])])
    assert samples(metrics, "vllm:request_decode_time_seconds") == {"_count": 1.0, "_sum": 0.0}
    assert samples(metrics, "vllm:request_time_per_output_token_seconds") == {"_count": 1.0, "_sum": 0.0}
    assert samples(metrics, "vllm:request_prefill_time_seconds") == {"_count": 1.0, "_sum": 1.5}
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100] and token_buckets(4095)[-1] == 2000
    bounds = [s.labels["le"] for m in metrics.registry.collect() if m.name == "vllm:request_prompt_tokens"
              for s in m.samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_steps_by_tokens_are_a_histogram_of_the_engine_s_totals():
    """``vllm:iteration_tokens_total`` from the stats snapshot: vLLM's buckets, cumulative, at 0 before a load."""
    import pytest

    from engine.stats import ITERATION_TOKEN_BUCKETS, EngineStats, TokenHistogram

    hist = TokenHistogram().observe(5).observe(1).observe(1).observe(20000)
    assert (hist.counts[:2], hist.counts[-1], hist.sum) == ((2, 1), 1, 20007)
    assert (hist + hist).counts[:2] == (4, 2) and (hist + hist).sum == 40014
    with pytest.raises(ValueError, match="other bounds"):
        hist + TokenHistogram(bounds=(1, 2), counts=(0, 0, 0))
    stats = EngineStats(num_running=0, num_waiting=0, block_size=16, num_blocks=8, num_free_blocks=8,
                        num_cached_blocks=0, kv_cache_usage=0.0, iteration_tokens=hist)
    for source, want in ((lambda: stats, hist), (lambda: None, TokenHistogram())):
        got = {s.labels.get("le", s.name): s.value for m in EngineMetrics("m", source).registry.collect()
               if m.name == "vllm:iteration_tokens_total" for s in m.samples}
        cumulative = [sum(want.counts[:i + 1]) for i in range(len(want.counts))]
        assert got == {**{str(float(b)): float(c) for b, c in zip(ITERATION_TOKEN_BUCKETS, cumulative)},
                       "+Inf": float(cumulative[-1]), "vllm:iteration_tokens_total_count": float(cumulative[-1]),
                       "vllm:iteration_tokens_total_sum": float(want.sum)}

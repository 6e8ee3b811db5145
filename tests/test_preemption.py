"""Preemption by recompute under KV-cache pressure changes no output (issue 4, case 9; CPU reference path, exact).

A pool of ten 8-token blocks cannot hold the eight requests at once, so the scheduler keeps preempting the newest
running request and prefilling it again later (prompt + tokens generated so far), from its still-cached blocks when
prefix caching is on and from scratch when it is off. Every request must finish with exactly the tokens it gets on
a roomy pool: nothing duplicated, nothing lost, and every block returned.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_fixtures import prompts

MAX_TOKENS = 16
#: logprobs make the comparison bit-exact: the old multi-row prefill attention gave the same tokens here but
#: different logprobs after a recompute.
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
SMALL = dict(device="cpu", max_num_seqs=16, max_model_len=64, block_size=8)


@pytest.fixture(scope="module")
def roomy(demo_model):
    return LLM(str(demo_model), **SMALL)


@pytest.fixture(scope="module")
def tight(demo_model):
    return LLM(str(demo_model), num_kv_blocks=10, **SMALL)


@pytest.fixture(scope="module")
def texts(roomy):
    return prompts(roomy.get_tokenizer())


@pytest.fixture(scope="module")
def expected(roomy, texts):
    outs = roomy.generate(texts, GREEDY)
    assert roomy.engine.get_stats().num_preemptions_total == 0
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def run_checked(llm, texts, resumed: list[int]) -> dict[str, tuple]:
    """All requests at once, stepping by hand and checking the block manager's invariants after every step;
    ``resumed`` gets the cached tokens (``num_computed_tokens``) of every re-prefill of a preempted sequence."""
    engine = llm.engine
    schedule = engine.scheduler.schedule

    def watched_schedule():
        batch = schedule()
        if batch is not None and batch.is_prefill:
            resumed.extend(s.num_computed_tokens for s in batch.seqs if s.num_output_tokens)
        return batch

    engine.scheduler.schedule = watched_schedule
    try:
        return step_all(engine, texts)
    finally:
        del engine.scheduler.schedule


def step_all(engine, texts) -> dict[str, tuple]:
    for i, text in enumerate(texts):
        engine.add_request(f"p{i}", text, GREEDY)
    done: dict[str, tuple] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                assert out.outputs[0].finish_reason == "length"
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
        engine.block_manager.check(list(engine.scheduler.running))
        for s in engine.scheduler.running:  # K/V of all but the token just sampled, in blocks it holds
            assert s.num_computed_tokens == len(s) - 1
            assert len(s.block_table) * engine.block_manager.block_size >= s.num_computed_tokens
        assert all(not s.block_table for s in engine.scheduler.waiting)
    return done


def assert_all_returned(engine) -> None:
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and sorted(bm.free_block_ids) == list(range(bm.num_blocks))
    assert "#" not in bm.block_states() and engine.get_stats().kv_cache_usage == 0.0
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_under_pressure_changes_no_tokens(tight, texts, expected, prefix_caching):
    engine = tight.engine
    bm = engine.block_manager
    assert bm.num_blocks * bm.block_size < sum(len(engine.tokenizer.encode(t)) + MAX_TOKENS for t in texts)
    before = engine.get_stats()
    bm.enable_prefix_caching = prefix_caching  # the same engine both ways (one model load); see EngineConfig
    resumed: list[int] = []
    try:
        done = run_checked(tight, texts, resumed)
    finally:
        bm.enable_prefix_caching = True
    stats = engine.get_stats()
    assert stats.num_preemptions_total > before.num_preemptions_total
    assert [done[f"p{i}"] for i in range(len(texts))] == expected
    assert all(len(t) == len(lp) == MAX_TOKENS for t, lp in expected)
    assert stats.generation_tokens_total - before.generation_tokens_total == len(texts) * MAX_TOKENS
    assert resumed  # preempted sequences were prefilled again (prompt + generated tokens)
    if prefix_caching:  # some resumed from their still-cached blocks, the rest recomputed what was evicted
        assert any(resumed) and all(n % bm.block_size == 0 for n in resumed)
    else:
        assert not any(resumed)
    assert_all_returned(engine)

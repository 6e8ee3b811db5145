"""Preemption under KV-cache pressure changes no output (issue 4, case 9; CPU reference path, exact).

A pool of ten 8-token blocks cannot hold the eight requests at once, so the scheduler keeps preempting the newest
running request. By recompute, it is prefilled again later (prompt + tokens generated so far), from its
still-cached blocks when prefix caching is on and from scratch when it is off; with swap space, its K/V is copied
to the CPU swap pool and back. Every request must finish with exactly the tokens it gets on a roomy pool: nothing
duplicated, nothing lost, and every block of both pools returned.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.swap_pool import SwapPool
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


def swap_space_gib(model_dir, num_blocks: int, block_size: int) -> float:
    """GiB of swap space that hold exactly ``num_blocks`` blocks of the model's float32 K and V."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * block_size
    return num_blocks * per_block / 2**30


@pytest.fixture(scope="module")
def swapping(demo_model):
    return LLM(str(demo_model), num_kv_blocks=10, swap_space=swap_space_gib(demo_model, 64, 8), **SMALL)


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

    def watched_schedule():  # a row of several tokens with output tokens: a preempted sequence's re-prefill
        batch = schedule()
        if batch is not None:
            resumed.extend(s.num_computed_tokens for s, n in zip(batch.seqs, batch.num_new_tokens)
                           if n > 1 and s.num_output_tokens)
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
        sched = engine.scheduler
        engine.block_manager.check(list(sched.running))
        sched.swap_pool.check(list(sched.swapped))
        for s in sched.running:  # K/V of all but the token just sampled, in blocks it holds
            assert s.num_computed_tokens == len(s) - 1
            assert len(s.block_table) * engine.block_manager.block_size >= s.num_computed_tokens
        assert all(not s.block_table and not s.swap_table for s in sched.waiting)
        assert all(not s.block_table and s.num_computed_tokens == len(s) - 1 for s in sched.swapped)
    return done


def assert_all_returned(engine) -> None:
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and sorted(bm.free_block_ids) == list(range(bm.num_blocks))
    assert "#" not in bm.block_states() and engine.get_stats().kv_cache_usage == 0.0
    assert not engine.scheduler.has_unfinished() and not engine.requests
    swap = engine.scheduler.swap_pool
    swap.check()
    assert sorted(swap.free_block_ids) == list(range(swap.num_blocks))


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


def test_swap_preemption_under_pressure_changes_no_tokens(swapping, texts, expected):
    """Every preemption swaps (64 swap blocks hold any victim): the K/V goes to the CPU pool and comes back, and
    no token is recomputed."""
    engine, sched = swapping.engine, swapping.engine.scheduler
    assert engine.runner.num_swap_blocks == sched.swap_pool.num_blocks == 64
    before = engine.get_stats()
    resumed: list[int] = []
    done = run_checked(swapping, texts, resumed)
    assert [done[f"p{i}"] for i in range(len(texts))] == expected
    stats = engine.get_stats()
    assert sched.num_swap_outs > 0 and sched.num_swap_ins == sched.num_swap_outs
    assert stats.num_preemptions_total - before.num_preemptions_total == sched.num_swap_outs  # no recompute
    assert resumed == []  # nothing was prefilled again
    assert stats.generation_tokens_total - before.generation_tokens_total == len(texts) * MAX_TOKENS
    assert_all_returned(engine)


def test_too_small_swap_pool_falls_back_to_recompute(swapping, texts, expected):
    """A 2-block swap pool takes the victims that hold two blocks at most; the others are recomputed."""
    engine, sched = swapping.engine, swapping.engine.scheduler
    full_pool, sched.swap_pool = sched.swap_pool, SwapPool(2)  # ids 0 and 1 of the runner's 64-block swap space
    swaps_before, preemptions_before = sched.num_swap_outs, sched.num_preemptions
    resumed: list[int] = []
    try:
        done = run_checked(swapping, texts, resumed)
        assert_all_returned(engine)
    finally:
        sched.swap_pool = full_pool
    assert [done[f"p{i}"] for i in range(len(texts))] == expected
    swaps, preemptions = sched.num_swap_outs - swaps_before, sched.num_preemptions - preemptions_before
    print(f"swaps {swaps} preemptions {preemptions} resumed {resumed}")
    assert 0 < swaps < preemptions and resumed  # both kinds happened
    assert sched.num_swap_ins == sched.num_swap_outs

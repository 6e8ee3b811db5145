"""Continuous batching changes nothing, and no KV block is ever leaked (CPU reference path, exact), in float32
and in bfloat16 (what ``appliance install`` serves on a CPU with bfloat16 instructions)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_fixtures import demo_dir, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def llm(request):
    return LLM(demo_dir(), device="cpu", max_num_seqs=16, dtype=request.param)


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_block_ids) == list(range(bm.num_blocks))
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


@pytest.fixture(scope="module")
def texts(llm):
    return prompts(llm.get_tokenizer())


@pytest.fixture(scope="module")
def one_at_a_time(llm, texts):
    return [llm.generate([t], GREEDY)[0].outputs[0].token_ids for t in texts]


def test_all_at_once_equals_one_at_a_time(llm, texts, one_at_a_time):
    together = [o.outputs[0].token_ids for o in llm.generate(texts, GREEDY)]
    assert together == one_at_a_time
    assert_all_blocks_free(llm.engine)


def test_staggered_arrivals_equal_one_at_a_time(llm, texts, one_at_a_time):
    """A new request joins the running batch every third step; finished ones leave at once."""
    engine = llm.engine
    pending = list(enumerate(texts))
    done: dict[str, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, text = pending.pop(0)
            engine.add_request(f"stagger-{i}", text, GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        assert len(engine.scheduler.running) <= engine.scheduler.max_num_seqs
    assert [done[f"stagger-{i}"] for i in range(len(texts))] == one_at_a_time
    assert_all_blocks_free(engine)


def test_max_num_seqs_is_respected(texts):
    llm = LLM(demo_dir(), device="cpu", max_num_seqs=3)
    engine = llm.engine
    for i, text in enumerate(texts):
        engine.add_request(str(i), text, SamplingParams(temperature=0, max_tokens=4))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert_all_blocks_free(engine)


def test_abort_frees_blocks_running_and_waiting(llm, texts):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, text in enumerate(texts):
        engine.add_request(f"abort-{i}", text, params)
    engine.step()  # prefill everything
    engine.step()  # one decode
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("abort-0")
    engine.abort_request("abort-5")
    engine.abort_request("no-such-request")
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.outputs[0].finish_reason == "abort"}
    assert set(aborted) == {"abort-0", "abort-5"}
    assert all(o.finished for o in aborted.values())
    for i in range(1, len(texts)):
        engine.abort_request(f"abort-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_finished_requests_free_blocks_and_stop_reasons(llm, texts):
    # the second outlives the others by 25 steps and spans three 16-token blocks (its prompt is 7 tokens; greedy
    # runs it to its length, no EOS within 64 either), so each one leaves the batch at another step
    outs = llm.generate(texts[:3], [SamplingParams(temperature=0, max_tokens=5),
                                    SamplingParams(temperature=0, max_tokens=32),
                                    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=7)])
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 5
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 32
    assert (outs[2].outputs[0].finish_reason, len(outs[2].outputs[0].token_ids)) == ("length", 7)  # seeded: no EOS
    assert_all_blocks_free(llm.engine)


def test_each_step_is_counted_by_the_tokens_it_computes():
    """``vllm:iteration_tokens_total``'s source: one prefill step of the whole prompt, then a step of one token
    per decoded token; two requests together share their steps (prefix caching off: both prefill in full). And
    ``vllm:request_params_max_tokens``'s: the request's max_tokens, or what the context leaves without one."""
    from engine.stats import TokenHistogram

    llm = LLM(demo_dir(), device="cpu", max_num_seqs=4, enable_prefix_caching=False, max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [out] = llm.generate(["The capital of France is"], params)
    n = len(out.prompt_token_ids)
    assert out.metrics.max_tokens == 4  # vllm:request_params_max_tokens
    want = TokenHistogram().observe(n).observe(1).observe(1).observe(1)
    assert llm.engine.get_stats().iteration_tokens == want
    llm.generate(["The capital of France is", "The capital of France is"], params)
    want = want.observe(2 * n).observe(2).observe(2).observe(2)
    assert llm.engine.get_stats().iteration_tokens == want
    [rest] = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert rest.metrics.max_tokens == 32 - n == len(rest.outputs[0].token_ids)  # none given: what the context leaves

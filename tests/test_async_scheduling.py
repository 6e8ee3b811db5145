"""Async scheduling (llm_engine.py) changes no output: the engine launches step n+1 before reading step n back,
its pending tokens reach the model from the device, and whatever finishes on read-back drops the token of the
step already launched. On the CPU path (exact) every request must get the tokens, text and finish reasons of the
synchronous engine, under preemption (recompute and swap), chunked prefill and aborts, and leave no block held.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_fixtures import prompts
from test_preemption import assert_all_returned, swap_space_gib

SMALL = dict(device="cpu", max_num_seqs=16, max_model_len=64, block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def mixed_params() -> list[SamplingParams]:
    """One per prompt of ``prompts``: length, EOS, stop strings, stop token ids, min_tokens, seeded n=2, penalties
    (whose counts must include the pending token), logprobs (read back a step later)."""
    return [GREEDY,
            SamplingParams(temperature=0, max_tokens=3),
            SamplingParams(temperature=0, max_tokens=20, stop=[","]),
            SamplingParams(temperature=0, max_tokens=12, stop=["\n"], include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=10, frequency_penalty=0.8),
            SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, presence_penalty=0.5),  # EOS?
            SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop_token_ids=[13, 28], logprobs=3)]


def run(llm: LLM, texts, params) -> tuple[list, int]:
    """All requests at once, stepping by hand; returns (per request: (token ids, text, finish reason, stop reason,
    logprobs) per choice, steps that left a batch pending). Checks the block manager after every step."""
    engine = llm.engine
    for i, (text, p) in enumerate(zip(texts, params)):
        engine.add_request(f"p{i}", text, p)
    done, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
                                        for c in out.outputs]
        overlapped += engine._pending is not None
        engine.block_manager.check(list(engine.scheduler.running))
    assert_all_returned(engine)
    return [done[f"p{i}"] for i in range(len(texts))], overlapped


@pytest.fixture(scope="module")
def texts(demo_model):
    return prompts(LLM(str(demo_model), **SMALL).get_tokenizer())


@pytest.fixture(scope="module")
def expected(demo_model, texts):
    outs, overlapped = run(LLM(str(demo_model), **SMALL), texts, mixed_params())
    assert overlapped == 0  # off by default on the CPU
    return outs


@pytest.mark.parametrize("extra", [
    {},
    {"num_kv_blocks": 10},  # preemption by recompute
    {"num_kv_blocks": 10, "enable_prefix_caching": False},
    {"num_kv_blocks": 10, "swap_space": "64 blocks"},  # preemption by swapping
    {"max_num_batched_tokens": 20},  # mixed steps: decodes and prefill chunks
    {"enable_chunked_prefill": False},
], ids=["roomy", "recompute", "recompute-no-prefix-cache", "swap", "chunked", "no-chunked-prefill"])
def test_async_scheduling_gives_the_tokens_of_the_synchronous_engine(demo_model, texts, expected, extra):
    if extra.get("swap_space") == "64 blocks":
        extra = {**extra, "swap_space": swap_space_gib(demo_model, 64, 8)}
    llm = LLM(str(demo_model), async_scheduling=True, **SMALL, **extra)
    got, overlapped = run(llm, texts, mixed_params())
    assert got == expected
    assert overlapped > 10  # it did overlap
    if "num_kv_blocks" in extra:
        assert llm.engine.get_stats().num_preemptions_total > 0


def test_a_pending_token_is_counted_but_not_read(demo_model):
    """After a decode step is launched, each of its sequences has one pending token: counted by len() (the
    scheduler's view), absent from token_ids and the outputs until the next step reads it back."""
    llm = LLM(str(demo_model), async_scheduling=True, **SMALL)
    engine = llm.engine
    engine.add_request("a", list(range(100, 120)), GREEDY)
    first = engine.step()  # prefill launched, nothing read back yet
    assert first == [] and engine._pending is not None
    seq = engine.requests["a"].seqs[0]
    assert seq.num_pending_tokens == 1 and len(seq) == len(seq.token_ids) + 1 == 21
    out = engine.step()  # decode launched (reading the pending token on the device), prefill read back
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 1
    assert seq.num_pending_tokens == 1 and len(seq.token_ids) == 21 and seq.num_computed_tokens == 21
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_returned(engine)


def test_abort_while_a_step_is_in_flight(demo_model, texts):
    """Aborting a request whose token is pending drops that token; the others get their synchronous tokens."""
    sync = LLM(str(demo_model), **SMALL).generate(texts[:2], GREEDY)
    llm = LLM(str(demo_model), async_scheduling=True, **SMALL)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"p{i}", texts[i], GREEDY)
    outs = [engine.step() for _ in range(3)]
    assert engine._pending is not None
    engine.abort_request("p2")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    assert final["p2"].finished and final["p2"].outputs[0].finish_reason == "abort"
    assert [final[f"p{i}"].outputs[0].token_ids for i in range(2)] == [o.outputs[0].token_ids for o in sync]
    assert outs[0] == []
    assert_all_returned(engine)


def one_request_async(demo_model, prompt: list[int], params: SamplingParams) -> tuple:
    """One request through an engine with async scheduling, stepping by hand: (its final CompletionOutput, the
    steps that left a batch pending)."""
    engine = LLM(str(demo_model), async_scheduling=True, **SMALL).engine
    engine.add_request("a", prompt, params)
    overlapped, got = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.outputs[0]
        overlapped += engine._pending is not None
    return got, overlapped


def test_logprobs_steps_overlap_and_give_the_synchronous_logprobs(demo_model):
    """Logprobs are computed on the device and read back with the tokens, a step later: the steps stay pending
    (overlapped), and every token's entry equals the synchronous engine's (the sampled token's logprob first,
    then the top 2)."""
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = list(range(100, 120))
    sync = LLM(str(demo_model), **SMALL).generate([prompt], params)[0].outputs[0]
    got, overlapped = one_request_async(demo_model, prompt, params)
    assert got.token_ids == sync.token_ids and got.logprobs == sync.logprobs
    assert len(got.logprobs) == 12 and all(len(e) in (2, 3) for e in got.logprobs)
    assert [next(iter(e)) for e in got.logprobs] == got.token_ids
    assert overlapped >= 10


def test_penalised_steps_overlap_and_count_the_pending_token(demo_model):
    """Penalties count a pending token on the device: a penalised request's steps stay pending (overlapped) and
    give the synchronous engine's tokens, which differ from the unpenalised ones (so the count mattered)."""
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                               repetition_penalty=1.2)
    prompt = list(range(100, 120))
    sync = LLM(str(demo_model), **SMALL).generate([prompt], penalised)[0].outputs[0].token_ids
    plain = LLM(str(demo_model), **SMALL).generate([prompt], GREEDY)[0].outputs[0].token_ids
    got, overlapped = one_request_async(demo_model, prompt, penalised)
    assert got.token_ids == sync and sync[:16] != plain
    assert overlapped >= 20


def test_prefix_cache_hashes_only_tokens_read_back(demo_model):
    """Blocks filled while a token is pending are hashed once it is read back: a request repeating a finished
    one's prompt + output hits the same cached blocks as with the synchronous engine."""
    prompt = list(range(100, 125))
    hits = []
    for async_scheduling in (False, True):
        llm = LLM(str(demo_model), async_scheduling=async_scheduling, **SMALL)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
        again = prompt + list(out.outputs[0].token_ids)
        llm.generate([again], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        stats = llm.engine.get_stats()
        hits.append((out.outputs[0].token_ids, stats.prefix_cache_hits_total))
        llm.engine.block_manager.check()
    assert hits[0] == hits[1] and hits[0][1] == 40  # 5 full 8-token blocks of the 45 tokens


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_no_step_is_launched_for_a_token_past_max_tokens(demo_model, max_tokens):
    """The scheduler knows when a pending token is a sequence's last (max_tokens): it schedules no step for it, so
    the async engine launches as many model steps as the synchronous one."""
    launches = {}
    for async_scheduling in (False, True):
        llm = LLM(str(demo_model), async_scheduling=async_scheduling, **SMALL)
        launch, count = llm.engine.runner.launch, []
        llm.engine.runner.launch = lambda *a: count.append(1) or launch(*a)
        out = llm.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                    ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == max_tokens
        launches[async_scheduling] = len(count)
        assert_all_returned(llm.engine)
    assert launches[True] == launches[False] == max_tokens


def test_no_step_is_launched_for_a_token_past_max_model_len(demo_model):
    """Without max_tokens the context limit ends a sequence: the same number of launches as the synchronous
    engine, none for the token that would pass max_model_len."""
    launches = {}
    for async_scheduling in (False, True):
        llm = LLM(str(demo_model), async_scheduling=async_scheduling, **SMALL)
        launch, count = llm.engine.runner.launch, []
        llm.engine.runner.launch = lambda *a: count.append(1) or launch(*a)
        prompt = list(range(100, 100 + SMALL["max_model_len"] - 3))
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 3 and out.finish_reason == "length"
        launches[async_scheduling] = len(count)
        assert_all_returned(llm.engine)
    assert launches[True] == launches[False]

"""Chunked prefill under a per-step token budget, decodes first (vLLM V1): the scheduler over integer block ids
(no model), the configuration checks, then the engine on the demo model (CPU reference path, exact): chunking
changes no token and no logprob."""
from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence


def seq(n_tokens: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, [1000 + i for i in range(n_tokens)], SamplingParams())


def chunked(bm: BlockManager, max_num_seqs: int = 4, budget: int = 16) -> Scheduler:
    return Scheduler(bm, max_num_seqs, budget, enable_chunked_prefill=True)


def advance(batch: ScheduledBatch, next_token) -> None:
    """What the engine does after the forward pass: every row's tokens are computed; rows that reach their
    sequence's end get a token."""
    for s, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
        s.num_computed_tokens += n
        if samples:
            s.token_ids.append(next_token(s))


# ---- scheduler ----------------------------------------------------------------------------------------------------
def test_long_prompt_is_split_into_budget_sized_chunks():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    sched = chunked(bm, budget=16)
    s = seq(40)
    sched.add(s)
    steps = []
    for _ in range(4):
        batch = sched.schedule()
        steps.append((batch.num_new_tokens, batch.samples, batch.is_prefill, s.num_computed_tokens,
                      len(s.block_table)))
        advance(batch, lambda _: 7)
        # only blocks whose every token is computed are hashed (can be hit by another sequence)
        assert sum(bm.block_hashes[b] is not None for b in s.block_table) == s.num_computed_tokens // 4
        bm.check([s])
    assert steps == [([16], [False], True, 0, 4),   # tokens 0..15: four blocks, no token sampled
                     ([16], [False], True, 16, 8),  # tokens 16..31
                     ([8], [True], True, 32, 10),   # tokens 32..39 reach the end: the first token is sampled
                     ([1], [True], False, 40, 11)]  # a decode: token 40 needs an eleventh block
    assert len(s) == 42 and s.num_output_tokens == 2
    sched.finish(s, "stop")
    bm.check()
    assert bm.num_free_blocks == 32


def test_decodes_take_the_budget_first_and_the_rest_goes_to_chunks():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = chunked(bm, max_num_seqs=4, budget=10)
    a, b = seq(3, "a"), seq(4, "b")
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()
    assert (batch.seqs, batch.num_new_tokens, batch.samples) == ([a, b], [3, 4], [True, True])
    advance(batch, lambda _: 7)
    c, d = seq(30, "c"), seq(5, "d")
    sched.add(c)
    sched.add(d)
    batch = sched.schedule()  # a and b decode (1 + 1), c takes the 8 tokens left; d waits behind c
    assert (batch.seqs, batch.num_new_tokens, batch.samples) == ([a, b, c], [1, 1, 8], [True, True, False])
    assert batch.is_prefill and batch.num_batched_tokens == 10 and list(sched.waiting) == [d]
    advance(batch, lambda _: 7)
    batch = sched.schedule()  # the decodes again first, then c's next chunk (a running partial prefill)
    assert (batch.seqs, batch.num_new_tokens) == ([a, b, c], [1, 1, 8])
    advance(batch, lambda _: 7)
    sched.finish(a, "stop")
    batch = sched.schedule()  # b decodes; c's 14 left > 9: a chunk of 9; d still waits
    assert (batch.seqs, batch.num_new_tokens, batch.samples) == ([b, c], [1, 9], [True, False])
    advance(batch, lambda _: 7)
    batch = sched.schedule()  # c's last 5 tokens end its prompt; d gets the 4 tokens still left
    assert (batch.seqs, batch.num_new_tokens, batch.samples) == ([b, c, d], [1, 5, 4], [True, True, False])
    bm.check(list(sched.running))


def test_pure_decode_steps_are_not_prefill():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = chunked(bm)
    s = seq(5)
    sched.add(s)
    advance(sched.schedule(), lambda _: 7)
    batch = sched.schedule()
    assert (batch.num_new_tokens, batch.samples, batch.is_prefill) == ([1], [True], False)


@pytest.mark.parametrize("num_blocks", [200, 18], ids=["roomy", "preempting"])
def test_random_traffic_keeps_budget_decodes_first_and_leaks_nothing(num_blocks):
    """Prompts of 5..60 tokens arrive over time and decode random lengths, sharing prefixes; after every step:
    the budget holds, the running decodes come first and all of them run (unless preempted), a prompt is cut only
    when the budget is used up, only fully computed blocks are hashed, and the block manager's invariants hold."""
    rng = random.Random(7)
    budget, bs = 16, 4
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=True)
    sched = chunked(bm, max_num_seqs=4, budget=budget)
    system = [rng.randrange(50) for _ in range(12)]
    arrivals = [Sequence(str(i), 0, system[:rng.choice([0, 8, 12])] + [rng.randrange(50) for _ in
                                                                       range(rng.randrange(5, 49))], SamplingParams())
                for i in range(30)]
    target = {s.request_id: rng.randrange(1, 12) for s in arrivals}
    finished, chunks, mixed = 0, 0, 0
    while arrivals or sched.has_unfinished():
        if arrivals and rng.random() < 0.5:
            sched.add(arrivals.pop(0))
        decoding = [s for s in sched.running if s.num_uncomputed_tokens == 1]
        batch = sched.schedule()
        if batch is None:
            continue
        assert batch.num_batched_tokens == sum(batch.num_new_tokens) <= budget
        assert batch.seqs[:len(decoding)] == [s for s in decoding if s in sched.running]
        assert all(batch.samples) or batch.num_batched_tokens == budget
        assert all(n == s.num_uncomputed_tokens for s, n, ok in zip(batch.seqs, batch.num_new_tokens, batch.samples)
                   if ok)
        chunks += not all(batch.samples)
        mixed += bool(decoding) and len(batch.seqs) > len(decoding)
        advance(batch, lambda s: rng.randrange(50))
        for s in batch.seqs:
            if s.num_output_tokens >= target[s.request_id] and not s.is_finished:
                sched.finish(s, "length")
                finished += 1
        for s in sched.running:
            hashed = [bm.block_hashes[b] is not None for b in s.block_table]
            assert hashed == [i < s.num_computed_tokens // bs for i in range(len(s.block_table))]
        bm.check(list(sched.running))
        assert all(not s.block_table for s in sched.waiting)
    assert finished == 30 and chunks > 0 and mixed > 0
    assert (num_blocks == 18) == (sched.num_preemptions > 0)
    assert bm.num_free_blocks == num_blocks and sorted(bm.free_block_ids) == list(range(num_blocks))
    assert bm.prefix_cache_hits > 0


# ---- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens: must be at least 1, got 0"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens: must be at least 1, got -5"),
    (dict(max_num_batched_tokens=7, max_num_seqs=8), "max_num_batched_tokens: 7 is smaller than max_num_seqs=8"),
    (dict(max_num_batched_tokens=512, max_model_len=1024, enable_chunked_prefill=False),
     "max_num_batched_tokens: 512 is smaller than max_model_len=1024"),
])
def test_config_rejects_a_budget_out_of_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **kwargs)


def test_config_budget():
    assert EngineConfig(model="unused", max_num_batched_tokens=8, max_num_seqs=8).token_budget(4096) == 8
    assert EngineConfig(model="unused", max_num_batched_tokens=512, max_model_len=1024).token_budget(1024) == 512
    assert EngineConfig(model="unused").token_budget(1024) == 2048
    assert EngineConfig(model="unused").token_budget(8192) == 2048  # chunked prefill: 2048 whatever the context
    assert EngineConfig(model="unused", enable_chunked_prefill=False).token_budget(8192) == 8192  # whole prompts
    assert EngineConfig(model="unused", max_num_seqs=4096).token_budget(1024) == 4096
    assert EngineConfig(model="unused").enable_chunked_prefill is True
    no_chunks = EngineConfig(model="unused", max_num_batched_tokens=2048, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens: 2048 is smaller than max_model_len=8192"):
        no_chunks.token_budget(8192)  # max_model_len from the model's config, known only to the engine


def test_engine_checks_the_budget_against_the_models_length_before_loading(demo_model):
    from engine import LLM
    with pytest.raises(ValueError, match="max_num_batched_tokens: 1024 is smaller than max_model_len=8192"):
        LLM(str(demo_model), device="cpu", max_num_batched_tokens=1024, enable_chunked_prefill=False)


# ---- engine (demo model, CPU reference path: row-invariant, so chunking must change nothing) ----------------------
BUDGET = 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)  # logprobs: bit-exact check


@pytest.fixture(scope="module", params=["auto", "bfloat16"])  # bfloat16: what the installer serves on such CPUs
def llm(demo_model, request):
    from engine import LLM
    return LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=BUDGET,
               dtype=request.param)


def long_prompts(tokenizer) -> list[list[int]]:
    """Token prompts of 5 to 200 tokens cut from running text (two share their first 77 tokens), and a chat
    prompt."""
    from engine_fixtures import RAW_PROMPTS, prompts
    text = " ".join(RAW_PROMPTS * 8)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 200
    cut = [ids[:n] for n in (5, 16, 33, 77, 200)] + [ids[:77] + ids[100:140]]
    return cut + [tokenizer.encode(prompts(tokenizer)[-1], add_special_tokens=False)]


def test_chunked_prefill_changes_no_token_or_logprob(llm):
    engine = llm.engine
    sched, bm = engine.scheduler, engine.block_manager
    assert (sched.enable_chunked_prefill, sched.max_num_batched_tokens) == (True, BUDGET)
    prompts = long_prompts(llm.get_tokenizer())
    # Reference: the same engine without chunking (whole prompts, prefill-only steps) and without prefix caching.
    sched.enable_chunked_prefill, sched.max_num_batched_tokens, bm.enable_prefix_caching = False, 4096, False
    try:
        expected = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY)]
    finally:
        sched.enable_chunked_prefill, sched.max_num_batched_tokens, bm.enable_prefix_caching = True, BUDGET, True
    before = engine.get_stats()
    batches: list[tuple[list[int], list[bool], int]] = []
    schedule = sched.schedule

    def watched_schedule():
        batch = schedule()
        decodes = [n == 1 and ok and s.num_output_tokens > 0 for s, n, ok in
                   zip(batch.seqs, batch.num_new_tokens, batch.samples)] if batch else []
        batches.append((batch.num_new_tokens, batch.samples, sum(decodes)) if batch else ([], [], 0))
        return batch

    sched.schedule = watched_schedule
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        got: dict[str, tuple] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.outputs[0].token_ids, "a request was reported before its prompt was computed"
                if out.finished:
                    got[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
            bm.check(list(sched.running))
    finally:
        del sched.schedule
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert all(sum(n) <= BUDGET for n, _, _ in batches)
    assert sum(not all(ok) for _, ok, _ in batches) >= 200 // BUDGET  # prompts were cut into chunks
    assert any(d and len(n) > d for n, _, d in batches)  # mixed steps: decode rows beside prefill chunks
    stats = engine.get_stats()
    assert stats.prompt_tokens_total - before.prompt_tokens_total == sum(map(len, prompts))  # once, not per chunk
    assert stats.generation_tokens_total - before.generation_tokens_total == 8 * len(prompts)
    assert stats.prefix_cache_hits_total > before.prefix_cache_hits_total
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()

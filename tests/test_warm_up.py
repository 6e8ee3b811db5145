"""The model runner's start-up prefills (``ModelRunner.warm_up_prefill``, run on CUDA so that kernels compile
before the first request): they write nothing to the KV cache and change no answer. Run here on the CPU path."""
from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def test_warm_up_prefill_writes_nothing_and_changes_no_answer(demo_model):
    llm = LLM(str(demo_model), device="cpu", max_num_seqs=2, max_model_len=128, cpu_kv_cache_gib=0.02,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    prompt, greedy = list(range(200, 237)), SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    caches = [kv.clone() for kv in runner.kv_caches]
    runner.warm_up_prefill(64)  # prompts of 1, 7, 8, 15, 16, 63 and 64 tokens
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches))  # every slot was -1: nothing written
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == before


def test_warm_up_covers_every_plan_bucket_with_and_without_a_multiple_of_16():
    """Each W4A16 M bucket (its plan, and the split count rotary and SiLU-and-mul specialize on) gets a start-up
    prompt, and from 9 rows to the last bucket one whose length is a multiple of 16 and one whose length is not
    (Triton specializes integer arguments on that); so do the rows past the last bucket (dequantize-then-cuBLAS)."""
    from engine.model_runner import ModelRunner
    from kernels import w4a16

    tokens = ModelRunner.WARM_UP_TOKENS
    edges = (0,) + w4a16.M_BUCKETS + (w4a16.M_BUCKETS[-1] + 16,)
    for lo, hi in zip(edges, edges[1:]):
        inside = [t for t in tokens if lo < t <= hi]
        assert inside, f"no warm-up prompt of {lo + 1}-{hi} tokens"
        if 16 <= hi <= w4a16.M_BUCKETS[-1]:
            assert {t % 16 == 0 for t in inside} == {True, False}, f"{lo + 1}-{hi}: {inside}"


def test_warm_up_stops_at_the_step_budget(demo_model):
    """With 256-token steps (--max-num-batched-tokens 256) no prefill of 257 tokens ever runs, so the start-up
    does not run one either: above 256 rows a product dequantizes its whole weight, which that plan does not count."""
    llm = LLM(str(demo_model), device="cpu", max_num_seqs=2, max_model_len=384, cpu_kv_cache_gib=0.02,
              max_num_batched_tokens=256)
    runner, lengths = llm.engine.runner, []
    forward = runner.model.forward
    runner.model.forward = lambda ids, *args: lengths.append(len(ids)) or forward(ids, *args)
    runner.warm_up_prefill(384)
    assert lengths == [t for t in runner.WARM_UP_TOKENS if t <= 256] and max(runner.WARM_UP_TOKENS) == 257

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
    runner.warm_up_prefill(64)  # prompts of 1, 7, 15 and 63 tokens
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches))  # every slot was -1: nothing written
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == before

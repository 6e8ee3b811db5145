"""``kv_cache_dtype="fp8"``: the KV cache holds float8 e4m3 (half of bf16's bytes, a quarter of the CPU path's
fp32), written through the same kernels with one rounding, read back converted to the model dtype."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig

SMALL = dict(device="cpu", max_num_seqs=4, max_model_len=256, cpu_kv_cache_gib=0.05)


def test_fp8_cache_holds_the_rounded_values_and_four_times_the_blocks(demo_model):
    auto = LLM(str(demo_model), **SMALL)
    fp8 = LLM(str(demo_model), kv_cache_dtype="fp8", **SMALL)
    assert fp8.engine.runner.kv_dtype == torch.float8_e4m3fn and auto.engine.runner.kv_dtype == torch.float32
    assert 4 * fp8.engine.runner._bytes_per_block() == auto.engine.runner._bytes_per_block()  # 1 byte against 4
    assert fp8.engine.runner.num_blocks >= 4 * auto.engine.runner.num_blocks
    prompt = list(range(100, 140))
    one = SamplingParams(temperature=0, max_tokens=1)
    auto.generate([prompt], one)
    fp8.generate([prompt], one)
    # layer 0's K and V depend on the prompt alone: the fp8 cache is the fp32 one rounded, bit for bit
    want = auto.engine.runner.kv_caches[0][:, :8].to(torch.float8_e4m3fn)  # the prompt's 3 blocks and 5 empty
    # (no value of this layer reaches fp8's +-448, where the engine saturates: torch's .to saturates on the CPU too)
    got = fp8.engine.runner.kv_caches[0][:, :8]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and got.float().abs().sum() > 0


def test_fp8_cache_reads_back_what_it_wrote(demo_model, monkeypatch):
    """Greedy tokens with the fp8 cache equal those of the fp32 cache fed values rounded through fp8 (the reads
    convert exactly), so the fp8 path adds nothing but that rounding. On this 135M model the rounding alone changes
    the answer (the capital question ends "L'Etoile de la Cite..." instead of "Paris"): fp8 is an opt-in for
    larger models."""
    from kernels import rotary

    params = SamplingParams(temperature=0, max_tokens=10)
    fp8 = LLM(str(demo_model), kv_cache_dtype="fp8", **SMALL)
    tok = fp8.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [chat, list(range(100, 140))]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    write = rotary.write_kv_cache_ref

    def rounded(k, v, k_cache, v_cache, slots):
        fp8_round = lambda t: t.to(torch.float8_e4m3fn).to(t.dtype)  # noqa: E731
        write(fp8_round(k), fp8_round(v), k_cache, v_cache, slots)

    monkeypatch.setattr(rotary, "write_kv_cache_ref", rounded)
    want = [o.outputs[0].token_ids for o in LLM(str(demo_model), **SMALL).generate(prompts, params)]
    assert got == want


def test_int8_is_refused_with_a_hint(demo_model):
    with pytest.raises(ValueError, match="kv_cache_dtype: int8 is not implemented yet; use fp8"):
        EngineConfig(model=str(demo_model), kv_cache_dtype="int8")


def test_fp8_blocks_swap_out_and_back(demo_model):
    """Preemption by swapping moves fp8 blocks byte for byte (torch has no fp8 ``index_copy_``): under pressure
    every request gets the tokens of a roomy fp8 engine, and both pools get every block back."""
    from engine_fixtures import prompts
    from test_preemption import assert_all_returned, swap_space_gib

    small = dict(device="cpu", max_num_seqs=16, max_model_len=64, block_size=8, kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(demo_model), **small)
    texts = prompts(roomy.get_tokenizer())
    want = [o.outputs[0].token_ids for o in roomy.generate(texts, params)]
    tight = LLM(str(demo_model), num_kv_blocks=10, swap_space=swap_space_gib(demo_model, 64, 8), **small)
    got = [o.outputs[0].token_ids for o in tight.generate(texts, params)]
    assert got == want
    assert tight.engine.scheduler.num_swap_outs > 0 and tight.engine.scheduler.num_swap_ins > 0
    assert_all_returned(tight.engine)

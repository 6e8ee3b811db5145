"""``kv_cache_dtype="fp8"``: the KV cache holds float8 e4m3 (half of bf16's bytes, a quarter of the CPU path's
fp32), written through the same kernels with one rounding, read back converted to the model dtype.
``kv_cache_dtype="int8"``: int8 codes with one fp32 scale per token and KV head, quantized as they are written."""
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


def _fp8_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e4m3fn).to(t.dtype)


def _int8_round(t: torch.Tensor) -> torch.Tensor:
    from kernels.kv_cache import dequantize_int8_ref, quantize_int8_ref
    return dequantize_int8_ref(*quantize_int8_ref(t)).to(t.dtype)


@pytest.mark.parametrize("kv_cache_dtype,rounding,capital", [("fp8", _fp8_round, False), ("int8", _int8_round, True)])
def test_quantized_cache_reads_back_what_it_wrote(demo_model, monkeypatch, kv_cache_dtype, rounding, capital):
    """Greedy tokens with a quantized cache equal those of the fp32 cache fed the values it reads back (fp8:
    rounded, converted exactly; int8: codes x scales), so each path adds nothing but that rounding. On this 135M
    model fp8's rounding alone changes the answer to the capital question ("L'Etoile de la Cite..." instead of
    "Paris"): fp8 is an opt-in for larger models. int8's keeps it."""
    from kernels import rotary

    params = SamplingParams(temperature=0, max_tokens=10)
    llm = LLM(str(demo_model), kv_cache_dtype=kv_cache_dtype, **SMALL)
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [chat, list(range(100, 140))]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    write = rotary.write_kv_cache_ref

    def rounded(k, v, k_cache, v_cache, slots, k_scales=None, v_scales=None):
        write(rounding(k), rounding(v), k_cache, v_cache, slots)

    monkeypatch.setattr(rotary, "write_kv_cache_ref", rounded)
    want = [o.outputs[0].token_ids for o in LLM(str(demo_model), **SMALL).generate(prompts, params)]
    assert got == want
    assert tok.decode(got[0]).startswith("The capital of France is Paris") == capital


def test_unknown_cache_dtypes_are_refused(demo_model):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be auto, fp8 or int8, got 'int4'"):
        EngineConfig(model=str(demo_model), kv_cache_dtype="int4")


def test_int8_cache_holds_codes_and_scales_of_the_written_values(demo_model):
    """An int8 cache: per block, int8 codes then one fp32 scale per token and KV head, 68 bytes per head of 64
    against fp32's 256; layer 0's codes and scales are those of the fp32 engine's K/V (they depend on the prompt
    alone), quantized by ``quantize_int8_ref``, bit for bit."""
    from kernels.kv_cache import quantize_int8_ref

    auto = LLM(str(demo_model), **SMALL)
    int8 = LLM(str(demo_model), kv_cache_dtype="int8", **SMALL)
    runner = int8.engine.runner
    assert runner.kv_dtype == torch.int8 and runner.kv_caches[0].dtype == torch.uint8
    assert runner._bytes_per_block() * 4 * 64 == auto.engine.runner._bytes_per_block() * (64 + 4)
    assert runner.num_blocks >= 3 * auto.engine.runner.num_blocks
    prompt = list(range(100, 140))
    one = SamplingParams(temperature=0, max_tokens=1)
    auto.generate([prompt], one)
    int8.generate([prompt], one)
    want, got = auto.engine.runner.model.attention_layers()[0], runner.model.attention_layers()[0]
    for cache, scales, ref in ((got.k_cache, got.k_scales, want.k_cache), (got.v_cache, got.v_scales, want.v_cache)):
        codes, s = quantize_int8_ref(ref[:8])  # the prompt's 3 blocks and 5 empty ones (scale 0)
        assert torch.equal(cache[:8], codes) and torch.equal(scales[:8], s.transpose(1, 2))  # scales head-major
        assert (s[:2] > 0).all() and (s[3:] == 0).all()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_blocks_swap_out_and_back(demo_model, kv_cache_dtype):
    """Preemption by swapping moves fp8 blocks byte for byte (torch has no fp8 ``index_copy_``), and int8 blocks
    with their scales (one byte tensor per layer): under pressure every request gets the tokens of a roomy engine
    of the same cache dtype, and both pools get every block back."""
    from engine_fixtures import prompts
    from test_preemption import assert_all_returned, swap_space_gib

    small = dict(device="cpu", max_num_seqs=16, max_model_len=64, block_size=8, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(demo_model), **small)
    texts = prompts(roomy.get_tokenizer())
    want = [o.outputs[0].token_ids for o in roomy.generate(texts, params)]
    tight = LLM(str(demo_model), num_kv_blocks=10, swap_space=swap_space_gib(demo_model, 64, 8), **small)
    got = [o.outputs[0].token_ids for o in tight.generate(texts, params)]
    assert got == want
    assert tight.engine.scheduler.num_swap_outs > 0 and tight.engine.scheduler.num_swap_ins > 0
    assert_all_returned(tight.engine)


def test_int8_prefix_cache_hits_give_the_cold_tokens(demo_model):
    """A shared system prompt in an int8 cache: the later requests hit the first one's blocks (codes and scales
    reused as they are) and get the tokens, and logprobs, of an int8 engine without prefix caching."""
    from test_prefix_cache import GREEDY, chats, expected_hits, tokens_of

    small = dict(device="cpu", max_num_seqs=8, max_model_len=512, kv_cache_dtype="int8", cpu_kv_cache_gib=0.05)
    warm = LLM(str(demo_model), **small)
    prompts = chats(warm.get_tokenizer())
    want = tokens_of(LLM(str(demo_model), enable_prefix_caching=False, **small).generate(prompts, GREEDY))
    got = tokens_of(warm.generate(prompts[:1], GREEDY)) + tokens_of(warm.generate(prompts[1:], GREEDY))
    hits = expected_hits(prompts, warm.engine.block_manager.block_size)
    assert got == want and hits >= 2 * 16 * (len(prompts) - 1)
    assert warm.engine.get_stats().prefix_cache_hits_total == hits

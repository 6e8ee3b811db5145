"""Greedy equivalence: our engine's first 32 tokens equal transformers' greedy ``generate`` on the same weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine_fixtures import demo_dir, prompts

NUM_TOKENS = 32


def hf_greedy(model, tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                             min_new_tokens=0, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def engine_greedy(model_dir: str, texts: list[str]) -> list[list[int]]:
    llm = LLM(model_dir, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(texts, params)]


@pytest.fixture(scope="module")
def model_dir():
    return demo_dir()


def test_greedy_matches_transformers_unquantized(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = prompts(tokenizer)
    expected = hf_greedy(hf, tokenizer, texts)
    got = engine_greedy(model_dir, texts)
    assert [len(t) for t in got] == [NUM_TOKENS] * len(texts)
    assert got == expected


@pytest.mark.slow
def test_greedy_matches_transformers_on_awq_weights(awq_demo_model):
    """The AWQ checkpoint, dequantized into transformers' LlamaForCausalLM, against our engine reading the file."""
    from quant.evaluate import load_dequantized

    hf = load_dequantized(awq_demo_model, torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(awq_demo_model)
    texts = prompts(tokenizer)
    expected = hf_greedy(hf, tokenizer, texts)
    got = engine_greedy(str(awq_demo_model), texts)
    assert [len(t) for t in got] == [NUM_TOKENS] * len(texts)
    assert got == expected

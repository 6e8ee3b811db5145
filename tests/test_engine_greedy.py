"""Greedy equivalence: our engine's first 32 tokens equal transformers' greedy decoding on the same weights.

transformers' side is one forward pass per prompt over the prompt and the engine's tokens (teacher forcing): its
argmax at each position must be the engine's next token. That holds exactly when the engine's tokens are, token for
token, what transformers' ``generate(do_sample=False)`` gives (by induction: each is the argmax after the same
prefix), in a tenth of the time of generating 32 tokens one forward pass at a time.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine_fixtures import demo_dir, prompts

NUM_TOKENS = 32


@torch.inference_mode()
def hf_greedy_choices(model, tokenizer, texts: list[str], outputs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy choice at each position of each output: the argmax of the logits after the prompt and
    the output's tokens before that position (teacher forcing, one forward pass per prompt, EOS not special)."""
    out = []
    for text, tokens in zip(texts, outputs):
        prompt = tokenizer.encode(text, add_special_tokens=False)
        ids = torch.tensor([prompt + tokens[:-1]])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1:]
        out.append(logits.argmax(dim=-1).tolist())
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
    got = engine_greedy(model_dir, texts)
    assert [len(t) for t in got] == [NUM_TOKENS] * len(texts)
    assert got == hf_greedy_choices(hf, tokenizer, texts, got)


@pytest.mark.slow
def test_greedy_matches_transformers_on_awq_weights(awq_demo_model):
    """The AWQ checkpoint, dequantized into transformers' LlamaForCausalLM, against our engine reading the file."""
    from quant.evaluate import load_dequantized

    hf = load_dequantized(awq_demo_model, torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(awq_demo_model)
    texts = prompts(tokenizer)
    got = engine_greedy(str(awq_demo_model), texts)
    assert [len(t) for t in got] == [NUM_TOKENS] * len(texts)
    assert got == hf_greedy_choices(hf, tokenizer, texts, got)

"""Architectures other than Llama served by the Llama code, against transformers' own implementation on small
random weights (design.md §6): Qwen2 (Qwen2.5: q/k/v biases, tied embeddings, rope_theta 1e6)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from engine import LLM, SamplingParams
from engine.models.loader import CheckpointError
from test_engine_greedy import hf_greedy_choices

TEXTS = ["The quick brown fox", "1, 2, 3, 5, 8, 13,", "Hello"]


@pytest.fixture(scope="module")
def qwen2(demo_model, tmp_path_factory):
    """(folder, transformers model, tokenizer) of a 2-layer Qwen2 with random weights and biases, the demo
    model's tokenizer."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                      tie_word_embeddings=True, rms_norm_eps=1e-6)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers starts biases at 0: random ones, so that a lost bias shows
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if "bias" in name else 0.2)
    out = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


def test_qwen2_greedy_tokens_and_prompt_logprobs_equal_transformers(qwen2):
    folder, model, tokenizer = qwen2
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    llm = LLM(str(folder), device="cpu")
    got = [o.outputs[0].token_ids
           for o in llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    assert got == hf_greedy_choices(model, tokenizer, TEXTS, got) and all(len(set(t)) > 8 for t in got)
    ids = tokenizer.encode("In the beginning God created the heaven and the earth.", add_special_tokens=False)
    entries = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0].prompt_logprobs
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    for t in range(1, len(ids)):
        assert set(want[t - 1].topk(5).indices.tolist()) <= set(entries[t]) and len(entries[t]) <= 6, t
        assert all(abs(lp - want[t - 1, tok].item()) < 1e-4 for tok, lp in entries[t].items()), t
    unbiased = copy.deepcopy(model)  # the biases change the answer: without them transformers would choose otherwise
    with torch.no_grad():
        for name, p in unbiased.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    assert hf_greedy_choices(unbiased, tokenizer, TEXTS, got) != got


def test_sliding_window_is_refused(qwen2, tmp_path):
    folder, _, _ = qwen2
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="sliding-window"):
        LLM(str(tmp_path), device="cpu")

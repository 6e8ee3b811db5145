"""Architectures other than Llama served by the Llama code, against transformers' own implementation on small
random weights (design.md §6): Qwen2 (Qwen2.5: q/k/v biases, tied embeddings, rope_theta 1e6) and Qwen3 (an
RMSNorm over each head of q and k, head_dim set apart from hidden / heads); and scaled RoPE (Llama 3.1's
``llama3``, YaRN), with a short original context so that the scaling changes the answer."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from engine import LLM, SamplingParams
from engine.models.loader import CheckpointError
from test_engine_greedy import hf_greedy_choices

TEXTS = ["The quick brown fox", "1, 2, 3, 5, 8, 13,", "Hello"]


def _random_model(model, tokenizer, out, norms: bool = False):
    """Random weights (transformers starts biases at 0 and norms at 1: random ones, so that a lost one shows),
    saved with the tokenizer to ``out``; (folder, model, tokenizer)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.3 if "bias" in name else 0.2)
            elif norms:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model, tokenizer


@pytest.fixture(scope="module")
def qwen2(demo_model, tmp_path_factory):
    """(folder, transformers model, tokenizer) of a 2-layer Qwen2 with random weights and biases, the demo
    model's tokenizer."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                      tie_word_embeddings=True, rms_norm_eps=1e-6)
    return _random_model(Qwen2ForCausalLM(cfg).eval(), tokenizer, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def qwen3(demo_model, tmp_path_factory):
    """The same for a 2-layer Qwen3: q/k norms (random weights), head_dim 32 against hidden 64 / 4 heads."""
    torch.manual_seed(1)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
    return _random_model(Qwen3ForCausalLM(cfg).eval(), tokenizer, tmp_path_factory.mktemp("qwen3"), norms=True)


def _same_as_transformers(folder, model, tokenizer) -> list[list[int]]:
    """Assert our engine's greedy tokens and prompt logprobs equal transformers' (module doc); its tokens."""
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
    return got


def _changed_without(model, tokenizer, got, suffix: str, value: float) -> bool:
    """Whether transformers' greedy choices change with every parameter named ``*suffix`` set to ``value``."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith(suffix):
                p.fill_(value)
    return hf_greedy_choices(other, tokenizer, TEXTS, got) != got


def test_qwen2_greedy_tokens_and_prompt_logprobs_equal_transformers(qwen2):
    folder, model, tokenizer = qwen2
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    got = _same_as_transformers(folder, model, tokenizer)
    assert _changed_without(model, tokenizer, got, "bias", 0.0)  # the biases matter to the answer


def test_qwen3_greedy_tokens_and_prompt_logprobs_equal_transformers(qwen3):
    folder, model, tokenizer = qwen3
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    got = _same_as_transformers(folder, model, tokenizer)
    assert _changed_without(model, tokenizer, got, "q_norm.weight", 1.0)  # the q/k norms matter


def test_sliding_window_is_refused(qwen2, tmp_path):
    folder, _, _ = qwen2
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(CheckpointError, match="sliding-window"):
        LLM(str(tmp_path), device="cpu")


ROPE_CASES = {
    "llama3": (LlamaConfig, LlamaForCausalLM, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}),
    "yarn": (Qwen2Config, Qwen2ForCausalLM, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_scaled_rope_greedy_tokens_and_prompt_logprobs_equal_transformers(case, demo_model, tmp_path):
    make_cfg, make_model, rope = ROPE_CASES[case]
    torch.manual_seed(2)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    folder, model, _ = _random_model(make_model(make_cfg(**shape, rope_parameters=rope)).eval(), tokenizer, tmp_path)
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == case
    got = _same_as_transformers(folder, model, tokenizer)
    plain = make_model(make_cfg(**shape, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    plain.load_state_dict(model.state_dict())
    assert hf_greedy_choices(plain, tokenizer, TEXTS, got) != got  # the scaling matters to the answer


def test_mistral_sliding_window_equals_transformers(demo_model, tmp_path):
    """Mistral v0.1 attends over its last ``sliding_window`` tokens: a 2-layer random Mistral with a window of 6,
    whose prompts and answers run past it, gives transformers' greedy tokens and prompt logprobs; without the window
    transformers answers otherwise, so the window is what is checked; max_model_len may go past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(2)
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    cfg = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=6, rms_norm_eps=1e-6, attn_implementation="eager")
    folder, model, tokenizer = _random_model(MistralForCausalLM(cfg).eval(), tokenizer, tmp_path / "mistral")
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 6
    got = _same_as_transformers(folder, model, tokenizer)
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    assert hf_greedy_choices(full, tokenizer, TEXTS, got) != got  # the window matters to the answer
    assert LLM(str(folder), device="cpu").engine.max_model_len == 512


def test_max_model_len_over_the_model_context_is_refused(qwen2):
    folder, _, _ = qwen2
    with pytest.raises(ValueError, match="max_model_len: 513 is over the model's max_position_embeddings, 512 tokens"):
        LLM(str(folder), device="cpu", max_model_len=513)
    assert LLM(str(folder), device="cpu", max_model_len=512).engine.runner.model.rotary.cos_sin.shape == (512, 16)


def test_a_tied_lm_head_shares_the_embeddings_memory(qwen2):
    """tie_word_embeddings: the LM head is the embedding matrix itself, not a copy (a 152k x 3584 bf16 copy would be
    1 GiB of a consumer GPU's memory)."""
    folder, _, _ = qwen2
    model = LLM(str(folder), device="cpu").engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.data_ptr()

"""engine.models.rope and engine.models.context: the scaled RoPE frequencies against transformers' own
(``ROPE_INIT_FUNCTIONS``), the parsing of both config spellings, and the context each config allows."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.models.context import max_context
from engine.models.rope import RopeError, inv_freq, max_positions, rope_scaling
from kernels.rotary import rope_cos_sin

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("make, params", [
    (LlamaConfig, LLAMA31),
    (LlamaConfig, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    (Qwen2Config, QWEN_YARN),
    (Qwen2Config, {**QWEN_YARN, "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "truncate": False}),
], ids=["llama3", "linear", "yarn", "yarn-mscale"])
def test_scaled_frequencies_equal_transformers(make, params):
    cfg = make(hidden_size=4096, num_attention_heads=32, max_position_embeddings=32768, rope_parameters=params)
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    got, got_factor = inv_freq(rope_scaling(cfg.to_dict()), 128, 32768)
    default, _ = inv_freq(rope_scaling({"rope_theta": params["rope_theta"]}), 128, 32768)
    assert got.dtype == torch.float32 and got.shape == (64,)
    torch.testing.assert_close(got, want.float(), rtol=2e-7, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    assert (got != default).sum() >= 8  # the scaling changes the frequencies


def test_default_frequencies_are_bit_equal_to_transformers():
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, rope_theta=100000.0)
    rotary = LlamaRotaryEmbedding(cfg)
    got, got_factor = inv_freq(rope_scaling(cfg.to_dict()), 64, 8192)
    assert torch.equal(got, rotary.inv_freq) and got_factor == rotary.attention_scaling == 1.0


def test_the_table_carries_the_attention_factor():
    freq, factor = inv_freq(rope_scaling({"rope_parameters": QWEN_YARN}), 128, 32768)
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    plain, scaled = rope_cos_sin(128, 16, 1e6, inv_freq=freq), rope_cos_sin(128, 16, 1e6, None, freq, factor)
    torch.testing.assert_close(scaled, plain * factor, rtol=0, atol=0)


def test_old_config_spelling():
    """Hub configs before transformers 5: ``rope_scaling`` with ``type``, ``rope_theta`` at the top."""
    s = rope_scaling({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (s.rope_type, s.theta, s.factor()) == ("linear", 5e5, 2.0)
    s = rope_scaling({"rope_theta": 5e5, "rope_scaling": {k: v for k, v in LLAMA31.items() if k != "rope_theta"}})
    assert (s.rope_type, s.theta, s.params["low_freq_factor"]) == ("llama3", 5e5, 1.0)
    assert rope_scaling({}).theta == 10000.0 and rope_scaling({"rope_scaling": None}).rope_type == "default"


@pytest.mark.parametrize("cfg, match", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "rope_type 'yarn' needs 'factor' in rope_scaling"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "needs 'high_freq_factor'"),
])
def test_rope_not_served_is_refused(cfg, match):
    with pytest.raises(RopeError, match=match):
        rope_scaling(cfg)


@pytest.mark.parametrize("cfg, limit, why", [
    ({"max_position_embeddings": 131072, "rope_parameters": LLAMA31}, 131072, "max_position_embeddings"),
    ({"max_position_embeddings": 32768, "rope_parameters": QWEN_YARN}, 131072, "with its RoPE scaling"),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192, "RoPE scaling"),
    ({"max_position_embeddings": 2048, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 2048, "embeddings"),
    ({}, 4096, "max_position_embeddings"),
    ({"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768, "sliding_window": 4096}, 32768,
     "embeddings"),  # the window is attention's business (llama.sliding_window), not the context's
    ({"architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768, "sliding_window": None}, 32768,
     "embeddings"),
    ({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768, "sliding_window": 4096,
      "use_sliding_window": False}, 32768, "embeddings"),
], ids=["llama3", "yarn", "linear", "dynamic", "absent", "mistral-window", "mistral-no-window", "qwen2-window-off"])
def test_max_context(cfg, limit, why):
    got, reason = max_context(cfg)
    assert got == limit and why in reason
    assert max_positions(cfg) >= got


def test_defaults_follow_transformers():
    """A llama3 config without its original context takes max_position_embeddings; a yarn one without a factor
    takes max_position_embeddings over the original context; ``text_config: null`` is no text config."""
    params = {k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=8192, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got, _ = inv_freq(rope_scaling({"rope_parameters": params, "max_position_embeddings": 8192}), 128, 8192)
    torch.testing.assert_close(got, want.float(), rtol=2e-7, atol=0)
    yarn = rope_scaling({"max_position_embeddings": 131072, "text_config": None,
                         "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32768}})
    assert yarn.factor() == 4.0

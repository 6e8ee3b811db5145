"""Write a random-weight, Llama-shaped 4-bit AWQ checkpoint (weights cannot travel to the GPU machine).

The folder is a complete model for ``engine.LLM``: config.json with an AWQ-gemm ``quantization_config``,
model.safetensors (random codes, zero points of 7 or 8 and small fp16 scales; fp16 embeddings, norms and LM head) and a
word-level tokenizer whose vocabulary is "t0".."t{V-1}". Shapes default to Llama-2-7B.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def _awq_linear(k: int, n: int, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random codes; each zero point 7 or 8 at random. (Codes 0..15 average 7.5: with every zero at 8 each weight
    leans -0.5 scale, a common direction that grows through the layers until every prompt's greedy token is the
    same one, and an equality check of two paths' tokens cannot fail. Measured on a 4-layer model: 1 distinct token
    in 6 prompts x 24, against 38-50 with these zeros.)"""
    on = dict(device=gen.device, generator=gen)
    nibbles = 7 + torch.randint(0, 2, (k // group, n // 8, 8), dtype=torch.int64, **on)
    zeros = (nibbles << (4 * torch.arange(8, device=gen.device))).sum(-1)
    return {
        "qweight": torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, **on).cpu(),
        "qzeros": torch.where(zeros >= 2**31, zeros - 2**32, zeros).to(torch.int32).cpu(),
        "scales": (torch.rand(k // group, n, **on) * 0.004 + 0.001).half().cpu(),
    }


def _tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1", unk_token="t0")
    fast.save_pretrained(out)


def write_random_awq_model(out: str | Path, group_size: int = 128, device: str = "cuda", qkv_bias: bool = False,
                           qk_norm: bool = False, sliding_window: int = 0, seed: int = 0, **shape) -> Path:
    """Write the checkpoint to ``out`` and return it; ``shape`` overrides fields of :data:`LLAMA2_7B`;
    ``qkv_bias``: a Qwen2 checkpoint (Qwen2ForCausalLM: random fp16 biases on q/k/v); ``qk_norm``: a Qwen3 one
    (Qwen3ForCausalLM: per-head RMSNorm weights for q and k, random in [0.5, 1.5]); ``sliding_window`` > 0: a
    Mistral v0.1 one (MistralForCausalLM: each token attends over its last ``sliding_window`` tokens). The values
    depend only on ``seed`` (and ``device``'s generator), not on what drew random numbers before."""
    cpu, gen = torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed)
    cfg = {**LLAMA2_7B, **shape}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]  # Qwen3 sets it apart from hidden / heads
    q, kv = head_dim * cfg["num_attention_heads"], head_dim * cfg["num_key_value_heads"]
    tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=cpu) * 0.02).half(),
               "lm_head.weight": (torch.randn(v, h, generator=cpu) * 0.02).half(),
               "model.norm.weight": torch.ones(h).half()}
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(h).half()
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(h).half()
        for name, (k, n) in shapes.items():
            for t, value in _awq_linear(k, n, group_size, gen).items():
                tensors[f"{p}.{name}.{t}"] = value
            if qkv_bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                tensors[f"{p}.{name}.bias"] = (torch.randn(n, generator=cpu) * 0.5).half()
        if qk_norm:
            for name in ("q_norm", "k_norm"):
                tensors[f"{p}.self_attn.{name}.weight"] = (torch.rand(head_dim, generator=cpu) + 0.5).half()
    save_file(tensors, str(out / "model.safetensors"))
    arch, kind = (("Qwen3ForCausalLM", "qwen3") if qk_norm else ("Qwen2ForCausalLM", "qwen2") if qkv_bias else
                  ("MistralForCausalLM", "mistral") if sliding_window else ("LlamaForCausalLM", "llama"))
    config = {"architectures": [arch], "model_type": kind, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
              "bos_token_id": 1, "eos_token_id": 2, **cfg,
              **({"sliding_window": sliding_window} if sliding_window else {}),
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm"}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(out, v)
    return out

"""The KV cache's share of a GPU (``engine.memory.gpu_kv_budget``): what is left of gpu_memory_utilization (or of
the free memory) after the weights, the CUDA context, a step's activations and the sampler's [rows, V] float32
buffers at their peak (arithmetic only: the buffer count is measured by bench/sampler_memory.py); and the tuner's
plan, which must be one the engine starts with."""
import json

from appliance import tuner
from appliance.hardware import GPU, Hardware
from appliance.tuner import ModelInfo
from engine.config import EngineConfig
from engine.memory import (CUDA_CONTEXT_BYTES, NON_TORCH_BYTES, PLAN_MARGIN_BYTES, PROMPT_LOGPROBS_BUFFERS,
                           PROMPT_LOGPROBS_ROWS, SAMPLER_BUFFERS, default_step_tokens, gpu_kv_budget)
from engine.prompt_logprobs import ROWS_PER_PASS

GIB = 2**30
QWEN = dict(hidden=3584, itemsize=2, vocab=152064)  # Qwen2.5-7B in bf16
ACTIVATIONS = 4 * 16 * 2048 * 3584 * 2  # a 2048-token step


def test_the_sampler_buffers_of_every_sequence_come_out_of_the_kv_cache():
    budget = gpu_kv_budget(24 * GIB, 24 * GIB, 6 * GIB, 0.9, 2048, max_num_seqs=256, **QWEN)
    assert (SAMPLER_BUFFERS, PROMPT_LOGPROBS_BUFFERS, PROMPT_LOGPROBS_ROWS, ROWS_PER_PASS) == (10, 3, 256, 256)
    assert 0.9 * 24 * GIB - 6 * GIB - NON_TORCH_BYTES - ACTIVATIONS - budget == 4 * 152064 * 10 * 256  # 1.6 GB


def test_with_few_sequences_a_prompt_logprobs_pass_is_the_larger():
    few = gpu_kv_budget(24 * GIB, 24 * GIB, 6 * GIB, 0.9, 2048, max_num_seqs=8, **QWEN)
    none = gpu_kv_budget(24 * GIB, 24 * GIB, 6 * GIB, 0.9, 2048, max_num_seqs=0, **QWEN)
    assert few == none
    assert 0.9 * 24 * GIB - 6 * GIB - NON_TORCH_BYTES - ACTIVATIONS - few == 4 * 152064 * 3 * 256


def test_memory_other_processes_hold_is_not_taken_twice():
    """vLLM V1's reading: the engine takes utilization x total, or what is free at its start if less; the weights
    are counted once (the engine: what the free memory fell by while they loaded)."""
    free = gpu_kv_budget(24 * GIB, 24 * GIB, 6 * GIB, 0.5, 2048, max_num_seqs=8, **QWEN)
    busy = gpu_kv_budget(24 * GIB, 14 * GIB, 6 * GIB, 0.5, 2048, max_num_seqs=8, **QWEN)  # 10 GiB held elsewhere
    tight = gpu_kv_budget(24 * GIB, 10 * GIB, 6 * GIB, 0.5, 2048, max_num_seqs=8, **QWEN)
    assert free == busy and free - tight == 2 * GIB


def test_a_long_context_does_not_grow_the_step():
    """With chunked prefill a step computes 2048 tokens whatever max_model_len is (a 131k context would otherwise
    reserve 64 GiB of activations); without it, a whole prompt."""
    assert EngineConfig(model="unused").token_budget(131072) == default_step_tokens(256, 131072) == 2048
    assert EngineConfig(model="unused", max_num_seqs=4096).token_budget(131072) == 4096
    assert EngineConfig(model="unused", enable_chunked_prefill=False).token_budget(8192) == 8192


def test_the_engine_gets_at_least_the_tuners_plan(tmp_path):
    """Qwen2.5-7B-AWQ-shaped on a 24 GiB GPU with 2 GiB held by a desktop: the engine, which reads the free memory
    after making its CUDA context and counts the RoPE table among its weights, gets the plan's KV blocks and the
    margin; the plan's max_model_len fits in them. A GPTQ checkpoint with act-order counts its q/k/v and gate/up
    linears dequantized (the engine cannot keep them packed)."""
    cfg = {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "max_position_embeddings": 32768, "vocab_size": 152064}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(5 * GIB)
    gpu = GPU(0, "RTX 4090", 24 * GIB, 22 * GIB, "8.9")
    hw = Hardware(kind="cuda", gpus=[gpu], driver="1", cpu_cores=16, total_memory=64 * GIB, available_memory=60 * GIB)
    info = ModelInfo.from_dir(tmp_path)
    plan = tuner.plan(info, hw)
    engine = EngineConfig(model="unused", gpu_memory_utilization=plan.gpu_memory_utilization,
                          max_num_seqs=plan.max_num_seqs, max_model_len=plan.max_model_len)
    rope = 4 * plan.max_model_len * 128
    assert info.gpu_extra_bytes == 4 * 32768 * 128 and rope <= info.gpu_extra_bytes
    budget = gpu_kv_budget(gpu.total_memory, gpu.free_memory - CUDA_CONTEXT_BYTES, 5 * GIB + rope,
                           engine.gpu_memory_utilization, engine.token_budget(plan.max_model_len), 3584, 2,
                           engine.max_num_seqs, 152064)
    block = 16 * info.kv_bytes_per_token()
    assert plan.num_kv_blocks == int((budget - PLAN_MARGIN_BYTES) // block) and plan.num_kv_blocks < budget // block
    assert plan.max_model_len == 32768 <= plan.kv_tokens and plan.max_num_seqs == 256
    assert plan.gpu_memory_utilization == 0.89  # (22 - 0.5) / 24, rounded down
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    stacked = 28 * (3584 * 128 * (28 + 2 * 4) + 2 * 3584 * 18944)  # q/k/v and gate/up weights
    assert ModelInfo.from_dir(tmp_path).gpu_extra_bytes == 4 * 32768 * 128 + stacked * 3 // 2
    for actorder, dequantized in (("group", True), ("weight", False), (None, False)):
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                   "actorder": actorder}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert ModelInfo.from_dir(tmp_path).gpu_extra_bytes == 4 * 32768 * 128 + dequantized * (stacked * 3 // 2)


def test_the_engine_budgets_for_the_step_the_plan_gives_it(tmp_path):
    """Llama-3.1-8B AWQ on an 8 GiB card with a desktop and 256-token steps given: the plan's step, passed to the
    engine as max_num_batched_tokens (the config key), is the step the engine reserves activations for (arithmetic
    only: this plan's one GPU check ran out of memory at start-up, bench/RESULTS.md run 124)."""
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "max_position_embeddings": 131072, "vocab_size": 128256,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(5_730_000_000)
    gpu = GPU(0, "RTX 4060 Ti", 8 * GIB, int(7.4 * GIB), "8.9")
    hw = Hardware(kind="cuda", gpus=[gpu], driver="1", cpu_cores=8, total_memory=32 * GIB, available_memory=28 * GIB)
    info = ModelInfo.from_dir(tmp_path)
    plan = tuner.plan(info, hw, max_num_batched_tokens=256)
    assert plan.max_num_batched_tokens == 256
    engine = EngineConfig(model="unused", gpu_memory_utilization=plan.gpu_memory_utilization,
                          max_num_seqs=plan.max_num_seqs, max_model_len=plan.max_model_len,
                          max_num_batched_tokens=plan.max_num_batched_tokens)
    assert engine.token_budget(plan.max_model_len) == 256
    budget = gpu_kv_budget(gpu.total_memory, gpu.free_memory - CUDA_CONTEXT_BYTES,
                           5_730_000_000 + 4 * plan.max_model_len * 128, engine.gpu_memory_utilization, 256, 4096, 2,
                           engine.max_num_seqs, 128256)
    block = 16 * info.kv_bytes_per_token()
    assert plan.num_kv_blocks <= int((budget - PLAN_MARGIN_BYTES) // block) and plan.max_model_len <= plan.kv_tokens

"""appliance.tuner: exact plans for given (fake) hardware and model configs; explicit values win."""
import json

import pytest

from appliance import tuner
from appliance.hardware import GPU, Hardware
from appliance.tuner import ModelInfo, TuneError

GIB = 2**30

SMOLLM2 = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192}
LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072, "vocab_size": 128256,
            "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}


def model_dir(tmp_path, cfg, weight_bytes):
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)  # sparse: only the size matters
    return tmp_path


def cpu(cores=2, available=20 * GIB, bf16=False):
    return Hardware(kind="cpu", cpu_cores=cores, total_memory=24 * GIB, available_memory=available, cpu_bf16=bf16,
                    reason="test")


def gpu(total, free):
    return Hardware(kind="cuda", gpus=[GPU(0, "Fake GPU", total, free, "9.0")], driver="1", cpu_cores=16,
                    total_memory=128 * GIB, available_memory=100 * GIB)


def test_model_info_from_config(tmp_path):
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 5 * GIB))
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.max_context, info.weight_bytes,
            info.quantization) == (32, 8, 128, 131072, 5 * GIB, "awq")
    assert info.max_context_why == "the model's max_position_embeddings"
    assert info.kv_bytes_per_token() == 131072 and info.kv_bytes_per_token("fp8") == 65536
    assert info.kv_bytes_per_token("int8") == 2 * 32 * 8 * (128 + 4) == 67584  # codes + an fp32 scale per head
    assert info.kv_bytes_per_token("int8", device="cpu") == 67584
    assert info.kv_bytes_per_token(device="cpu") == 262144  # float32 on the CPU
    assert info.kv_bytes_per_token(device="cpu", dtype="bfloat16") == 131072
    assert info.kv_bytes_per_token(device="cuda", dtype="float32") == 262144


def test_cpu_plan_for_the_demo_model(tmp_path):
    plan = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, SMOLLM2, 100 * 2**20)), cpu())
    assert plan.device == "cpu"
    assert plan.kv_bytes_per_token == 46080  # 2 x 30 layers x 3 heads x 64 dims x 4 bytes (float32 on CPU)
    assert plan.cpu_kv_cache_gib == 2.0  # 10% of 20 GiB
    assert plan.num_kv_blocks == 2912  # 2 GiB // (16 x 46080)
    assert plan.max_model_len == 4096  # CPU cap below the model's 8192
    assert plan.max_num_seqs == 8  # 4 per core x 2 cores
    assert plan.expected_concurrency == 8
    assert plan.kv_cache_dtype == "auto"
    assert plan.dtype == "float32"  # this CPU has no bfloat16 instructions
    assert "no bfloat16 instructions" in plan.reasons["dtype"]
    assert set(plan.reasons) == {"device", "gpu_memory_utilization", "cpu_kv_cache_gib", "max_model_len",
                                 "max_num_seqs", "kv_cache_dtype", "dtype", "num_kv_blocks", "expected_concurrency",
                                 "max_num_batched_tokens"}
    assert plan.reasons["device"] == "no GPU to serve on (test)"  # detect's reason
    assert plan.max_num_batched_tokens is None  # the engine's default
    assert all(plan.reasons.values())
    on_gpu = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, SMOLLM2, 100 * 2**20)), gpu(24 * GIB, 24 * GIB))
    assert on_gpu.reasons["device"] == "Fake GPU, 24.0 GiB, compute capability 9.0"


def test_cpu_plan_on_a_cpu_with_bf16_instructions(tmp_path):
    """bfloat16 compute: the KV cache of "auto" takes 2 bytes a value, so the same RAM holds twice the blocks."""
    plan = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, SMOLLM2, 100 * 2**20)), cpu(bf16=True))
    assert plan.dtype == "bfloat16" and "bfloat16 instructions" in plan.reasons["dtype"]
    assert plan.kv_bytes_per_token == 23040  # 2 x 30 layers x 3 heads x 64 dims x 2 bytes
    assert plan.num_kv_blocks == 5825  # 2 GiB // (16 x 23040)
    assert "(bfloat16)" in plan.reasons["kv_cache_dtype"]
    forced = tuner.plan(ModelInfo.from_dir(tmp_path), cpu(bf16=True), dtype="float32")
    assert forced.dtype == "float32" and forced.reasons["dtype"] == "set by --dtype"
    assert forced.kv_bytes_per_token == 46080 and forced.num_kv_blocks == 2912


def test_a_dtype_no_engine_takes_is_refused(tmp_path):
    with pytest.raises(TuneError, match="--dtype must be auto, float32, bfloat16 or float16, got 'int4'"):
        tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, SMOLLM2, 1)), cpu(), dtype="int4")


def test_float32_is_refused_on_a_gpu_and_16_bit_dtypes_plan_alike(tmp_path):
    """The GPU plan counts 16-bit weights and activations, which float32 would double: refused, with the fix."""
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    with pytest.raises(TuneError, match="--dtype float32 is the CPU's exact reference path") as exc:
        tuner.plan(info, gpu(80 * GIB, 80 * GIB), dtype="float32")
    assert "--dtype auto" in exc.value.hint
    plans = [tuner.plan(info, gpu(80 * GIB, 80 * GIB), dtype=d) for d in ("auto", "bfloat16", "float16")]
    assert {(p.num_kv_blocks, p.kv_bytes_per_token) for p in plans} == {(33261, 131072)}
    assert [p.dtype for p in plans] == ["auto", "bfloat16", "float16"]


def test_cpu_plan_on_a_small_machine(tmp_path):
    plan = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, SMOLLM2, 1)), cpu(cores=1, available=GIB))
    assert plan.cpu_kv_cache_gib == 0.25  # the smallest step
    assert plan.num_kv_blocks == 364
    assert plan.max_model_len == 4096 and plan.max_num_seqs == 4 and plan.expected_concurrency == 4


def test_gpu_plan_on_a_free_gpu(tmp_path):
    plan = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB)), gpu(80 * GIB, 80 * GIB))
    assert plan.device == "cuda"
    assert plan.gpu_memory_utilization == 0.9
    # engine.memory's plan: (72 GiB - 4 of weights - 64 MiB of RoPE table (131072 x 128 fp32) - 0.5 CUDA context
    # etc. - 1 of activations (64 [2048, 4096] bf16 buffers) - 4 x 128256 x 2560 B of sampler buffers - 0.25 of
    # margin) // (16 x 128 KiB)
    assert plan.num_kv_blocks == 33261
    assert plan.max_model_len == 131072  # the model's own limit; the cache holds 532,176 tokens
    assert plan.max_num_seqs == 256
    assert plan.expected_concurrency == 256
    assert plan.cpu_kv_cache_gib == 0.0
    assert plan.dtype == "auto"
    assert plan.reasons["dtype"] == "bfloat16, the engine's default on a GPU (the checkpoint names no 16-bit dtype)"
    assert "(bfloat16)" in plan.reasons["kv_cache_dtype"]


def test_gpu_plan_takes_the_dtype_the_checkpoint_names(tmp_path):
    """vLLM's auto: an AWQ checkpoint's float16 (transformers 5 writes "dtype"); a float32 one runs in bfloat16."""
    named = "the checkpoint's dtype (config.json), as vLLM's auto"
    fallback = "the engine's default on a GPU (the checkpoint names no 16-bit dtype)"
    for cfg, reason in (({"dtype": "float16"}, f"float16, {named}"),
                        ({"torch_dtype": "bfloat16"}, f"bfloat16, {named}"),
                        ({"torch_dtype": "float32"}, f"bfloat16, {fallback}")):
        info = ModelInfo.from_dir(model_dir(tmp_path, {**LLAMA_8B, **cfg}, 4 * GIB))
        plan = tuner.plan(info, gpu(80 * GIB, 80 * GIB))
        assert plan.dtype == "auto" and plan.reasons["dtype"] == reason
        assert f"({reason.split(',')[0]})" in plan.reasons["kv_cache_dtype"]
        assert plan.num_kv_blocks == 33261  # 16-bit either way: the same plan


def test_gpu_plan_when_other_processes_hold_memory(tmp_path):
    plan = tuner.plan(ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB)), gpu(24 * GIB, 12 * GIB))
    assert plan.gpu_memory_utilization == 0.47  # (12 - 0.5) / 24, rounded down
    # (11.28 - 4 - 1/16 - 0.5 - 1 - 0.25) GiB - 4 x 128256 x 2560 B at 256 sequences: 2173 blocks, 34768 tokens,
    # 256 each for only 135; with fewer sequences' sampler buffers the cache grows: 151 is the most it holds 256
    # tokens for (4 x 128256 x 1510 B: 2429 blocks, 38864 tokens >= 151 x 256; 152: 2427 blocks < 152 x 16)
    assert plan.max_num_seqs == 151 and "for only 151 sequences" in plan.reasons["max_num_seqs"]
    assert plan.num_kv_blocks == 2429
    assert plan.max_model_len == 38864  # what the KV cache holds
    assert plan.expected_concurrency == 37  # 38864 / 1024
    assert plan.max_num_batched_tokens is None  # the engine's default, 2048: big GPUs' configs stay as they were
    assert "vLLM's 2048 tokens a step" in plan.reasons["max_num_batched_tokens"]
    assert "12.0 GiB of 24.0 GiB is free" in plan.reasons["gpu_memory_utilization"]


def test_an_8_gib_card_with_a_desktop_and_an_8b_model(tmp_path):
    """Llama-3.1-8B AWQ (5.73 GB of files) on an 8 GiB card with 0.6 GiB held by a desktop: a 2048-token step's
    activations (1 GiB) leave no KV cache, so the plan is refused, saying what helps; with 256-token steps given
    the plan takes the sequences whose sampler buffers still leave 256 tokens each (the automatic fallback to them
    ran out of memory on a GPU: appliance/tuner.py DEFAULT_STEP_TOKENS), and its reason says so."""
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 5_730_000_000))
    with pytest.raises(TuneError, match="leaves no room for a KV cache in 86% of the 8.0 GiB GPU") as err:
        tuner.plan(info, gpu(8 * GIB, int(7.4 * GIB)))
    assert err.value.hint == "close programs holding GPU memory (0.6 GiB) or use a smaller model"
    plan = tuner.plan(info, gpu(8 * GIB, int(7.4 * GIB)), max_num_batched_tokens=256)
    # 0.86 x 8 GiB - 5.34 of weights - 1/16 RoPE table - 0.5 - 64 x [256, 4096] bf16 (1/8) - 4 x 128256 x 768 B of
    # sampler (the prompt-logprobs pass's, above 7 rows') - 0.25 = 0.239 GiB: 122 blocks of 16 x 128 KiB
    assert (plan.gpu_memory_utilization, plan.max_num_batched_tokens, plan.num_kv_blocks) == (0.86, 256, 122)
    assert (plan.max_model_len, plan.max_num_seqs) == (1952, 7)  # 7 x 256 <= 1952 < 8 x 256
    assert "careful: the memory plan's reserves fell short" in plan.reasons["max_num_batched_tokens"]
    assert plan.reasons["max_model_len"].endswith("a short context: --kv-cache-dtype int8 (or fp8 on Ada and "
                                                  "Hopper) about doubles it")
    int8 = tuner.plan(info, gpu(8 * GIB, int(7.4 * GIB)), kv_cache_dtype="int8", max_num_batched_tokens=256)
    assert int8.max_model_len == 3792 and "short context" not in int8.reasons["max_model_len"]  # 132 B a head


def test_a_step_given_caps_the_sequences(tmp_path):
    """A step below vLLM's 256 sequences caps them (the engine refuses a step below max_num_seqs: the service
    would not start after the install), on a GPU and on a CPU."""
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    plan = tuner.plan(info, gpu(80 * GIB, 80 * GIB), max_num_batched_tokens=64)
    assert (plan.max_num_batched_tokens, plan.max_num_seqs) == (64, 64)
    assert plan.reasons["max_num_seqs"] == "at most --max-num-batched-tokens 64: one token a sequence a step"
    plan = tuner.plan(info, cpu(cores=8), max_num_batched_tokens=8)
    assert (plan.max_num_batched_tokens, plan.max_num_seqs) == (8, 8)  # 4 a core x 8 would be 16


def test_a_short_card_plans_the_most_sequences_its_cache_holds_256_tokens_for(tmp_path):
    """The sequences where the cache is short: the most whose sampler buffers leave 256 tokens each (74 here:
    above that the buffers of the prompt-logprobs minimum, 768 rows, give way to 10 a sequence)."""
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    # 0.85 x 10 GiB - 4 - 1/16 - 0.5 - 1 (activations) - 0.37 (sampler) - 0.25: 1,188 blocks, 19,008 tokens
    plan = tuner.plan(info, gpu(10 * GIB, 9 * GIB))
    assert (plan.max_num_batched_tokens, plan.max_model_len, plan.max_num_seqs) == (None, 19008, 74)
    assert plan.reasons["max_num_seqs"] == ("the KV cache holds 256 tokens for only 74 sequences (each takes sampler "
                                            "buffers from it)")


def test_most_sequences_is_the_largest_count_the_cache_holds_256_tokens_for():
    from appliance.tuner import _most_sequences

    assert _most_sequences(lambda n: 1000 - n, 256) == 3  # 997 >= 3 x 256; 996 < 4 x 256
    assert _most_sequences(lambda n: 10**6, 256) == 256 and _most_sequences(lambda n: 100, 256) == 1


def test_explicit_values_win(tmp_path):
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    plan = tuner.plan(info, gpu(80 * GIB, 80 * GIB), gpu_memory_utilization=0.5, max_num_seqs=4,
                      max_model_len=2048, kv_cache_dtype="fp8")
    assert (plan.gpu_memory_utilization, plan.max_num_seqs, plan.max_model_len, plan.kv_cache_dtype) == \
        (0.5, 4, 2048, "fp8")
    assert plan.num_kv_blocks == 34632  # (40 - 4 - 1/16 - 0.5 - 1 - 0.25 GiB - 4 x 128256 x 768 B) // (16 x 64 KiB)
    assert plan.expected_concurrency == 4
    for key in ("gpu_memory_utilization", "max_num_seqs", "max_model_len", "kv_cache_dtype"):
        assert plan.reasons[key].startswith("set by --")


def test_impossible_requests_are_errors(tmp_path):
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    with pytest.raises(TuneError, match="over the model's limit"):
        tuner.plan(info, cpu(), max_model_len=200000)
    with pytest.raises(TuneError, match="does not fit in the KV cache"):
        tuner.plan(info, cpu(available=GIB), max_model_len=100000)
    with pytest.raises(TuneError, match="leaves no room for a KV cache in 87% of the 4.0 GiB GPU") as err:
        tuner.plan(info, gpu(4 * GIB, 4 * GIB))
    assert err.value.hint == "use a smaller model"  # the share is what is free: raising it would gain nothing
    with pytest.raises(TuneError) as err:
        tuner.plan(info, gpu(8 * GIB, 4 * GIB))
    assert err.value.hint == "close programs holding GPU memory (4.0 GiB) or use a smaller model"
    with pytest.raises(TuneError) as err:  # what was given and would help is named
        tuner.plan(info, gpu(8 * GIB, 8 * GIB), gpu_memory_utilization=0.5, max_num_seqs=64,
                   max_num_batched_tokens=2048)
    assert err.value.hint == ("raise --gpu-memory-utilization, lower --max-num-seqs, lower --max-num-batched-tokens "
                              "or use a smaller model")
    with pytest.raises(TuneError, match="--max-num-batched-tokens must be at least 1, got 0"):
        tuner.plan(info, cpu(), max_num_batched_tokens=0)
    with pytest.raises(TuneError, match="--max-num-batched-tokens 8 is below --max-num-seqs 16"):
        tuner.plan(info, cpu(), max_num_seqs=16, max_num_batched_tokens=8)
    with pytest.raises(TuneError, match="gpu-memory-utilization"):
        tuner.plan(info, cpu(), gpu_memory_utilization=1.5)
    with pytest.raises(TuneError, match="kv-cache-dtype"):
        tuner.plan(info, cpu(), kv_cache_dtype="fp4")


MISTRAL_V01 = {"architectures": ["MistralForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
               "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
               "sliding_window": 4096}


def test_a_sliding_window_does_not_cap_the_plan(tmp_path):
    """Mistral v0.1's 4096-token window is served (engine.models.llama.sliding_window): the plan may go to the
    model's 32,768 positions, and a flag over them is refused."""
    info = ModelInfo.from_dir(model_dir(tmp_path, MISTRAL_V01, 4 * GIB))
    assert info.max_context == 32768 and info.max_context_why == "the model's max_position_embeddings"
    plan = tuner.plan(info, gpu(24 * GIB, 24 * GIB), max_model_len=16384)
    assert plan.max_model_len == 16384
    with pytest.raises(TuneError, match="over the model's limit of 32768 tokens .the model's max_position_embeddings"):
        tuner.plan(info, gpu(24 * GIB, 24 * GIB), max_model_len=32769)


def test_scaled_rope_lengthens_and_unknown_rope_is_an_error(tmp_path):
    yarn = {**SMOLLM2, "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert ModelInfo.from_dir(model_dir(tmp_path, yarn, GIB)).max_context == 131072
    longrope = {**SMOLLM2, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(TuneError, match="rope_type 'longrope' is not supported") as err:
        ModelInfo.from_dir(model_dir(tmp_path, longrope, GIB))
    assert err.value.hint == "serve a model with a supported RoPE"


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(TuneError, match="no config.json"):
        ModelInfo.from_dir(tmp_path)


@pytest.mark.parametrize("capability,ok", [("8.6", False), ("8.9", True), ("9.0", True)])
def test_fp8_kv_cache_needs_ada_or_hopper(tmp_path, capability, ok):
    """fp8 has no conversions below compute capability 8.9: the tuner refuses it there (the engine would too, at
    start), with the fix (int8, which works everywhere: about 1.94x the tokens of bf16 in the same memory)."""
    info = ModelInfo.from_dir(model_dir(tmp_path, LLAMA_8B, 4 * GIB))
    hw = Hardware(kind="cuda", gpus=[GPU(0, "RTX 3090", 24 * GIB, 24 * GIB, capability)], driver="1", cpu_cores=16,
                  total_memory=128 * GIB, available_memory=100 * GIB)
    if ok:
        assert tuner.plan(info, hw, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    else:
        with pytest.raises(TuneError, match="fp8 needs compute capability 8.9") as e:
            tuner.plan(info, hw, kv_cache_dtype="fp8")
        assert e.value.hint == "use --kv-cache-dtype int8 (any GPU) or auto"
    int8, auto = tuner.plan(info, hw, kv_cache_dtype="int8"), tuner.plan(info, hw)
    assert (int8.kv_cache_dtype, int8.kv_bytes_per_token) == ("int8", 67584)
    assert abs(int8.kv_tokens / auto.kv_tokens - 256 / 132) < 1e-3  # the same memory: 256 / 132 the tokens
    assert "(128 dims + a 4-byte scale)" in int8.reasons["num_kv_blocks"]
    with pytest.raises(TuneError, match="must be auto, fp8 or int8, got 'int4'"):
        tuner.plan(info, hw, kv_cache_dtype="int4")

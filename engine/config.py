"""Engine configuration: one typed dataclass, filled by the offline ``LLM`` API or by ``appliance serve``."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.memory import default_step_tokens


def field_docs(cls) -> dict[str, str]:
    """{field: its description} from a dataclass docstring's "``field``: text" entries, whitespace collapsed
    (the server's ``--help`` text)."""
    entries = re.findall(r"``(\w+)``: (.*?)(?=\n\s*``\w+``:|\n\s*\n|\Z)", cls.__doc__ or "", re.S)
    return {name: " ".join(text.split()) for name, text in entries}


#: The oldest GPUs the engine runs on: Ampere (compute capability 8.0). Its Triton kernels use bf16 and the
#: ``mma.sync`` shapes of sm_80 PTX, which ptxas refuses for Turing's sm_75
#: (tests/test_compile_targets.py::test_turing_is_refused_by_ptxas).
MIN_CAPABILITY = (8, 0)


#: ``EngineConfig.dtype``'s settings ("auto": :func:`compute_dtype`) and ``kv_cache_dtype``'s
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: ``max_model_len`` when not given: the model's context, capped at this
DEFAULT_MAX_MODEL_LEN = 8192


def checkpoint_dtype(model_config: dict) -> str | None:
    """The float dtype a config.json dict names for its weights: transformers' ``dtype`` (``torch_dtype`` before
    transformers 4.56), a multimodal config's in its ``text_config``; None when it names none of float32,
    bfloat16 and float16."""
    for cfg in (model_config, model_config.get("text_config") or {}):
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(name, str) and name.removeprefix("torch.") in DTYPES[1:]:
            return name.removeprefix("torch.")
    return None


def compute_dtype(dtype: str, device_type: str, checkpoint: str | None = None) -> str:
    """The dtype name the engine computes in for the setting ``dtype`` on a ``device_type`` ("cuda" or "cpu") device,
    serving a checkpoint whose config.json names ``checkpoint`` (:func:`checkpoint_dtype`). "auto" is float32 on
    CPU (the exact reference path); on CUDA it is vLLM's rule: the checkpoint's own float16 or bfloat16, and
    bfloat16 for a float32 checkpoint or one that names none (where vLLM would look at the safetensors' dtype).
    AWQ and GPTQ checkpoints name float16 (their scales are fp16), so they run in float16 as in vLLM. Any other
    setting is itself."""
    if dtype != "auto":
        return dtype
    if device_type == "cpu":
        return "float32"
    return checkpoint if checkpoint in ("float16", "bfloat16") else "bfloat16"


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    ``model``: a Hugging Face-style folder (config.json, *.safetensors, tokenizer files); unquantized or with a
    ``quantization_config`` (AWQ gemm, GPTQ, compressed-tensors; design.md §5).
    ``served_model_name``: the model's name in the API (``/v1/models``, the ``model`` field); None = the
    folder's name.
    ``tokenizer``: a folder with the tokenizer files; None = ``model``.
    ``device``: "auto" (CUDA when available, else CPU), "cuda" or "cpu".
    ``dtype``: of activations and unquantized weights: "auto" (float32 on CPU, the exact reference path; on
    CUDA the checkpoint's float16 or bfloat16, else bfloat16: :func:`compute_dtype`), "float32", "bfloat16" or
    "float16".
    ``gpu_memory_utilization``: the fraction of the GPU's total memory the engine may use (weights, activations,
    the sampler's buffers for ``max_num_seqs`` rows, and the KV cache, which gets the rest:
    ``engine.memory.gpu_kv_budget``), in (0, 1]; as in vLLM V1, other processes' memory is not counted in it, but
    the engine takes no more than is free when it starts.
    ``cpu_kv_cache_gib``: GiB of KV cache on CPU.
    ``max_num_seqs``: sequences running at once (one step's batch at most).
    ``block_size``: tokens per KV cache block.
    ``max_model_len``: prompt + completion tokens per sequence, at most the model's context
    (``engine.models.context.max_context``: ``max_position_embeddings`` with its RoPE scaling); None = that context
    capped at :data:`DEFAULT_MAX_MODEL_LEN`.
    ``num_kv_blocks``: force the KV pool size (tests); None = size it from ``gpu_memory_utilization`` on CUDA or
    ``cpu_kv_cache_gib`` on CPU.
    ``max_num_batched_tokens``: token budget of one step (decode tokens + prefill tokens); None = 2048 with chunked
    prefill (vLLM V1's for a server on a consumer GPU; a longer prompt is prefilled in chunks), else
    max(max_model_len, 2048); at least ``max_num_seqs`` (every running sequence can decode in one step). Given,
    at least ``max_num_seqs``, and without chunked prefill at least ``max_model_len`` (every prompt fits one
    step). The KV budget keeps a step's activations free (``engine.memory``).
    ``enforce_eager``: no CUDA graphs: every step launches its kernels one by one.
    ``enable_chunked_prefill``: decodes first, then prefills split into chunks that fit the rest of the budget,
    in one mixed step (vLLM V1); False: prefill-only or decode-only steps, whole prompts (scheduler.py).
    ``enable_prefix_caching``: reuse the K/V of full blocks whose whole prefix matches (block_manager.py).
    ``swap_space``: GiB of CPU memory for the K/V of preempted sequences (vLLM's ``--swap-space``); 0 = preempt by
    recompute only.
    ``kv_cache_dtype``: "auto" = the model dtype; "fp8" = float8 e4m3 (vLLM's ``fp8``, scale 1: values saturate
    at +-448), half the bytes of bf16 per token, converted to the model dtype in the attention kernels; on CUDA it
    needs compute capability 8.9+ (Ada, Hopper); "int8" = int8 codes with one fp32 scale per token and KV head,
    computed as the token is written (``kernels.kv_cache.quantize_int8_ref``): 132 bytes per head of 128 against
    bf16's 256; needs no fp8 conversions (so it suits Ampere's RTX 30 series: measured on an H200 only) and works
    on the CPU.
    ``async_scheduling``: schedule and launch the next step before reading the last one back, so host work
    overlaps the device (vLLM's ``--async-scheduling``; llm_engine.py); None = on for CUDA, off on CPU (where
    nothing runs asynchronously; tests turn it on there to check it gives the same tokens).
    ``tune_kernels``: on CUDA, time the W4A16 kernel plans of the model's 4-bit products that this GPU's plan file
    lacks, at start-up, and add them to the file (engine/kernel_plans.py; a first start takes up to a few minutes
    longer); False: use the plans already in the file, and the built-in ones for the rest.
    ``kernel_plans_dir``: the folder of the plan files (one per GPU and software version); None =
    ``$XDG_CACHE_HOME/appliance/kernel-plans`` (``~/.cache/...``).
    ``seed``: of the generator that samples requests without a seed of their own.

    Raises ValueError("<field>: ...") for a value out of range; :meth:`token_budget` checks the budget against
    ``max_model_len`` once the engine knows it.
    """

    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    async_scheduling: bool | None = None
    tune_kernels: bool = True
    kernel_plans_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device: must be auto, cuda or cpu, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:  # 0 once meant "auto" by accident
            raise ValueError(f"max_model_len: must be at least 1, got {self.max_model_len} (leave it out for the "
                             f"model's context, at most {DEFAULT_MAX_MODEL_LEN})")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be auto, fp8 or int8, got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space: must be at least 0 GiB, got {self.swap_space}")
        if not self.cpu_kv_cache_gib > 0:  # NaN too
            raise ValueError(f"cpu_kv_cache_gib: must be above 0 GiB, got {self.cpu_kv_cache_gib}")
        if self.max_num_batched_tokens is not None:
            self.token_budget(self.max_model_len or 0)  # the engine checks again once it knows max_model_len

    def token_budget(self, max_model_len: int) -> int:
        """The tokens one step may compute, for an engine of ``max_model_len`` (vLLM's checks).

        Raises ValueError when ``max_num_batched_tokens`` is below 1 or ``max_num_seqs``, or, without chunked
        prefill, below ``max_model_len``.
        """
        budget = self.max_num_batched_tokens
        if budget is None:
            return default_step_tokens(self.max_num_seqs, max_model_len, self.enable_chunked_prefill)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens: must be at least 1, got {budget}")
        if budget < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens: {budget} is smaller than max_num_seqs={self.max_num_seqs}; "
                             "every running sequence must be able to decode in one step")
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens: {budget} is smaller than max_model_len={max_model_len}, "
                             "so a long prompt could never be scheduled; raise max_num_batched_tokens, lower "
                             "max_model_len or set enable_chunked_prefill")
        return budget

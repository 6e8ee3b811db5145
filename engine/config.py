"""Engine configuration: one typed dataclass, filled by the offline ``LLM`` API or by ``appliance serve``."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    ``model``: a Hugging Face-style folder (config.json, *.safetensors, tokenizer files); unquantized or with a
    ``quantization_config`` (AWQ gemm, GPTQ, compressed-tensors; design.md §5).
    ``device``: "auto" (CUDA when available, else CPU), "cuda" or "cpu".
    ``max_model_len``: prompt + completion tokens per sequence; None = the model's ``max_position_embeddings``
    capped at 8192.
    ``num_kv_blocks``: force the KV pool size (tests); None = size it from ``gpu_memory_utilization`` on CUDA or
    ``cpu_kv_cache_gib`` on CPU.
    ``max_num_batched_tokens``: token budget of one step; None = max(max_model_len, 2048).
    ``enable_prefix_caching``: reuse the K/V of full blocks whose whole prefix matches (block_manager.py).
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
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device: must be auto, cuda or cpu, got {self.device!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be at least 1, got {self.max_num_seqs}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"kv_cache_dtype: must be auto, fp8 or int8, got {self.kv_cache_dtype!r}")

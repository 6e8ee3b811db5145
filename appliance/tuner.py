"""The serving plan: memory, context length, batch size and KV-cache size, from the model's config.json and the
hardware, each value with the reason it was chosen. Flags given by the user win over the plan.

The compute dtype (``dtype``): the engine's "auto" on a GPU (the checkpoint's float16 or bfloat16, as vLLM: float16
for AWQ and GPTQ checkpoints; bfloat16 where it names float32 or nothing); on a CPU bfloat16 where the CPU multiplies
it in hardware (``Hardware.cpu_bf16``: about twice float32's decode speed, half the bytes per weight read), else
float32, the engine's exact reference path.
KV bytes per token = 2 (K and V) x layers x KV heads x head dim x element size: for "auto" the compute dtype's
(2 for bfloat16, 4 for float32), 1 for fp8, and for int8 1 per value plus a 4-byte scale per token and KV head
(head dim + 4 bytes per head).
On a GPU the KV pool is what the engine's own memory plan (``engine.memory.gpu_kv_budget``) leaves of
``gpu_memory_utilization`` x total memory (or of the free memory, if less) after the weights, the CUDA context, a
step's activations and the sampler's buffers for ``max_num_seqs`` rows, less a margin, so that the engine gets at
least the planned cache; on a CPU it is a slice of free RAM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.hardware import Hardware, gib
from engine.config import DTYPES, KV_CACHE_DTYPES, checkpoint_dtype, compute_dtype
from engine.memory import (CUDA_CONTEXT_BYTES, DEFAULT_STEP_TOKENS, PLAN_MARGIN_BYTES, default_step_tokens,
                           gpu_kv_budget)
from engine.models.context import max_context
from engine.models.rope import RopeError, rope_scaling

BLOCK_SIZE = 16
GIB = 2**30
GPU_DEFAULT_UTILIZATION = 0.90
GPU_FREE_MARGIN = GIB // 2  # left free when other processes already hold GPU memory
GPU_MAX_NUM_SEQS = 256  # vLLM's default
TOKENS_PER_SEQUENCE_SLOT = 256  # max_num_seqs is capped so every sequence could hold this many KV tokens
# A GPU plan's step (``max_num_batched_tokens``) unless given is the engine's DEFAULT_STEP_TOKENS (vLLM's). A
# fallback to 256-token steps where that leaves the KV cache under MIN_CONTEXT_TOKENS (an eighth of the activations;
# 256 is the most rows a W4A16 product runs on its tensor-core kernel) was built and taken out again after its one
# check on a GPU (bench/consumer_fit.py, bench/RESULTS.md run 124): a Llama-3.1-8B plan on an 8 GiB card's share
# (6.88 GiB) ran out of memory at start-up, 7.41 GiB used. The memory plan's reserves must be measured first.
#: a plan whose KV cache holds fewer tokens says how to double it (Ollama's default context)
MIN_CONTEXT_TOKENS = 4096
TYPICAL_REQUEST_TOKENS = 1024  # prompt + completion of a typical chat request, for the expected concurrency
CPU_SEQS_PER_CORE = 4
CPU_MAX_NUM_SEQS = 16
CPU_MAX_MODEL_LEN = 4096  # a longer prompt takes minutes to prefill on a CPU
CPU_KV_FRACTION = 0.10  # of the free RAM
CPU_KV_MAX_GIB = 4.0
CPU_KV_STEP_GIB = 0.25
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class TuneError(ApplianceError):
    pass


@dataclass
class ModelInfo:
    """What the tuner needs from a model folder."""

    path: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int  # tokens: max_position_embeddings with its RoPE scaling
    max_context_why: str
    weight_bytes: int
    quantization: str | None = None
    hidden_size: int = 0  # the activations' width, for the memory plan
    vocab_size: int = 0  # the sampler's buffers' width
    gpu_extra_bytes: int = 0  # on a GPU beyond the files: the RoPE table, linears the engine dequantizes
    dtype: str | None = None  # the weights' dtype config.json names (engine.config.checkpoint_dtype)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelInfo":
        from engine.models.checkpoint_config import CheckpointError, check_architecture, check_quantization, read_config

        model_dir = Path(model_dir)
        cfg_file = model_dir / "config.json"
        try:  # what the engine would refuse at load is refused here, before a plan for it
            cfg = read_config(model_dir)
            rope_scaling(cfg)  # first: its own hint
            check_architecture(cfg)
            check_quantization(cfg)
        except RopeError as exc:
            raise TuneError(f"{cfg_file}: {exc}", "serve a model with a supported RoPE") from None
        except CheckpointError as exc:
            raise TuneError(str(exc), "give a Hugging Face model folder the engine serves") from None
        if not any(model_dir.glob("*.safetensors")):
            raise TuneError(f"{model_dir} has no *.safetensors weights", "convert the model to safetensors first")
        try:
            context, context_why = max_context(cfg)  # its RoPE was read above
            named_dtype = checkpoint_dtype(cfg)
            cfg = cfg.get("text_config") or cfg
            heads = cfg["num_attention_heads"]
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            quant = cfg.get("quantization_config")
            return cls(
                path=str(model_dir),
                num_layers=cfg["num_hidden_layers"],
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                max_context=context, max_context_why=context_why,
                weight_bytes=sum(p.stat().st_size for p in model_dir.glob("*.safetensors")),
                quantization=(quant or {}).get("quant_method") if quant else None,
                hidden_size=cfg["hidden_size"], vocab_size=cfg.get("vocab_size") or 0,
                gpu_extra_bytes=_gpu_extra_bytes(cfg, quant, head_dim, context), dtype=named_dtype,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TuneError(f"{cfg_file} is not a usable model config ({exc})", "check the model folder") from None

    def gpu_kv_bytes(self, total: int, free: int, utilization: float, max_num_seqs: int, dtype: str = "auto",
                     step_tokens: int | None = None) -> int:
        """KV-cache bytes the engine gets at least on a GPU of ``total`` bytes with ``free`` bytes free (NVML's, before
        the engine's CUDA context), at ``utilization`` and ``max_num_seqs``: ``engine.memory.gpu_kv_budget`` with
        a step of ``step_tokens`` (None: the engine's default with chunked prefill) and activations in ``dtype``
        ("auto": 16-bit), the weights the files and ``gpu_extra_bytes``, less ``PLAN_MARGIN_BYTES``."""
        step = step_tokens or default_step_tokens(max_num_seqs, 0)
        element = ELEMENT_BYTES[compute_dtype(dtype, "cuda", self.dtype)]
        return int(gpu_kv_budget(total, free - CUDA_CONTEXT_BYTES, self.weight_bytes + self.gpu_extra_bytes,
                                 utilization, step, self.hidden_size, element, max_num_seqs, self.vocab_size)
                   - PLAN_MARGIN_BYTES)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", device: str = "cuda", dtype: str = "auto") -> int:
        """Bytes of K and V per token in all layers; ``dtype`` (the compute dtype, "auto" = the engine's default on
        ``device``) sizes an "auto" KV cache."""
        if kv_cache_dtype == "int8":  # int8 codes and one fp32 scale per token and KV head
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 4)
        element = 1 if kv_cache_dtype == "fp8" else ELEMENT_BYTES[compute_dtype(dtype, device, self.dtype)]
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def choose_dtype(hw: Hardware, named: str | None = None) -> tuple[str, str]:
    """The serving dtype for ``hw`` and the reason, for a checkpoint whose config.json names ``named``: "auto" on a
    GPU (``engine.config.compute_dtype``: ``named`` if float16 or bfloat16, else bfloat16); on a CPU bfloat16
    when it has bfloat16 instructions (``Hardware.cpu_bf16``), else float32."""
    if hw.kind == "cuda":
        if named in ("float16", "bfloat16"):
            return "auto", f"{named}, the checkpoint's dtype (config.json), as vLLM's auto"
        return "auto", "bfloat16, the engine's default on a GPU (the checkpoint names no 16-bit dtype)"
    if hw.cpu_bf16:
        return "bfloat16", ("the CPU has bfloat16 instructions: up to about 2x float32's tokens/s (1.8-1.9x on 2 "
                            "idle AVX512-BF16 cores); --dtype float32 for the exact reference path")
    return "float32", "the CPU has no bfloat16 instructions (bfloat16 would be emulated, slower than float32)"


def _gpu_extra_bytes(cfg: dict, quant: dict | None, head_dim: int, context: int) -> int:
    """Bytes the engine holds on a GPU beyond the checkpoint's files: the float32 RoPE table (at most ``context``
    rows of ``head_dim``), and for a checkpoint with act-order group indices the q/k/v and gate/up linears, which
    the engine dequantizes to bf16 (each has its own permutation, so they cannot share one packed weight:
    ``kernels.quant_formats.concat_out_features``): 2 bytes per weight instead of about half a byte."""
    extra = 4 * context * head_dim
    if _has_group_indices(quant):
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv = cfg.get("num_key_value_heads") or heads
        stacked = h * head_dim * (heads + 2 * kv) + 2 * h * cfg.get("intermediate_size", 4 * h)
        extra += cfg["num_hidden_layers"] * stacked * 3 // 2
    return extra


def _has_group_indices(quant: dict | None) -> bool:
    """Whether a ``quantization_config`` stores act-order group indices (a permutation per linear): GPTQ with
    ``desc_act``, or compressed-tensors with ``actorder: "group"`` ("weight" act-order keeps the groups in order
    and stores none, as vLLM reads it)."""
    if not quant:
        return False
    if quant.get("quant_method") == "gptq":
        return bool(quant.get("desc_act"))
    if quant.get("quant_method") == "compressed-tensors":
        return any(g.get("weights", {}).get("actorder") == "group" for g in quant.get("config_groups", {}).values())
    return False


@dataclass
class Plan:
    device: str
    gpu_memory_utilization: float
    cpu_kv_cache_gib: float
    max_model_len: int
    max_num_seqs: int
    kv_cache_dtype: str
    dtype: str
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    expected_concurrency: int
    max_num_batched_tokens: int | None = None  # tokens one step computes; None: the engine's default (2048)
    reasons: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def check_choices(*, kv_cache_dtype: str | None = None, dtype: str | None = None) -> None:
    """Raise TuneError for a ``--kv-cache-dtype`` or ``--dtype`` that is none of its choices (the installer asks
    before anything else: no model needed)."""
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise TuneError(f"--kv-cache-dtype must be auto, fp8 or int8, got {kv_cache_dtype!r}", "pick one of those")
    if dtype is not None and dtype not in DTYPES:
        raise TuneError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}", "pick one of those")


def check_flags(model: ModelInfo, hw: Hardware, *, gpu_memory_utilization: float | None = None,
                max_num_seqs: int | None = None, max_model_len: int | None = None,
                kv_cache_dtype: str | None = None, dtype: str | None = None,
                max_num_batched_tokens: int | None = None) -> None:
    """Raise TuneError for a flag no plan can take, whatever the memory: the installer asks before it quantizes
    (the model's config is the same before and after). :func:`plan` asks again."""
    check_choices(kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    if dtype == "float32" and hw.kind == "cuda":  # the GPU plan counts 16-bit weights and activations
        raise TuneError("--dtype float32 is the CPU's exact reference path; a GPU plan counts 16-bit weights and "
                        "activations", "use --dtype auto, bfloat16 or float16")
    if kv_cache_dtype == "fp8" and hw.kind == "cuda" and hw.gpu is not None and hw.gpu.capability < (8, 9):
        raise TuneError(f"--kv-cache-dtype fp8 needs compute capability 8.9+ (Ada or Hopper); {hw.gpu.name} has "
                        f"{hw.gpu.compute_capability}", "use --kv-cache-dtype int8 (any GPU) or auto")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise TuneError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}",
                        "use a fraction such as 0.9")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise TuneError(f"--max-num-seqs must be at least 1, got {max_num_seqs}", "use a positive number")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise TuneError(f"--max-num-batched-tokens must be at least 1, got {max_num_batched_tokens}",
                        "use a positive number, such as 2048")
    if max_num_batched_tokens is not None and max_num_batched_tokens < (max_num_seqs or 1):
        raise TuneError(f"--max-num-batched-tokens {max_num_batched_tokens} is below "
                        f"{'--max-num-seqs ' if max_num_seqs else ''}{max_num_seqs or 1}: every running sequence "
                        "decodes a token each step", f"use at least {max_num_seqs or 1}")
    if max_model_len is not None and max_model_len < 1:
        raise TuneError(f"--max-model-len must be positive, got {max_model_len}", "use a positive number")
    if max_model_len is not None and max_model_len > model.max_context:
        raise TuneError(f"--max-model-len {max_model_len} is over the model's limit of {model.max_context} "
                        f"tokens ({model.max_context_why})", f"use at most {model.max_context}")


def _device_reason(hw: Hardware) -> str:
    """The GPU served on (name, memory, compute capability), or why there is none (``Hardware.reason``)."""
    if hw.kind == "cuda":
        return f"{hw.gpu.name}, {gib(hw.gpu.total_memory)}, compute capability {hw.gpu.compute_capability}"
    return f"no GPU to serve on ({hw.reason})" if hw.reason else "no GPU to serve on"


def plan(model: ModelInfo, hw: Hardware, *, gpu_memory_utilization: float | None = None,
         max_num_seqs: int | None = None, max_model_len: int | None = None,
         kv_cache_dtype: str | None = None, dtype: str | None = None,
         max_num_batched_tokens: int | None = None) -> Plan:
    """Choose the serving settings for ``model`` on ``hw``; keyword arguments that are not None are kept as given.
    Raises TuneError for a flag :func:`check_flags` refuses, or settings the memory cannot take."""
    check_flags(model, hw, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                max_num_batched_tokens=max_num_batched_tokens)
    reasons: dict[str, str] = {"device": _device_reason(hw)}
    if dtype is None:
        dtype, reasons["dtype"] = choose_dtype(hw, model.dtype)
    else:
        reasons["dtype"] = "set by --dtype"
    if kv_cache_dtype is None:
        kv_cache_dtype = "auto"
        computed = compute_dtype(dtype, hw.kind, model.dtype)
        reasons["kv_cache_dtype"] = f"the compute dtype ({computed}) keeps the KV cache exact"
    else:
        reasons["kv_cache_dtype"] = "set by --kv-cache-dtype"
    bpt = model.kv_bytes_per_token(kv_cache_dtype, hw.kind, dtype)
    block_bytes = bpt * BLOCK_SIZE
    dims = f"({model.head_dim} dims + a 4-byte scale)" if kv_cache_dtype == "int8" else f"{model.head_dim} dims"
    reasons["num_kv_blocks"] = (f"{BLOCK_SIZE} tokens of {bpt:,} bytes per block ({model.num_layers} layers x "
                                f"{model.num_kv_heads} KV heads x {dims} x K,V)")

    if hw.kind == "cuda" and hw.gpu is not None:
        gpu = hw.gpu
        util = gpu_memory_utilization
        if util is not None:
            reasons["gpu_memory_utilization"] = "set by --gpu-memory-utilization"
        elif gpu.free_memory - GPU_FREE_MARGIN < GPU_DEFAULT_UTILIZATION * gpu.total_memory:
            util = math.floor((gpu.free_memory - GPU_FREE_MARGIN) / gpu.total_memory * 100) / 100
            reasons["gpu_memory_utilization"] = (f"only {gib(gpu.free_memory)} of {gib(gpu.total_memory)} is free "
                                                 f"(other processes hold the rest); {gib(GPU_FREE_MARGIN)} kept spare")
        else:
            util = GPU_DEFAULT_UTILIZATION
            reasons["gpu_memory_utilization"] = (f"the GPU is free: {util:.0%} of {gib(gpu.total_memory)}, "
                                                 "the rest spare")
        len_cap, len_cap_why = model.max_context, model.max_context_why
        seqs, step, kv_bytes = _gpu_sizing(model, gpu, util, dtype, block_bytes, max_num_seqs,
                                           max_num_batched_tokens, reasons)
        if kv_bytes < block_bytes:
            raise _no_room(model, gpu, util, kv_bytes, gpu_memory_utilization is not None, max_num_seqs,
                           max_num_batched_tokens)
        reasons["num_kv_blocks"] += (f"; {gib(kv_bytes)} = {util:.0%} of {gib(gpu.total_memory)} minus "
                                     f"{gib(model.weight_bytes)} of weights, the CUDA context, a step's activations "
                                     f"and the sampler's buffers for {seqs} sequences (the engine's memory plan)")
        cpu_gib = 0.0
        reasons["cpu_kv_cache_gib"] = "not used on a GPU"
    else:
        seqs, step = None, max_num_batched_tokens
        reasons["max_num_batched_tokens"] = ("set by --max-num-batched-tokens" if step else
                                             "the engine's default (2048 tokens a step)")
        util = GPU_DEFAULT_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
        reasons["gpu_memory_utilization"] = "not used on the CPU"
        steps = math.floor(hw.available_memory * CPU_KV_FRACTION / (CPU_KV_STEP_GIB * GIB))
        cpu_gib = min(CPU_KV_MAX_GIB, max(1, steps) * CPU_KV_STEP_GIB)
        kv_bytes = int(cpu_gib * GIB)
        reasons["cpu_kv_cache_gib"] = (f"{CPU_KV_FRACTION:.0%} of the {gib(hw.available_memory)} of free RAM, in "
                                       f"steps of {CPU_KV_STEP_GIB} GiB, at most {CPU_KV_MAX_GIB:g} GiB")
        reasons["num_kv_blocks"] += f"; {cpu_gib:g} GiB of RAM"
        len_cap = min(model.max_context, CPU_MAX_MODEL_LEN)
        len_cap_why = (f"{model.max_context_why}, at most {CPU_MAX_MODEL_LEN} on a CPU "
                       "(longer prompts take minutes to prefill)")
        seq_default = min(CPU_MAX_NUM_SEQS, CPU_SEQS_PER_CORE * hw.cpu_cores)
        seq_why = (f"CPU decoding is compute-bound: {CPU_SEQS_PER_CORE} sequences per core x {hw.cpu_cores} cores, "
                   f"at most {CPU_MAX_NUM_SEQS}")
        if step and step < seq_default:  # every running sequence decodes a token each step
            seq_default, seq_why = step, f"at most --max-num-batched-tokens {step}: one token a sequence a step"

    num_blocks = kv_bytes // block_bytes
    kv_tokens = num_blocks * BLOCK_SIZE

    if max_model_len is not None:
        if max_model_len > kv_tokens:
            raise TuneError(f"--max-model-len {max_model_len} does not fit in the KV cache ({kv_tokens} tokens)",
                            f"use at most {kv_tokens}, or give the cache more memory")
        reasons["max_model_len"] = "set by --max-model-len"
    elif kv_tokens < len_cap:
        max_model_len = kv_tokens
        reasons["max_model_len"] = f"what the KV cache holds ({kv_tokens} tokens), below {len_cap_why} ({len_cap})"
        if kv_tokens < MIN_CONTEXT_TOKENS and kv_cache_dtype == "auto" and hw.kind == "cuda":
            reasons["max_model_len"] += ("; a short context: --kv-cache-dtype int8 (or fp8 on Ada and Hopper) about "
                                         "doubles it")
    else:
        max_model_len = len_cap
        reasons["max_model_len"] = len_cap_why

    if max_num_seqs is not None:
        reasons["max_num_seqs"] = "set by --max-num-seqs"
    elif seqs is not None:  # the GPU's, chosen with its memory (_gpu_sizing)
        max_num_seqs = seqs
    else:
        slots = max(1, kv_tokens // TOKENS_PER_SEQUENCE_SLOT)
        max_num_seqs = min(seq_default, slots)
        reasons["max_num_seqs"] = seq_why if max_num_seqs == seq_default else (
            f"the KV cache holds {TOKENS_PER_SEQUENCE_SLOT} tokens for only {slots} sequences")

    per_request = min(max_model_len, TYPICAL_REQUEST_TOKENS)
    expected = max(1, min(max_num_seqs, kv_tokens // per_request))
    reasons["expected_concurrency"] = (f"min(max_num_seqs {max_num_seqs}, {kv_tokens} KV tokens / {per_request} "
                                       f"tokens per request); {kv_tokens / max_model_len:.1f} requests at full "
                                       f"length ({max_model_len} tokens)")
    return Plan(device=hw.kind, gpu_memory_utilization=util, cpu_kv_cache_gib=cpu_gib, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype, dtype=dtype, block_size=BLOCK_SIZE,
                num_kv_blocks=num_blocks, kv_bytes_per_token=bpt, kv_cache_bytes=num_blocks * block_bytes,
                expected_concurrency=expected, max_num_batched_tokens=step, reasons=reasons)


def _gpu_sizing(model: ModelInfo, gpu, util: float, dtype: str, block_bytes: int, max_num_seqs: int | None,
                step_tokens: int | None, reasons: dict) -> tuple[int, int | None, int]:
    """(max_num_seqs, max_num_batched_tokens (None: the engine's default), KV-cache bytes) on ``gpu`` at ``util``;
    values given are kept. The sequences: vLLM's 256 (at most a given step) where the KV cache holds
    :data:`TOKENS_PER_SEQUENCE_SLOT` tokens for each, else the most for which it does (each takes sampler buffers
    from the cache), at least 1. The step: the one given, else the engine's default (:data:`DEFAULT_STEP_TOKENS`,
    at least ``max_num_seqs``)."""
    most = min(GPU_MAX_NUM_SEQS, step_tokens or GPU_MAX_NUM_SEQS)

    def kv(seqs: int) -> int:  # a step not given: the engine's default for seqs sequences
        return model.gpu_kv_bytes(gpu.total_memory, gpu.free_memory, util, seqs, dtype, step_tokens)

    def tokens(seqs: int) -> int:  # whole blocks, as the engine allocates them
        return kv(seqs) // block_bytes * BLOCK_SIZE

    seqs = max_num_seqs or _most_sequences(tokens, most)
    kv_bytes = kv(seqs)
    if max_num_seqs is not None:
        reasons["max_num_seqs"] = "set by --max-num-seqs"
    elif seqs == most:
        reasons["max_num_seqs"] = (f"vLLM's default of {GPU_MAX_NUM_SEQS}" if most == GPU_MAX_NUM_SEQS else
                                   f"at most --max-num-batched-tokens {most}: one token a sequence a step")
    elif tokens(seqs) < TOKENS_PER_SEQUENCE_SLOT:
        reasons["max_num_seqs"] = f"the KV cache holds fewer than {TOKENS_PER_SEQUENCE_SLOT} tokens: one sequence"
    else:
        reasons["max_num_seqs"] = (f"the KV cache holds {TOKENS_PER_SEQUENCE_SLOT} tokens for only {seqs} sequences "
                                   "(each takes sampler buffers from it)")
    if step_tokens is None:
        reasons["max_num_batched_tokens"] = (f"the engine's default: vLLM's {DEFAULT_STEP_TOKENS} tokens a step "
                                             "(at least max_num_seqs)")
    elif step_tokens < DEFAULT_STEP_TOKENS:
        reasons["max_num_batched_tokens"] = ("set by --max-num-batched-tokens; careful: the memory plan's reserves "
                                             "fell short with 256-token steps on an 8 GiB card's share (a GPU check, "
                                             "bench/RESULTS.md run 124)")
    else:
        reasons["max_num_batched_tokens"] = "set by --max-num-batched-tokens"
    return seqs, step_tokens, kv_bytes


def _no_room(model: ModelInfo, gpu, util: float, kv_bytes: int, util_given: bool, max_num_seqs: int | None,
             step_tokens: int | None) -> TuneError:
    """The error of a plan whose KV cache would get nothing, with the fixes that would help here."""
    share, held = util * gpu.total_memory, gpu.total_memory - gpu.free_memory
    fixes = [f"close programs holding GPU memory ({gib(held)})"] if held > GPU_FREE_MARGIN else []
    if util_given and share < gpu.free_memory - CUDA_CONTEXT_BYTES:  # else the free memory is the limit
        fixes.append("raise --gpu-memory-utilization")
    fixes += ["lower --max-num-seqs"] * bool(max_num_seqs) + ["lower --max-num-batched-tokens"] * bool(step_tokens)
    fixes.append("use a smaller model")
    others = share - model.weight_bytes - kv_bytes  # what the memory plan reserves beside the weights
    return TuneError(f"the model ({gib(model.weight_bytes)}) leaves no room for a KV cache in {util:.0%} of the "
                     f"{gib(gpu.total_memory)} GPU ({gib(share)}): beside it the CUDA context, one step's "
                     f"activations, the sampler's buffers and a margin need {gib(others)}",
                     ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1])


def _most_sequences(kv_tokens, most: int) -> int:
    """The largest n <= ``most`` whose ``kv_tokens(n)`` (non-increasing in n) holds
    :data:`TOKENS_PER_SEQUENCE_SLOT` tokens for each of n sequences; 1 if none does."""
    low, high = 1, most
    while low < high:  # invariant: n = low fits, or low is 1; every n > high does not
        mid = (low + high + 1) // 2
        if kv_tokens(mid) >= mid * TOKENS_PER_SEQUENCE_SLOT:
            low = mid
        else:
            high = mid - 1
    return low

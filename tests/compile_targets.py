"""Compile the engine's Triton kernels for GPUs we have no machine of: the product's RTX 30 / 40 cards.

The CI machine has no GPU and the benchmark GPU is an H200 (sm_90), so nothing else ever compiled the kernels for
the GPUs the appliance is for (RTX 3060 / 3090: sm_86; RTX 4060 Ti / 4090: sm_89; A100: sm_80). Triton's wheel
carries ptxas, and compiling needs no GPU: :func:`compile_only` stands in a driver that names the target, makes
every launch a compile (``JITFunction.run(warmup=True)``), and gives the ops meta tensors (shapes without memory),
so each op runs its host code (plan choice, grid, constexprs) as on that GPU and Triton compiles what it would
launch. :func:`model_launches` drives one model's decode and prefill ops through ``kernels.ops``' Triton side.

What it catches: PTX that the target lacks (ptxas refuses it: the packed bf16 ``sub`` / ``mul`` of the tc GEMM
were sm_90-only), kernels needing more shared memory than the target has per block (:data:`SHARED_LIMIT`), and,
with ``ptxas_stats``, register spills (:func:`ptxas_stats`: Triton keeps no ptxas log, so the PTX goes through the
bundled ptxas once more). Speed on those GPUs it cannot tell.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

#: Shared memory a block may use (bytes, opt-in maximum; CUDA C Programming Guide, "Technical Specifications per
#: Compute Capability"): 163 KB on sm_80, 99 KB on sm_86 and sm_89.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024}

#: The GPUs checked: (compute capability as 86, multiprocessors); the count changes the plans (K splits, tiles).
TARGETS = {"RTX 3060": (86, 28), "RTX 3090": (86, 82), "RTX 4060 Ti": (89, 34), "RTX 4090": (89, 128),
           "A100": (80, 108)}


@dataclass(frozen=True)
class Compiled:
    """One kernel variant Triton compiled: name, shared memory in bytes, and what it was compiled for."""

    kernel: str
    shared: int
    num_warps: int
    num_stages: int
    registers: int = -1  # per thread, from ptxas -v (-1: not asked for)
    spill_bytes: int = -1  # spill stores + loads


def ptxas_stats(ptx: str, capability: int) -> tuple[int, int]:
    """(registers per thread, spill store + load bytes) of ``ptx`` assembled for sm_<capability> by the ptxas in
    Triton's wheel with ``-v``. Raises RuntimeError if ptxas fails or its report lacks either count."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{capability}", src, "-o",
                               src + ".o"], capture_output=True, text=True)  # Triton 3.9's register flag
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if done.returncode or regs is None or spills is None:
        raise RuntimeError(f"ptxas sm_{capability}: {done.stderr[-500:]}")
    return int(regs.group(1)), int(spills.group(1)) + int(spills.group(2))


class _Driver:
    """What ``JITFunction.run`` asks the active driver for when it only compiles: the target, a device id (the
    capability, so each target keeps its own kernel cache) and a stream."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", capability, 32)
        self.capability = capability

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.capability

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def compile_only(capability: int, sms: int, stats: bool = False):
    """While it lasts, Triton launches compile for compute capability ``capability`` (86 for sm_86) and launch
    nothing, the kernel modules see a GPU of ``sms`` multiprocessors without Hopper's PTX (no PDL, no packed bf16
    sub), and each compiled variant is appended to the yielded list (with its registers and spills when ``stats``:
    :func:`ptxas_stats`, once per variant). Launch with meta tensors. Temporary files go to a folder of its own,
    removed at the end (Triton keeps the .ptx of a kernel that ptxas refuses)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from kernels import paged_attention, w4a16

    seen: list[Compiled] = []
    counted: dict[str, tuple[int, int]] = {}
    run = JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        regs = spills = -1
        if stats:
            if kernel.hash not in counted:
                counted[kernel.hash] = ptxas_stats(kernel.asm["ptx"], capability)
            regs, spills = counted[kernel.hash]
        seen.append(Compiled(self.fn.__name__, kernel.metadata.shared, kernel.metadata.num_warps,
                             kernel.metadata.num_stages, regs, spills))
        return kernel

    scratch = tempfile.TemporaryDirectory(prefix="compile-targets-")
    patches = [(JITFunction, "run", compile_run), (w4a16, "num_sms", lambda device: sms),
               (paged_attention, "num_sms", lambda device: sms),
               (w4a16, "hopper", lambda t: capability >= 90), (tempfile, "tempdir", scratch.name)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    active = driver._active  # None until something asked for it (a CPU-only process never does)
    try:
        driver.set_active(_Driver(capability))
        for obj, name, value in patches:
            setattr(obj, name, value)
        w4a16.choose_plan.cache_clear()
        yield seen
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        driver._active = active
        w4a16.choose_plan.cache_clear()
        scratch.cleanup()


@dataclass(frozen=True)
class Shape:
    """The sizes of a decoder that pick kernels: hidden, intermediate, q / kv heads, head dim; qkv bias (Qwen); a
    sliding attention window (Mistral v0.1; 0 = none)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    window: int = 0


MODELS = {
    "Llama-2-7B": Shape(4096, 11008, 32, 32, 128),
    "Llama-3-8B": Shape(4096, 14336, 32, 8, 128),
    "Mistral-7B-v0.1": Shape(4096, 14336, 32, 8, 128, window=4096),
    "Qwen2.5-7B": Shape(3584, 18944, 28, 4, 128, qkv_bias=True),
    "Qwen2.5-1.5B": Shape(1536, 8960, 12, 2, 128, qkv_bias=True),
    "Phi-3-mini": Shape(3072, 8192, 32, 32, 96),
    "SmolLM2-135M": Shape(576, 1536, 9, 3, 64),
}


def meta(*shape, dtype=torch.bfloat16):
    """A tensor of ``shape`` without memory (device "meta"): ops run their host code on it, kernels only compile."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def weight(k: int, n: int, group: int, act_order: bool, scale_dtype: torch.dtype, bits: int = 4):
    """A [k -> n] QuantizedWeight of meta tensors in the internal layout (act-order: with a permutation)."""
    from kernels.quant_formats import QuantizedWeight
    g, pf = -(-k // group), 32 // bits
    perm = meta(k, dtype=torch.int32) if act_order else None
    return QuantizedWeight(meta(k // pf, n, dtype=torch.int32), meta(g, n // pf, dtype=torch.int32),
                           meta(g, n, dtype=scale_dtype), perm, bits, group, k, n, "meta")


def model_launches(shape: Shape, dtype: torch.dtype = torch.bfloat16, group: int = 128, act_order: bool = False,
                   kv_dtype: torch.dtype | None = None, rows=(1, 8, 16, 64, 128, 256, 512), batches=(1, 8, 64),
                   max_model_len: int = 4096, block_size: int = 16, bits: int = 4) -> None:
    """Run the Triton side of every op of one decoder layer on meta tensors: the four W{bits}A16 products at each
    M of ``rows`` (decode batches and prefill chunks) as the model runs them (q/k/v and gate/up with
    ``defer_sum``, rotary with the KV write and SiLU-and-mul adding their splits), and the unsplit forms too
    (SiLU fused into the down projection's GEMV loads at M = 1), RMSNorm with and without the residual (the
    first layer has none), rotary with the KV write, SiLU-and-mul, the KV write, decode attention for each of
    ``batches`` over a ``max_model_len`` block table, prefill attention, and the sampler's penalty kernel. Inside
    :func:`compile_only`."""
    from kernels import activation, kv_cache, norm, paged_attention, penalties, rotary, w4a16

    kv_dtype = kv_dtype or dtype
    h, d = shape.hidden, shape.head_dim
    qkv_n = (shape.heads + 2 * shape.kv_heads) * d
    weights = {"qkv": weight(h, qkv_n, group, act_order, dtype, bits),
               "o": weight(shape.heads * d, h, group, act_order, dtype, bits),
               "gate_up": weight(h, 2 * shape.intermediate, group, act_order, dtype, bits),
               "down": weight(shape.intermediate, h, group, act_order, dtype, bits)}
    bias = meta(qkv_n, dtype=dtype) if shape.qkv_bias else None
    blocks = 64
    caches = [meta(blocks, block_size, shape.kv_heads, d, dtype=kv_dtype) for _ in range(2)]
    scales = ([meta(blocks, shape.kv_heads, block_size, dtype=torch.float32) for _ in range(2)]
              if kv_dtype == torch.int8 else [None, None])
    cos_sin = meta(max_model_len, d, dtype=torch.float32)
    q_size, kv_size = shape.heads * d, shape.kv_heads * d
    for m in rows:  # as the model: the q/k/v and gate/up sums left to rotary and SiLU where the product splits K
        qkv = w4a16.w4a16_linear(meta(m, h, dtype=dtype), weights["qkv"], bias, defer_sum=True)
        q, k, v = (t.reshape(m, -1, d) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
        rotary.rotary_write_kv(meta(m, dtype=torch.int64), q, k, v, cos_sin, *caches, meta(m, dtype=torch.int64),
                               *scales)
        w4a16.w4a16_linear(meta(m, shape.heads * d, dtype=dtype), weights["o"])
        gate_up = w4a16.w4a16_linear(meta(m, h, dtype=dtype), weights["gate_up"], defer_sum=True)
        w4a16.w4a16_linear(gate_up, weights["down"], silu_gated=True)
        norm.rms_norm(meta(m, h, dtype=dtype), meta(h, dtype=dtype), 1e-5, meta(m, h, dtype=dtype))
        norm.rms_norm(meta(m, h, dtype=dtype), meta(h, dtype=dtype), 1e-5)
        activation.silu_and_mul(meta(m, 2 * shape.intermediate, dtype=dtype))
        # SiLU fused into the down projection's GEMV loads (an unsplit gate/up product at one row)
        w4a16.w4a16_linear(meta(m, 2 * shape.intermediate, dtype=dtype), weights["down"], silu_gated=True)
    for tokens in (1, 64):
        q = meta(tokens, shape.heads, d, dtype=dtype)
        kv = meta(tokens, shape.kv_heads, d, dtype=dtype)
        rotary.rotary_write_kv(meta(tokens, dtype=torch.int64), q, kv, kv, cos_sin, *caches,
                               meta(tokens, dtype=torch.int64), *scales)
        kv_cache.write_kv_cache(kv, kv, *caches, meta(tokens, dtype=torch.int64), *scales)
    table_width = -(-max_model_len // block_size)
    for batch in batches:
        paged_attention.paged_attention_decode(
            meta(batch, shape.heads, d, dtype=dtype), *caches, meta(batch, table_width, dtype=torch.int32),
            meta(batch, dtype=torch.int32), d ** -0.5, *scales, shape.window)
    paged_attention.paged_attention_prefill(
        meta(512, shape.heads, d, dtype=dtype), *caches, meta(4, table_width, dtype=torch.int32),
        meta(5, dtype=torch.int32), meta(4, dtype=torch.int32), d ** -0.5, *scales, shape.window)
    for pending in (None, meta(4, dtype=torch.int64)):  # 4 penalised rows of a 32k vocabulary
        penalties.apply_penalties(meta(4, 32000, dtype=torch.float32), meta(4, dtype=torch.int32),
                                  meta(9, dtype=torch.int32), meta(100, dtype=torch.int32),
                                  meta(3, 4, dtype=torch.float32), pending)

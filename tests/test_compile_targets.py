"""Every kernel the engine launches compiles for the RTX 30 / 40 GPUs (and an A100) and fits their shared memory.

No GPU needed: Triton compiles for a named target with the ptxas in its wheel (tests/compile_targets.py). Run
on the H200 too, these would check Triton 3.6's code generation for the same targets.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # triton.jit then gives interpreter functions: nothing compiles
    pytest.skip("compiling for a target needs TRITON_INTERPRET unset", allow_module_level=True)

import compile_targets as ct  # noqa: E402
from kernels import w4a16  # noqa: E402

pytestmark = pytest.mark.slow


def _check(seen: list, capability: int, what: str) -> None:
    assert seen, f"{what}: nothing compiled"
    too_big = sorted({c for c in seen if c.shared > ct.SHARED_LIMIT[capability]}, key=lambda c: -c.shared)
    assert not too_big, f"{what}: over sm_{capability}'s {ct.SHARED_LIMIT[capability]} bytes: {too_big}"


@pytest.mark.parametrize("gpu", list(ct.TARGETS))
def test_every_model_compiles(gpu):
    """The decode and prefill kernels of each model in MODELS (AWQ, group 128, bf16, bf16 KV cache); on the RTX
    3090 and 4090 targets no kernel spills registers either (none did with Triton 3.9's ptxas)."""
    capability, sms = ct.TARGETS[gpu]
    stats = gpu in ("RTX 3090", "RTX 4090")
    with ct.compile_only(capability, sms, stats=stats) as seen:
        for name, shape in ct.MODELS.items():
            ct.model_launches(shape)
    _check(seen, capability, gpu)
    if stats:
        assert all(c.registers > 0 for c in seen)
        spilling = sorted({c for c in seen if c.spill_bytes}, key=lambda c: -c.spill_bytes)
        assert not spilling, f"{gpu}: kernels spill registers: {spilling}"
    names = {c.kernel for c in seen}
    assert {"_gemv_mma_kernel", "_gemm_tc_kernel", "_decode_kernel", "_prefill_kernel", "_rotary_kernel",
            "_rms_norm_kernel", "_silu_and_mul_kernel", "_write_kv_kernel"} <= names, names


VARIANTS = {
    "fp16": dict(dtype=torch.float16),
    "act-order, group 64": dict(act_order=True, group=64),
    "group 32": dict(group=32),
    "int8 KV cache": dict(kv_dtype=torch.int8),
    "GPTQ 8-bit": dict(bits=8, group=128, act_order=True),
    "GPTQ 2-bit": dict(bits=2, group=64),
    "fp8 KV cache": dict(kv_dtype=torch.float8_e4m3fn),  # sm_89 only: the engine refuses it on older GPUs
    # float16 is what an AWQ / GPTQ checkpoint runs in (dtype "auto" follows its config.json, as vLLM)
    "fp16, int8 KV cache": dict(dtype=torch.float16, kv_dtype=torch.int8),
    "fp16, fp8 KV cache": dict(dtype=torch.float16, kv_dtype=torch.float8_e4m3fn),
}


# fp8 KV needs sm_89: engine.model_runner refuses it on the RTX 3090 before any kernel runs
@pytest.mark.parametrize("gpu, variant", [(gpu, variant) for gpu in ("RTX 3090", "RTX 4090") for variant in VARIANTS
                                          if "fp8 KV cache" not in variant or ct.TARGETS[gpu][0] >= 89])
def test_variants_compile(gpu, variant):
    capability, sms = ct.TARGETS[gpu]
    with ct.compile_only(capability, sms) as seen:
        ct.model_launches(ct.MODELS["Llama-3-8B"], **VARIANTS[variant], rows=(1, 16, 64, 256), batches=(1, 64))
    _check(seen, capability, f"{gpu}, {variant}")


def test_hopper_ptx_is_refused_before_sm90():
    """What made the tc GEMM fail on every RTX card: its packed bf16 sub / mul are sm_90 PTX. Forced on for
    sm_86, ptxas refuses the kernel; the engine's own choice (HOPPER from the device) compiles."""
    plan = w4a16.Plan("tc", 64, 64, 64, swap=True, mode=3)
    qw = ct.weight(4096, 4096, 128, False, torch.bfloat16)
    x = ct.meta(64, 4096)
    with ct.compile_only(86, 82) as seen:
        w4a16.run_plan(x, qw, None, plan)
        assert seen[-1].kernel == "_gemm_tc_kernel"
        w4a16.hopper = lambda t: True
        with pytest.raises(Exception, match="sm_90"):
            w4a16.run_plan(x, qw, None, plan)


def test_shared_memory_check_flags_large_tiles():
    """The shared-memory check has teeth: a tc tile set no rule picks (256 x 128 x 128, 4 stages) needs more than
    sm_86 has per block and is flagged; the rules' pick for the same product fits."""
    qw = ct.weight(4096, 12288, 128, False, torch.bfloat16)
    x = ct.meta(256, 4096)
    with ct.compile_only(86, 82) as seen:
        w4a16.run_plan(x, qw, None, w4a16.Plan("tc", 256, 128, 128, num_warps=8, num_stages=4, swap=True, mode=3))
        w4a16.run_plan(x, qw, None, w4a16.choose_plan(256, 12288, 4096, 4, 128, 82))
    assert seen[0].shared > ct.SHARED_LIMIT[86] >= seen[1].shared
    with pytest.raises(AssertionError, match="over sm_86"):
        _check(seen, 86, "large tiles")


def test_ptxas_stats_reads_registers_and_refuses_bad_ptx():
    from triton.runtime import driver

    before = driver._active
    with ct.compile_only(86, 82, stats=True) as seen:
        w4a16.run_plan(ct.meta(1, 4096), ct.weight(4096, 4096, 128, False, torch.bfloat16), None,
                       w4a16.Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1))
    assert driver._active is before  # the process's driver comes back as it was
    assert seen[0].kernel == "_gemv_mma_kernel" and 64 < seen[0].registers <= 255 and seen[0].spill_bytes == 0
    with pytest.raises(RuntimeError, match="ptxas sm_86"):
        ct.ptxas_stats(".version 8.0\n.target sm_86\n.address_size 64\nnot ptx", 86)


@pytest.mark.parametrize("gpu", ["RTX 3060", "RTX 4090"])
def test_plans_the_start_up_tuner_times_compile(gpu):
    """Each candidate plan kernels/w4a16_tune.py times at start-up on this GPU (the Llama-3-8B products), and the
    fast GEMM variant (a plan only the benchmark sweeps), compile and fit."""
    from kernels import w4a16_tune

    capability, sms = ct.TARGETS[gpu]
    with ct.compile_only(capability, sms) as seen:
        for k, n in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
            qw = ct.weight(k, n, 128, False, torch.bfloat16)
            for m in w4a16.M_BUCKETS:
                for plan in w4a16_tune.candidates(m, n, k, 128, sms):
                    w4a16.run_plan(ct.meta(m, k), qw, None, plan)
        w4a16.run_plan(ct.meta(16, 4096), ct.weight(4096, 4096, 128, False, torch.bfloat16), None,
                       w4a16.Plan("gemm", 16, 64, 128, swap=True, fast=True))
    _check(seen, capability, gpu)
    assert {"_gemv_mma_kernel", "_gemv_kernel", "_gemm_tc_kernel", "_gemm_kernel", "_dequant_kernel"} <= {
        c.kernel for c in seen}


def test_turing_is_refused_by_ptxas():
    """Why engine.config.MIN_CAPABILITY is 8.0: for sm_75 ptxas refuses the kernels (bf16, and the m16n8k16 mma
    shape even in fp16)."""
    qw = ct.weight(4096, 4096, 128, False, torch.float16)
    with ct.compile_only(75, 40):
        with pytest.raises(Exception, match="sm_80 or higher"):
            w4a16.run_plan(ct.meta(1, 4096, dtype=torch.float16), qw, None,
                           w4a16.Plan("mma", 8, 64, 128, 512, num_warps=1, num_stages=1))


def test_compiles_after_an_interpreted_kernel():
    """The CPU tests interpret kernels in the same process; Triton's interpreter left triton.language.core's
    builtins swapped after a device function's call, and compiling failed after it (kernels._triton._interpreting
    puts them back)."""
    from kernels import norm

    x = torch.randn(2, 64)
    norm.rms_norm(x, torch.ones(64), 1e-5, x)  # interpreted: tl.sum is a device function
    with ct.compile_only(86, 82) as seen:
        norm.rms_norm(ct.meta(2, 64), ct.meta(64), 1e-5, ct.meta(2, 64))
    assert [c.kernel for c in seen] == ["_rms_norm_kernel"]

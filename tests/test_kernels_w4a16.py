"""Triton W4A16 (fused dequant GEMV / GEMM, dequantize-then-matmul) on every checkpoint format, against a plain
torch unpack of the format's own codes; on CPU through Triton's interpreter.

Each format is built by hand from the spec (design.md §5) out of random codes, zeros, scales and act-order g_idx,
then repacked by ``kernels.quant_formats``. Dequantization must be bit-exact (fp32 and fp16 here; bf16 too on the
GPU: the interpreter truncates to bf16); products within bf16 rounding of dequantize-then-matmul in fp32.
KERNEL_TEST_DEVICE=cuda runs the same checks compiled on a GPU.
"""
import dataclasses

import pytest
import torch
from kernels_testenv import DEVICE, Launches, on_device  # noqa: F401 (autouse fixture)

from kernels import quant_formats as qf
from kernels import split_k, w4a16, w4a16_mma

FORMATS = ["awq", "gptq", "gptq_v2", "ct_sym", "ct_asym"]


def _wrap(words: torch.Tensor) -> torch.Tensor:
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def make_weight(fmt: str, k: int, n: int, group: int, act_order: bool, bits: int = 4,
                scale_dtype=torch.float16):
    """(QuantizedWeight read from ``fmt``'s tensors, expected W fp32 [N, K] from the raw codes)."""
    g = k if group == -1 else group
    groups = -(-k // g)
    top = 1 << bits
    q = torch.randint(0, top, (k, n), dtype=torch.int32)
    sym = fmt in ("ct_sym",)
    z = torch.full((groups, n), top // 2, dtype=torch.int32) if sym else torch.randint(0, top, (groups, n),
                                                                                        dtype=torch.int32)
    s = (torch.rand(groups, n) * 0.02 + 0.001).to(scale_dtype)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k)]
    expected = ((q - z[g_idx.long()]).float() * s[g_idx.long()].float()).t().contiguous()
    if fmt == "awq":
        cols = (torch.arange(n) // 8) * 8 + torch.tensor(qf.AWQ_ORDER).repeat(n // 8)
        qw = qf.from_awq(qf.pack_int32(q[:, cols], 4, 1), qf.pack_int32(z[:, cols], 4, 1), s, 4, group)
    elif fmt in ("gptq", "gptq_v2"):
        zeros = qf.pack_int32(z, bits, 1)
        if fmt == "gptq":  # v1 stores zero - 1, subtracted word-wide (a zero of 0 borrows from its neighbour)
            zeros = _wrap((zeros.to(torch.int64) & 0xFFFFFFFF) - sum(1 << (bits * i) for i in range(32 // bits)))
        qw = qf.from_gptq(qf.pack_int32(q, bits, 0), zeros, s, g_idx if act_order else None, bits, group,
                          v2=fmt == "gptq_v2")
    else:  # compressed-tensors pack-quantized: codes stored unsigned (q + 2**(bits-1) of the signed value)
        zp = None if sym else qf.pack_int32(z.t().contiguous(), bits, 0)
        qw = qf.from_compressed_tensors(qf.pack_int32(q.t().contiguous(), bits, 1), s.t().contiguous(), zp,
                                        g_idx if act_order else None, bits, group)
    return qw, expected


def check_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None):
    """y within bf16/fp16 rounding of x @ w.T (+ bias) computed in fp32."""
    ref = x.float() @ w.t()
    if bias is not None:
        ref = ref + bias.float()
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.float() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.2e}"
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group,act_order", [(32, False), (64, True), (128, False), (-1, False), (128, True)])
def test_dequantize_bit_exact(fmt, group, act_order):
    if fmt == "awq" and act_order:
        pytest.skip("AWQ has no act-order")
    qw, expected = make_weight(fmt, 256, 96, group, act_order)
    torch.testing.assert_close(qf.dequantize(qw), expected, rtol=0, atol=0)  # the repack itself
    torch.testing.assert_close(w4a16.dequantize_triton(qw, torch.float32).t(), expected, rtol=0, atol=0)
    for dtype in [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []):  # the interpreter truncates bf16
        torch.testing.assert_close(w4a16.dequantize_triton(qw, dtype).t(), expected.to(dtype), rtol=0, atol=0)


PLANS = {
    "gemv": w4a16.Plan("gemv", block_m=1, block_n=64, block_k=32),
    "gemv_split": w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32, k_per_split=64),
    "gemv_split_two_launches": w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32, k_per_split=96, serial=False),
    "gemm": w4a16.Plan("gemm", block_m=16, block_n=32, block_k=32),
    "gemm_split_swap": w4a16.Plan("gemm", block_m=16, block_n=64, block_k=32, k_per_split=96, swap=True),
    "dequant": w4a16.Plan("dequant"),
    "gemm_fast": w4a16.Plan("gemm", block_m=16, block_n=32, block_k=128, fast=True),
    "gemm_fast_split_swap": w4a16.Plan("gemm", block_m=16, block_n=64, block_k=128, k_per_split=128, swap=True,
                                       fast=True),
    "tc": w4a16.Plan("tc", block_m=16, block_n=32, block_k=32),
    "tc_split_swap": w4a16.Plan("tc", block_m=16, block_n=64, block_k=32, k_per_split=96, swap=True, mode=2),
    "tc_scale_after": w4a16.Plan("tc", block_m=32, block_n=32, block_k=32, mode=2),
    "tc_bf16_scale": w4a16.Plan("tc", block_m=16, block_n=32, block_k=32, swap=True, mode=3),
}


#: every format, each with another group size / act-order (the dequantization test above takes every pairing)
CASES = [("awq", 32, False), ("gptq", 64, True), ("gptq_v2", 128, True), ("ct_sym", -1, False), ("ct_asym", 32, True)]


@pytest.mark.parametrize("fmt,group,act_order", CASES)
@pytest.mark.parametrize("plan", list(PLANS))
def test_paths_every_format(fmt, group, act_order, plan):
    if PLANS[plan].fast:
        group = 128 if group in (32, 64) else group  # the fast path's K tile (128) must fit in a group
    k, n = 256, 96
    qw, w = make_weight(fmt, k, n, group, act_order)
    m = 1 if PLANS[plan].path == "gemv" else 5
    x = torch.randn(m, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16) if "split" in plan else None
    check_product(w4a16.run_plan(x, qw, bias, PLANS[plan]), x, w, bias)


@pytest.mark.parametrize("fmt,group,act_order", [("awq", 32, False), ("gptq", 64, True)])
@pytest.mark.parametrize("m", [1, 3])
def test_silu_gated_input(fmt, group, act_order, m):
    """down_proj(silu(gate) * up): at M=1 the GEMV applies the activation in its loads, rounded like the
    activation kernel, so it equals the separate kernels bit for bit; at M=3 the separate kernel runs."""
    from kernels import activation

    qw, w = make_weight(fmt, 256, 96, group, act_order)
    x = torch.randn(m, 512, dtype=torch.bfloat16)
    y = w4a16.w4a16_linear(x, qw, None, silu_gated=True)
    h = activation.silu_and_mul(x)
    assert torch.equal(y, w4a16.w4a16_linear(h, qw))
    check_product(y, h, w)
    with pytest.raises(ValueError, match="expects 512"):
        w4a16.w4a16_linear(h, qw, None, silu_gated=True)
    with pytest.raises(ValueError, match="gate, up"):  # run_plan checks the width too (it would read past x)
        w4a16.run_plan(h[:1], qw, None, PLANS["gemv"], silu_gated=True)


MMA_PLANS = {  # num_stages=1 as in the shipped plans (the kernel prefetches the next K tile itself)
    "mma": w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, num_warps=1, num_stages=1),
    "mma_split_two_warps": w4a16.Plan("mma", block_m=8, block_n=128, block_k=32, k_per_split=96, num_warps=2,
                                      num_stages=1),
    "mma_split_two_launches": w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, k_per_split=64, num_warps=1,
                                         num_stages=1, serial=False),
    "mma_k_warps": w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, num_warps=4, num_stages=1, k_warps=4),
    "mma_k_warps_split": w4a16.Plan("mma", block_m=8, block_n=128, block_k=32, k_per_split=128, num_warps=4,
                                    num_stages=1, k_warps=2),
    "mma_k_warps_two_launches": w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, k_per_split=128, num_warps=4,
                                           num_stages=1, k_warps=4, serial=False),
}


@pytest.mark.parametrize("fmt,group,act_order,m,k,n,dtype,scale_dtype,plan", [
    ("awq", 32, False, 1, 256, 128, torch.bfloat16, torch.float16, "mma"),  # EVEN; fp16 scales, bf16 x
    ("gptq", 64, True, 5, 256, 96, torch.bfloat16, torch.bfloat16, "mma"),  # act-order: x permuted first
    ("ct_sym", -1, False, 8, 200, 104, torch.float16, torch.float16, "mma"),  # per channel, ragged K and N
    ("ct_asym", 128, False, 16, 256, 128, torch.bfloat16, torch.bfloat16, "mma"),  # two sets of 8 rows of x
    ("gptq_v2", 32, False, 11, 224, 96, torch.float16, torch.float16, "mma_split_two_warps"),  # short last split
    ("gptq", 64, True, 1, 256, 104, torch.bfloat16, torch.float16, "mma_split_two_warps"),
    ("ct_sym", 32, False, 16, 200, 128, torch.bfloat16, torch.bfloat16, "mma_split_two_launches"),
    ("awq", 32, False, 1, 256, 128, torch.bfloat16, torch.float16, "mma_k_warps"),  # 4 warps split K, EVEN
    ("ct_sym", -1, False, 8, 200, 104, torch.float16, torch.float16, "mma_k_warps"),  # ragged: warps past K
    ("ct_asym", 128, False, 16, 256, 128, torch.bfloat16, torch.bfloat16, "mma_k_warps_split"),
    ("gptq", 64, True, 3, 320, 96, torch.bfloat16, torch.bfloat16, "mma_k_warps_split"),  # short last split
    ("awq", 32, False, 4, 288, 128, torch.bfloat16, torch.bfloat16, "mma_k_warps_split"),  # last split: one tile
    ("ct_asym", 32, False, 2, 416, 64, torch.float16, torch.float16, "mma_k_warps_two_launches"),
    # two sets of 8 rows with x one tile ahead, ragged K or N, k_warps (the M = 16 plans of the eighth session)
    ("ct_sym", -1, False, 12, 200, 104, torch.float16, torch.float16, "mma_k_warps"),
    ("gptq", 64, True, 16, 320, 96, torch.bfloat16, torch.bfloat16, "mma_k_warps_split"),
    ("ct_asym", 32, False, 13, 416, 64, torch.float16, torch.float16, "mma_k_warps_two_launches"),
    ("ct_sym", -1, False, 16, 232, 104, torch.bfloat16, torch.float16, "mma"),
])
def test_mma_path(fmt, group, act_order, m, k, n, dtype, scale_dtype, plan):
    """The tensor-core GEMV (interpreted: its mma computed from the same per-lane fragments, kernels/w4a16_mma.py)
    on every format, fp16 and bf16 x (OFF + c in A, the sum of x taken off), up to 16 rows of x, split-K in one
    launch and in two, K split between the warps of a program too (``k_warps``)."""
    qw, w = make_weight(fmt, k, n, group, act_order, scale_dtype=scale_dtype)
    x = torch.randn(m, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype) if "split" in plan else None
    check_product(w4a16.run_plan(x, qw, bias, MMA_PLANS[plan]), x, w, bias)


def test_mma_path_bad_input_raises():
    """Weights, activations, plans and inputs the mma path cannot take raise, naming what is wrong (the
    activation of a gated input runs first: fused, the GEMV measured 28% slower)."""
    qw, _ = make_weight("awq", 256, 64, 64, False)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    plan = MMA_PLANS["mma"]
    with pytest.raises(ValueError, match="fp16/bf16 x"):
        w4a16.run_plan(x.float(), qw, None, plan)
    qw8, _ = make_weight("gptq", 256, 64, 64, False, bits=8)
    with pytest.raises(ValueError, match="4-bit weights"):
        w4a16.run_plan(x, qw8, None, plan)
    with pytest.raises(ValueError, match="at most 16 rows"):
        w4a16.run_plan(torch.randn(17, 256, dtype=torch.bfloat16), qw, None, plan)
    for bad, what in (({"block_k": 16}, "block_k a multiple of 32"), ({"k_per_split": 48}, "k_per_split a multiple"),
                      ({"block_n": 128}, "block_n = 64 x num_warps"),
                      ({"num_warps": 3, "block_n": 64, "k_warps": 2}, "num_warps a multiple of k_warps"),
                      ({"num_warps": 2, "k_warps": 2, "k_per_split": 96}, "multiple of block_k x k_warps")):
        with pytest.raises(ValueError, match=what):
            w4a16.run_plan(x, qw, None, dataclasses.replace(plan, **bad))
    with pytest.raises(ValueError, match="gemv path only"):
        w4a16.run_plan(torch.randn(1, 512, dtype=torch.bfloat16), qw, None, plan, silu_gated=True)


def test_fp32_activations_skip_the_mma_path():
    """choose_plan keeps fp32 x (mma=False) off the tensor-core GEMV, also where TUNED names it."""
    assert w4a16.TUNED[(1, 12288, 4096)].path == "mma"
    assert w4a16.choose_plan(1, 12288, 4096, 4, 128, 132, False).path == "gemv"
    assert w4a16.choose_plan(4, 1536, 576, 4, 64, 132, False).path == "tc"
    qw, w = make_weight("awq", 256, 64, 64, False)
    x = torch.randn(3, 256)
    check_product(w4a16.w4a16_linear(x, qw), x, w)  # fp32 x: the tc path, not the mma path's ValueError


def test_gemv_split_k_reduction_in_one_launch_is_deterministic():
    """The last program to finish adds the partial sums in split order, like the second kernel does: the same bits;
    every arrival counter is back at 0 afterwards (the next call depends on it)."""
    qw, w = make_weight("gptq", 256, 96, 32, True)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    one = w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32, k_per_split=64)
    two = w4a16.Plan("gemv", block_m=1, block_n=32, block_k=32, k_per_split=64, serial=False)
    y = w4a16.run_plan(x, qw, bias, one)
    check_product(y, x, w, bias)
    assert torch.equal(y, w4a16.run_plan(x, qw, bias, two))
    assert torch.equal(y, w4a16.run_plan(x, qw, bias, one))
    assert int(w4a16._locks(x.device, 3).abs().sum()) == 0
    with pytest.raises(ValueError, match="column blocks"):
        w4a16._locks(x.device, w4a16._MAX_LOCKS + 1)


@pytest.mark.parametrize("splits", [2, 3, 4, 5, 6, 8, 9])
def test_splitk_reduce_adds_in_split_order(splits):
    """The second kernel of split-K adds the fp32 partial sums in split order, four splits' loads at a time (whole
    rounds: 4, 8 splits; a short last round: 2, 3, 5, 6, 9), then the bias: the same bits as that sum in torch (an
    fp32 output: the interpreter truncates to bf16)."""
    part = torch.randn(splits, 3, 70)
    bias = torch.randn(70, dtype=torch.bfloat16)
    out = torch.empty(3, 70)
    split_k._reduce_kernel[(4,)](part, bias, out, 210, 70, splits, HAS_BIAS=True, BLOCK=64, PDL=False, TRIG=False,
                                 num_warps=4)
    ref = torch.zeros(3, 70)
    for s in range(splits):
        ref = ref + part[s]
    assert torch.equal(out, ref + bias.float())


@pytest.mark.skipif(DEVICE != "cuda", reason="streams: GPU only")
def test_gemv_on_two_streams_at_once():
    """Two streams running split-K GEMVs concurrently (each held back behind a sleep so they overlap) get the
    single-stream results: the arrival counters are per stream."""
    qw, _ = make_weight("awq", 4096, 4096, 128, False)
    plan = w4a16.Plan("gemv", block_m=1, block_n=128, block_k=128, k_per_split=512)
    xs = [torch.randn(1, 4096, dtype=torch.bfloat16) for _ in range(2)]
    want = [w4a16.run_plan(x, qw, None, plan) for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    for _ in range(3):
        got = []
        for stream, x in zip(streams, xs):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)
                got.append([w4a16.run_plan(x, qw, None, plan) for _ in range(20)])
        torch.cuda.synchronize()
        for ys, y0 in zip(got, want):
            assert all(torch.equal(y, y0) for y in ys)


def test_split_k_counters_are_never_allocated_inside_a_graph_capture(monkeypatch):
    """A stream's first split-K GEMV inside a CUDA graph capture raises: its counters would live in the graph's
    pool, freed with the graph while the cache kept them (a later capture then counted in others' memory)."""
    fake = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 4242})())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(w4a16, "_LOCKS", {(fake, 4242): "allocated before the capture"})
    assert w4a16._locks(fake, 8) == "allocated before the capture"
    monkeypatch.setattr(w4a16, "_LOCKS", {})
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        w4a16._locks(fake, 8)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: GPU only")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")  # the capture that raises records nothing
def test_split_k_gemv_in_graphs_captured_one_after_another():
    """A stream's first split-K GEMV inside a capture raises (its counters would come from the graph pool);
    warmed up on the stream first, graphs captured, freed and captured again replay the eager result."""
    qw, _ = make_weight("awq", 4096, 4096, 128, False)
    plan = w4a16.Plan("gemv", block_m=1, block_n=128, block_k=128, k_per_split=512)
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    want = w4a16.run_plan(x, qw, None, plan)
    stream = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            w4a16.run_plan(x, qw, None, plan)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        w4a16.run_plan(x, qw, None, plan)
    for _ in range(3):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = w4a16.run_plan(x, qw, None, plan)
        for _ in range(4):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, want)
        del graph, y


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_linear_default_plans(m, dtype):
    k, n = 192, 64  # K not a multiple of the group size: the last group is shorter
    qw, w = make_weight("gptq_v2", k, n, 128, True, scale_dtype=dtype)
    x = torch.randn(2, m, k, dtype=dtype)  # leading dims are flattened
    bias = torch.randn(n, dtype=dtype)
    y = w4a16.w4a16_linear(x, qw, bias)
    assert y.shape == (2, m, n)
    check_product(y.reshape(-1, n), x.reshape(-1, k), w, bias)


@pytest.mark.parametrize("bits", [8, 2])
def test_other_bit_widths(bits):
    qw, w = make_weight("gptq_v2", 128, 64, 64, False, bits=bits)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    check_product(w4a16.run_plan(x, qw, None, PLANS["gemv"]), x, w)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    check_product(w4a16.run_plan(x, qw, None, PLANS["gemm"]), x, w)


def test_plans_follow_shape():
    assert w4a16.choose_plan(1, 4096, 4096, 4, 128, 132).path == "gemv"
    assert w4a16.choose_plan(1, 12288, 4096, 4, 128, 132) == w4a16.TUNED[(1, 12288, 4096)]
    assert w4a16.choose_plan(16, 12288, 4096, 4, 128, 132) == w4a16.TUNED[(16, 12288, 4096)]
    assert w4a16.choose_plan(16, 12288, 4096, 4, 32, 132).block_k == 32  # the tuned tile does not fit a group of 32
    assert w4a16.choose_plan(1, 576, 1536, 4, 64, 132).path == "gemv"  # N <= K <= 4096
    assert w4a16.choose_plan(1, 1536, 576, 4, 64, 132).path == "mma"  # wider: the tensor-core GEMV by rule
    assert w4a16.choose_plan(1, 1536, 576, 4, 64, 132, False).path == "gemv"  # fp32 x
    m16 = w4a16.choose_plan(12, 6144, 4096, 4, 128, 132)  # 9..16 rows, not in TUNED: the tensor-core GEMV
    assert (m16.path, m16.block_m, m16.k_per_split) == ("mma", 16, 256)  # 16 splits, as measured
    assert w4a16.choose_plan(5, 4096, 4096, 4, 128, 132) == w4a16.TUNED[(8, 4096, 4096)]
    small = w4a16.choose_plan(3, 1536, 576, 4, 64, 132)  # 2..8 rows: the tensor-core GEMV by rule
    assert (small.path, small.block_k, small.num_warps) == ("mma", 64, 1)
    assert w4a16.choose_plan(3, 1536, 576, 4, 16, 132).path == "tc"  # a group of 16: no 32-row step inside
    assert w4a16.choose_plan(3, 1536, 576, 8, 64, 132).path == "gemm"  # 8-bit
    assert w4a16.choose_plan(16, 4096, 4096, 4, 128, 132) == w4a16.TUNED[(16, 4096, 4096)]
    assert w4a16.choose_plan(16, 4096, 4096, 4, 16, 132).path == "tc"  # a group of 16: no mma, no TUNED tile
    assert w4a16.choose_plan(16, 4096, 4096, 4, 64, 132).path == "mma"  # a group of 64: the rule, block_k 64
    assert w4a16.choose_plan(40, 1536, 576, 4, 64, 132).path == "tc"
    assert w4a16.choose_plan(40, 1536, 576, 8, 64, 132).path == "gemm"  # 8-bit: the older GEMM
    assert w4a16.choose_plan(200, 12288, 4096, 4, 128, 132) == w4a16.TUNED[(256, 12288, 4096)]
    assert w4a16.choose_plan(100, 4096, 11008, 4, 128, 132) == w4a16.TUNED[(128, 4096, 11008)]  # 65-128 rows
    assert w4a16.choose_plan(129, 4096, 11008, 4, 128, 132) == w4a16.TUNED[(256, 4096, 11008)]
    big = w4a16.choose_plan(128, 4096, 4096, 4, 128, 132)  # 64 tiles on 132 SMs: K in 3 splits
    assert (big.path, big.block_m, big.block_n, big.block_k, big.k_per_split) == ("tc", 128, 64, 64, 1408)
    ada = w4a16.choose_plan(256, 4096, 11008, 4, 128, 128)  # an RTX 4090: no H200 plan, tiles that fit 99 KB
    assert ada != w4a16.TUNED[(256, 4096, 11008)] and (ada.path, ada.block_k, ada.num_warps) == ("tc", 64, 4)
    assert w4a16.choose_plan(1, 12288, 4096, 4, 128, 28).k_per_split != w4a16.TUNED[(1, 12288, 4096)].k_per_split
    assert w4a16.choose_plan(200, 28672, 4096, 4, 128, 132).k_per_split == 4096  # 448 tiles: no split
    assert w4a16.choose_plan(256, 4096, 4096, 4, 128, 132) == w4a16.TUNED[(256, 4096, 4096)]
    assert w4a16.choose_plan(256, 4096, 4096, 4, 32, 132).path == "dequant"  # the tuned tile does not fit
    assert w4a16.choose_plan(100, 1536, 576, 4, 64, 132).block_k == 64  # the group's tile
    assert w4a16.choose_plan(100, 1536, 576, 8, 64, 132).path == "dequant"  # 8-bit above 64 rows
    assert w4a16.choose_plan(4096, 4096, 4096, 4, 128, 132).path == "dequant"
    assert w4a16.choose_plan(16, 4096, 4096, 4, 8, 132).path == "dequant"  # no 16-row K tile inside a group


def test_bad_input_raises():
    qw, _ = make_weight("awq", 64, 32, 32, False)
    with pytest.raises(ValueError, match="features"):
        w4a16.w4a16_linear(torch.randn(1, 63, dtype=torch.bfloat16), qw)
    with pytest.raises(ValueError, match="group size"):
        w4a16.run_plan(torch.randn(1, 64, dtype=torch.bfloat16), qw, None, PLANS["gemm_fast"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_path_fp16_and_act_order(dtype):
    qw, w = make_weight("gptq", 384, 64, 128, True, scale_dtype=dtype)
    x = torch.randn(3, 384, dtype=dtype)
    check_product(w4a16.run_plan(x, qw, None, PLANS["gemm_fast"]), x, w)


@pytest.mark.parametrize("key", [(256, 22016, 4096), (256, 4096, 11008), (128, 4096, 11008)])
def test_tc_tuned_large_m_tiles(key):
    """The tiles of the M > 64 TUNED tc plans (128 x 64 x 128; 256 x 128 x 64 on 8 warps) on a small shape: 70 rows
    (part of one row tile), N = 200 (not a multiple of 64 or 128), K = 320 in splits of 128 (the last one 64 rows,
    one tile), so every split's K loop runs at least once as the kernel assumes."""
    tuned = w4a16.TUNED[key]
    qw, w = make_weight("awq", 320, 200, 128, False, scale_dtype=torch.bfloat16)
    x = torch.randn(70, 320, dtype=torch.bfloat16)
    plan = dataclasses.replace(tuned, k_per_split=128)
    check_product(w4a16.run_plan(x, qw, None, plan), x, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("swap", [False, True])
def test_tc_path_ragged_k_act_order_every_mode(dtype, swap):
    """The tc kernel with K not a multiple of its tile (192 = 128 + a short last group), N not a multiple of
    BLOCK_N, act-order (x permuted by the caller), bias, and each dequantization mode (in the interpreter every
    mode runs as mode 0)."""
    qw, w = make_weight("gptq_v2", 192, 80, 128, True, scale_dtype=dtype)
    x = torch.randn(20, 192, dtype=dtype)
    bias = torch.randn(80, dtype=dtype)
    for mode in (1, 2, 3):
        plan = w4a16.Plan("tc", block_m=16, block_n=64, block_k=128, swap=swap, mode=mode)
        check_product(w4a16.run_plan(x, qw, bias, plan), x, w, bias)
    with pytest.raises(ValueError, match="4-bit"):
        qw8, _ = make_weight("gptq_v2", 128, 64, 64, False, bits=8)
        w4a16.run_plan(x[:, :128], qw8, None, w4a16.Plan("tc", block_m=16, block_n=64, block_k=64))
    with pytest.raises(ValueError, match="k_per_split a multiple of block_k"):  # splits would overlap
        w4a16.run_plan(x, qw, None, w4a16.Plan("tc", block_m=16, block_n=64, block_k=64, k_per_split=96))


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled PTX: GPU only")
@pytest.mark.parametrize("plan", ["tc", "tc_split_swap", "tc_bf16_scale", "gemm_fast"])
def test_pre_hopper_packed_bf16_gives_the_same_bits(plan, monkeypatch):
    """Before sm_90 the tc GEMM (modes 1-3) and the fast GEMM write their packed bf16 sub / mul as fma (no such
    PTX there; tests/test_compile_targets.py): forced on this GPU, the fma forms give the very same output. Half
    the columns have negative scales, and 104 columns leave the last tile partly masked (scale +0 there)."""
    p = PLANS[plan]
    qw, w = make_weight("awq", 256, 104, 128, False, scale_dtype=torch.bfloat16)
    qw.scales[:, ::2] *= -1  # c - z times a negative scale: the product's sign, and -0 where c = z
    w[::2] *= -1
    x = torch.randn(24, 256, dtype=torch.bfloat16)
    want = w4a16.run_plan(x, qw, None, p)
    monkeypatch.setattr(w4a16, "hopper", lambda t: False)
    got = w4a16.run_plan(x, qw, None, p)
    assert torch.equal(got, want)
    check_product(got, x, w)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled PTX: GPU only")
@pytest.mark.parametrize("swap", [False, True])
def test_tc_fp16_modes_give_mode_0s_bits(swap, monkeypatch):
    """With fp16 x and fp16 scales the tc GEMM runs the plan's mode, whose modes 1 and 3 multiply c - z by the scale
    in packed fp16 (one rounding of an exact product): the bits of the plain mode 0, half the scales negative, 104
    columns (the last tile partly masked). Mode 2 (the scale after the dot) rounds otherwise: within the product's
    tolerance. bf16 scales with fp16 x run mode 0 (an fp16 scale could round them)."""
    launched = []
    monkeypatch.setattr(w4a16, "_gemm_tc_kernel", Launches(w4a16._gemm_tc_kernel, launched))
    qw, w = make_weight("awq", 256, 104, 128, False, scale_dtype=torch.float16)
    qw.scales[:, ::2] *= -1
    w[::2] *= -1
    x = torch.randn(24, 256, dtype=torch.float16)
    plan = w4a16.Plan("tc", block_m=16, block_n=64, block_k=128, swap=swap, mode=0)
    want = w4a16.run_plan(x, qw, None, plan)
    check_product(want, x, w)
    for mode in (1, 3):
        got = w4a16.run_plan(x, qw, None, dataclasses.replace(plan, mode=mode))
        assert launched[-1]["MODE"] == mode and torch.equal(got, want), mode
    check_product(w4a16.run_plan(x, qw, None, dataclasses.replace(plan, mode=2)), x, w)
    assert launched[-1]["MODE"] == 2
    qw.scales = qw.scales.to(torch.bfloat16)
    check_product(w4a16.run_plan(x, qw, None, dataclasses.replace(plan, mode=3)), x, w)  # w from the fp16 scales:
    assert launched[-1]["MODE"] == 0  # within the tolerance of bf16-rounded ones


@pytest.mark.parametrize("ahead", [8, 16])
def test_in_launch_split_sums_loading_more_splits_at_once_give_the_same_bits(monkeypatch, ahead):
    """The GEMVs' in-launch sums with AHEAD splits' loads in flight (a short last round: 9 splits) add in split
    order like AHEAD = 4: the same bits, for the mma GEMV's one set of rows (M <= 8) and two (M 9-16)."""
    qw, w = make_weight("awq", 288, 128, 32, False)
    bias = torch.randn(128, dtype=torch.float16)
    plans = [(w4a16.Plan("gemv", block_m=1, block_n=64, block_k=32, k_per_split=32), 1),
             (w4a16.Plan("mma", block_m=8, block_n=64, block_k=32, k_per_split=32, num_warps=1, num_stages=1), 3),
             (w4a16.Plan("mma", block_m=16, block_n=64, block_k=32, k_per_split=32, num_warps=1, num_stages=1), 12)]
    launched = []
    for owner, name in ((w4a16, "_gemv_kernel"), (w4a16_mma, "_gemv_mma_kernel")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, Launches(real, launched))
    for plan, rows in plans:
        x = torch.randn(rows, 288, dtype=torch.float16)
        runs = []
        for n in (4, ahead):
            monkeypatch.setattr(w4a16, "GEMV_SUM_AHEAD", n)
            monkeypatch.setattr(w4a16, "MMA_SUM_AHEAD", n if rows <= 8 else 99)
            monkeypatch.setattr(w4a16, "MMA_SUM_AHEAD_16", n if rows > 8 else 99)
            runs.append(w4a16.run_plan(x, qw, bias, plan))
        assert torch.equal(*runs)
        check_product(runs[0], x, w, bias)
    assert [kw["AHEAD"] for kw in launched] == [4, ahead] * 3  # each M's setting reaches its launch

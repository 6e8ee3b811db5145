"""Dense linear layer: the torch reference used on CPU.

The Triton W4A16 kernels (fused 4-bit dequant + GEMV/GEMM) live in ``w4a16.py``; they consume
``kernels.quant_formats.QuantizedWeight``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: Rows per GEMM of the CPU reference. MKL's sgemm picks its micro-kernel and its thread split (over rows, or over
#: K, which changes the order of the sums) by the shape, M included, so the same row can round differently in
#: batches of different sizes. Which M give which choice depends on the CPU and the thread count: on an AVX-512 /
#: AMX Xeon with 2 threads, M = 8 rounds unlike M = 16, and 1536 -> 576 splits K for M = 64 .. 192 only. Running
#: every GEMM on exactly ROW_BLOCK rows (zero-padded) makes every row's result independent of its batch (checked by
#: tests/test_linear_ref.py, and through the engine by tests/test_engine_batching.py).
ROW_BLOCK = 16


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, batch-invariant on CPU.

    x: [M, K]; weight: [N, K]; bias: [N] or None; all the same float dtype. Returns [M, N] in x's dtype. On CPU
    the rows are zero-padded to a multiple of ``ROW_BLOCK`` and multiplied ``ROW_BLOCK`` rows per GEMM; elsewhere
    one ``F.linear``.
    """
    m = x.shape[0]
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if m % ROW_BLOCK:
        x = F.pad(x, (0, 0, 0, ROW_BLOCK - m % ROW_BLOCK))
    if x.shape[0] == ROW_BLOCK:  # a decode step's usual case: one GEMM, no concatenation (5 us a call less)
        return F.linear(x, weight, bias)[:m]
    return torch.cat([F.linear(x[i:i + ROW_BLOCK], weight, bias) for i in range(0, x.shape[0], ROW_BLOCK)])[:m]

"""Dense linear layer: the torch reference used on CPU.

The Triton W4A16 kernels (fused 4-bit dequant + GEMV/GEMM) live in ``w4a16.py``; they consume
``kernels.quant_formats.QuantizedWeight``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: Row multiple the CPU reference pads to. MKL's sgemm picks its micro-kernel (and thread split) by the number of
#: rows M, so the same row can round differently in batches of different sizes; padding M to a multiple of 8
#: makes every row's result independent of its batch (checked by tests/test_engine_batching.py).
ROW_MULTIPLE = 8


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, batch-invariant on CPU.

    x: [M, K]; weight: [N, K]; bias: [N] or None; all the same float dtype. Returns [M, N] in x's dtype.
    Rows are padded with zeros to a multiple of ``ROW_MULTIPLE`` before the GEMM (CPU only) and cut after.
    """
    m = x.shape[0]
    if x.device.type == "cpu" and m % ROW_MULTIPLE:
        pad = ROW_MULTIPLE - m % ROW_MULTIPLE
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return F.linear(x, weight, bias)[:m]

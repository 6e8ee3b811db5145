"""The building blocks of a decoder layer, each calling one kernel (``kernels/``)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul_ref
from kernels.linear import linear_ref
from kernels.norm import rms_norm_ref
from kernels.quant_formats import QuantizedWeight, dequantize
from kernels.rotary import rope_cos_sin, rotary_ref


class Linear(nn.Module):
    """y = x W^T (+ b) with W [N, K] dense, built from one or more checkpoint weights stacked along N.

    Quantized weights are dequantized once at load (the torch reference path; the fused W4A16 Triton kernels
    take the QuantizedWeight directly on CUDA).
    """

    def __init__(self, weights: list[torch.Tensor | QuantizedWeight], biases: list[torch.Tensor | None],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        dense = [dequantize(w) if isinstance(w, QuantizedWeight) else w for w in weights]
        self.weight = nn.Parameter(torch.cat(dense).to(device=device, dtype=dtype), requires_grad=False)
        self.bias = None
        if any(b is not None for b in biases):
            parts = [b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, dense)]
            self.bias = nn.Parameter(torch.cat(parts).to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_ref(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused: ``forward(x, residual) -> (normed, x + residual)``."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm_ref(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE with a precomputed float32 cos/sin table [max_positions, head_dim]."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device: torch.device):
        super().__init__()
        self.register_buffer("cos_sin", rope_cos_sin(head_dim, max_positions, base, device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return rotary_ref(positions, q, k, self.cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)

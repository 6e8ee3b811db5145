"""RMSNorm (Zhang & Sennrich 2019) with the residual add fused: the torch reference.

Matches Hugging Face ``LlamaRMSNorm``: statistics in fp32, result cast back, then times the weight.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rmsnorm(x + residual) * weight, x + residual)``; with no residual the second item is ``x``.

    x, residual: [T, H]; weight: [H]. Outputs are [T, H] in x's dtype.
    """
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x

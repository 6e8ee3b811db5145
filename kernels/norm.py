"""RMSNorm (Zhang & Sennrich 2019) with the residual add fused: the torch reference and the Triton kernel.

Matches Hugging Face ``LlamaRMSNorm``: statistics in fp32, result cast back, then times the weight.
"""
from __future__ import annotations

import torch

from ._triton import early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl


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


@jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, hidden, eps, stride_x, stride_r, stride_o, stride_s,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (T,): one row. Rounds like the reference: the sum to x's dtype, the normalised row to x's dtype, then
    the product with the weight to the output dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the previous kernel ends
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    pdl_trigger(TRIG)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    h = (x * inv).to(sum_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`rms_norm_ref`: ``(rmsnorm(x + residual) * weight, x + residual)`` in one pass.

    x, residual: [T, H] (last dim contiguous); weight: [H]. Returns new tensors (the second is ``x`` itself when
    ``residual`` is None), dtypes as the reference's: the sum in x's dtype, the output in weight's and x's promoted.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(x) if residual is not None else x
    block = next_pow2(hidden)
    if tokens:
        res = residual if residual is not None else x
        _rms_norm_kernel[(tokens,)](x, res, weight, out, summed, hidden, eps, x.stride(0), res.stride(0), out.stride(0),
                                    summed.stride(0), HAS_RES=residual is not None, BLOCK=block, PDL=pdl(x),
                                    TRIG=early_trigger(x),
                                    num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False)
    return out, summed

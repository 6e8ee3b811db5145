"""SiLU-and-mul, the gated MLP activation of Llama (Shazeer 2020, GLU variants): the torch reference and the
Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import cdiv, early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) → silu(gate) * up: [T, I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         TRIG: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)): one row chunk of gate and up. Rounds like the reference (silu, then the product)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_trigger(TRIG)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`silu_and_mul_ref`: x [T, 2I] (last dim contiguous) -> silu(gate) * up [T, I] in x's dtype."""
    tokens, inter = x.shape[0], x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)
    block = min(next_pow2(inter), 1024)
    if tokens:
        _silu_and_mul_kernel[(tokens, cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                                                          PDL=pdl(x), TRIG=early_trigger(x), num_warps=4,
                                                          enable_fp_fusion=False)
    return out

"""SiLU-and-mul, the gated MLP activation of Llama (Shazeer 2020, GLU variants): the torch reference and the
Triton kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import cdiv, early_trigger, jit, next_pow2, pdl, pdl_trigger, pdl_wait, tl
from .split_k import SplitK, add_pair, load_pair


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) → silu(gate) * up: [T, I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, stride_split, b_ptr,
                         BLOCK: tl.constexpr, SPLITK: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr, TRIG: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)): one row chunk of gate and up. Rounds like the reference (silu, then the product).
    SPLITK: x is split 0 of a ``split_k.SplitK`` (fp32, ``SPLITS`` of them ``stride_split`` apart, + its bias [2I]
    with HAS_BIAS), added once loaded."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x = load_pair(x_ptr + row * stride_x + cols, inter, mask, stride_split, SPLITS, SPLITK)  # gate, up
    pdl_trigger(TRIG)
    dt = out_ptr.dtype.element_ty
    gate, up = add_pair(x, b_ptr + cols, inter, mask, SPLITK, HAS_BIAS, dt)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor | SplitK) -> torch.Tensor:
    """Triton :func:`silu_and_mul_ref`: x [T, 2I] (last dim contiguous) -> silu(gate) * up [T, I] in x's dtype.
    x may be a ``split_k.SplitK`` (the gate/up projection with its split-K sums left to this kernel): each value's
    splits are added as it is loaded, giving the bits the summed product would have given (ValueError if its last
    dim is not contiguous)."""
    tokens, inter, dtype, split = x.shape[0], x.shape[-1] // 2, x.dtype, isinstance(x, SplitK)
    splits, stride_split, bias = (x.splits, x.part.stride(0), x.bias) if split else (1, 0, None)
    x = x.part[0] if split else x
    if split and x.stride(-1) != 1:
        raise ValueError("silu_and_mul: a SplitK's last dim must be contiguous")  # a copy would take split 0 alone
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(tokens, inter, dtype=dtype, device=x.device)
    # a SplitK's S partial sums per value are spread over more programs (43 at one token of I = 11008)
    block = min(next_pow2(inter), 256 if split else 1024)
    if tokens:
        _silu_and_mul_kernel[(tokens, cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), stride_split,
                                                          bias if bias is not None else out, BLOCK=block,
                                                          SPLITK=split, SPLITS=splits,
                                                          HAS_BIAS=bias is not None, PDL=pdl(x),
                                                          TRIG=early_trigger(x), num_warps=4, enable_fp_fusion=False)
    return out

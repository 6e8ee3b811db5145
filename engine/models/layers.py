"""The building blocks of a decoder layer, each calling one kernel (``kernels/``)."""
from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from kernels.quant_formats import QuantizedWeight, concat_out_features, dequantize
from kernels.rotary import rope_cos_sin
from kernels.split_k import SplitK, as_tensor


def _out_features(w: torch.Tensor | QuantizedWeight) -> int:
    return w.out_features if isinstance(w, QuantizedWeight) else w.shape[0]


class Linear(nn.Module):
    """y = x W^T (+ b), W [N, K] built from one or more checkpoint weights stacked along N (q/k/v, gate/up).

    On CUDA, 4-bit weights stay packed (``self.qweight``) and run through the fused W4A16 Triton kernels; on
    CPU, and when stacked parts cannot share one packed weight, they are dequantized once at load into
    ``self.weight`` (the torch reference path).
    """

    def __init__(self, weights: list[torch.Tensor | QuantizedWeight], biases: list[torch.Tensor | None],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight, self.qweight, self.bias = None, None, None
        if device.type == "cuda" and all(isinstance(w, QuantizedWeight) for w in weights):
            packed = concat_out_features(weights)
            self.qweight = packed.to(device) if packed is not None else None
        if self.qweight is None:
            dense = [dequantize(w) if isinstance(w, QuantizedWeight) else w for w in weights]
            one = dense[0] if len(dense) == 1 else torch.cat(dense)  # one part: no copy (a tied LM head shares
            # the embeddings' memory)
            self.weight = nn.Parameter(one.to(device=device, dtype=dtype), requires_grad=False)
        if any(b is not None for b in biases):
            parts = [b if b is not None else torch.zeros(_out_features(w)) for b, w in zip(biases, weights)]
            self.bias = nn.Parameter(torch.cat(parts).to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor | SplitK, silu_gated: bool = False,
                defer_sum: bool = False) -> torch.Tensor | SplitK:
        """x [T, K] -> [T, N]; ``silu_gated``: x is an MLP's cat(gate, up) [T, 2K] and the input is
        silu(gate) * up (on the W4A16 GEMV the activation runs inside the product's loads). ``defer_sum``: a
        W4A16 product that splits K may return its partial sums (``kernels.split_k.SplitK``), for a next op that
        adds them as it loads (rotary with the KV write, SiLU-and-mul); x may be such a SplitK."""
        if self.qweight is not None:
            return ops.w4a16_linear(x, self.qweight, self.bias, silu_gated, defer_sum)
        return ops.linear(ops.silu_and_mul(x) if silu_gated else as_tensor(x), self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm with the residual add fused: ``forward(x, residual) -> (normed, x + residual)``."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """RoPE's precomputed float32 cos/sin table ``cos_sin`` [max_positions, head_dim] (``kernels.rotary``):
    default frequencies from ``base``, or a scaled RoPE's ``inv_freq`` [head_dim/2] and ``attention_factor``
    (``engine.models.rope``). The rotation itself runs in ``PagedAttention``, fused with the KV-cache write."""

    def __init__(self, head_dim: int, max_positions: int, base: float, device: torch.device,
                 inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0):
        super().__init__()
        table = rope_cos_sin(head_dim, max_positions, base, device, inv_freq, attention_factor)
        self.register_buffer("cos_sin", table, persistent=False)

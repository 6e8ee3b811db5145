"""SiLU-and-mul, the gated MLP activation of Llama (Shazeer 2020, GLU variants): the torch reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = cat(gate, up) → silu(gate) * up: [T, I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

"""Rotary position embedding (RoFormer, Su et al. 2021), GPT-NeoX "rotate half" form: the torch reference."""
from __future__ import annotations

import torch


def rope_cos_sin(head_dim: int, max_positions: int, base: float, device=None) -> torch.Tensor:
    """The cos/sin cache: float32 [max_positions, head_dim] = cat(cos(p·f), sin(p·f)) over the head_dim/2 freqs.

    f_i = base^(-2i/head_dim), computed as Hugging Face's default rotary does so the values match bit for bit.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by their positions (int64 [T]); returns new tensors.

    cos_sin: from :func:`rope_cos_sin`, [max_positions, D] float32 (cos half, then sin half).
    """
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :].to(q.dtype)
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :].to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)

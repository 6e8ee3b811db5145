"""RoPE scaling: the rotary frequencies a config.json asks for, and how many positions they are meant for.

Sources: Su et al., "RoFormer" (2021) for the rotation; Chen et al., "Extending Context Window of Large Language
Models via Positional Interpolation" (2023) for ``linear``; Meta's Llama 3.1 release for ``llama3`` (frequencies
with wavelengths between ``original_max_position_embeddings / high_freq_factor`` and ``/ low_freq_factor`` are
blended between kept and divided by ``factor``; longer ones divided, shorter ones kept); Peng et al., "YaRN"
(2023) for ``yarn`` (a linear ramp over the dimensions between ``beta_fast`` and ``beta_slow`` rotations in the
original context, and cos/sin scaled by the attention factor 0.1·ln(factor) + 1). The values follow Hugging Face
``rope_parameters`` / ``rope_scaling`` (older configs say ``type`` for ``rope_type``), so logits match
transformers' own models (tests/test_architectures.py).

This module stays torch-free at import (the installer's tuner reads :func:`rope_scaling` and
:func:`max_positions`); :func:`inv_freq` imports torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

#: rope types served; "dynamic" (dynamic NTK) is plain RoPE up to ``max_position_embeddings``, which
#: :func:`max_positions` keeps the context to (beyond it transformers rescales per sequence length)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class RopeError(ValueError):
    """A config's RoPE settings that the engine does not serve; the message names the setting."""


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE: ``rope_type`` (one of :data:`ROPE_TYPES`), ``theta`` (the base), ``params`` (the rest of
    its ``rope_parameters`` / ``rope_scaling`` dict: factor, low_freq_factor, ..., as floats or ints)."""

    rope_type: str
    theta: float
    params: dict = field(default_factory=dict)

    def factor(self) -> float:
        return float(self.params.get("factor") or 1.0)


def rope_scaling(cfg: dict) -> RopeScaling:
    """The :class:`RopeScaling` of a config.json dict (its ``text_config`` where it has one).

    Raises RopeError for a rope type outside :data:`ROPE_TYPES`, a partial rotary factor, or a scaled type
    missing its ``factor`` (YaRN's may follow from its original context, as in transformers), or ``llama3``
    missing ``low_freq_factor`` / ``high_freq_factor``.
    """
    cfg = cfg.get("text_config") or cfg
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type not in ROPE_TYPES:
        raise RopeError(f"rope_type {rope_type!r} is not supported yet (supported: {', '.join(ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise RopeError("partial_rotary_factor below 1 (RoPE on part of each head) is not supported yet")
    if rope_type == "yarn" and not params.get("factor") and params.get("original_max_position_embeddings"):
        # transformers' reading: the post-YaRN context over the original one
        params["factor"] = int(cfg.get("max_position_embeddings") or 4096) / params["original_max_position_embeddings"]
    missing = [k for k in ("factor", *(("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ()))
               if rope_type != "default" and not params.get(k)]
    if missing:
        raise RopeError(f"rope_type {rope_type!r} needs {', '.join(map(repr, missing))} in rope_scaling")
    return RopeScaling(rope_type, theta, params)


def max_positions(cfg: dict) -> int:
    """The longest sequence, in tokens, the model's RoPE is meant for: ``max_position_embeddings`` (4096 when
    absent), times ``factor`` for ``linear`` (vLLM's rule), ``original_max_position_embeddings`` x ``factor`` for
    ``yarn`` (where given; Qwen's long-context recipe keeps the original in ``max_position_embeddings``).
    Raises RopeError as :func:`rope_scaling` does."""
    scaling = rope_scaling(cfg)
    cfg = cfg.get("text_config") or cfg
    base = int(cfg.get("max_position_embeddings") or 4096)
    if scaling.rope_type == "linear":
        return int(base * scaling.factor())
    if scaling.rope_type == "yarn":
        return int(int(scaling.params.get("original_max_position_embeddings") or base) * scaling.factor())
    return base


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq, scaling: RopeScaling, head_dim: int, max_position_embeddings: int):
    """YaRN's frequencies and attention factor (module doc)."""
    import torch

    p, factor, base = scaling.params, scaling.factor(), scaling.theta
    original = int(p.get("original_max_position_embeddings") or max_position_embeddings)

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(p.get("beta_fast") or 32), dim_of(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency is kept (extrapolated), 0: divided by the factor (interpolated)
    freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    return freq, float(attention)


def _llama3(inv_freq, scaling: RopeScaling, max_position_embeddings: int):
    """Llama 3.1's frequencies (module doc); the original context defaults to ``max_position_embeddings``, as in
    transformers."""
    import torch

    p, factor = scaling.params, scaling.factor()
    old_len = float(p.get("original_max_position_embeddings") or max_position_embeddings)
    low_factor, high_factor = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    divided = torch.where(wavelen > old_len / low_factor, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * divided / factor + smooth * divided
    medium = (wavelen >= old_len / high_factor) & (wavelen <= old_len / low_factor)
    return torch.where(medium, blended, divided), 1.0


def inv_freq(scaling: RopeScaling, head_dim: int, max_position_embeddings: int):
    """(inverse frequencies float32 [head_dim / 2], attention factor that multiplies cos and sin) on the CPU.

    The default frequencies are theta^(-2i/head_dim), computed as Hugging Face's rotary does so that they match bit
    for bit; each scaled type changes them as the module doc says.
    """
    import torch

    base = 1.0 / (scaling.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return base / scaling.factor(), 1.0
    if scaling.rope_type == "llama3":
        return _llama3(base, scaling, max_position_embeddings)
    if scaling.rope_type == "yarn":
        return _yarn(base, scaling, head_dim, max_position_embeddings)
    return base, 1.0

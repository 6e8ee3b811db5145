"""How long a sequence a model serves: the positions its RoPE is meant for (``rope.max_positions``).

Mistral v0.1's ``sliding_window`` does not shorten it: the engine's attention implements the window
(``llama.sliding_window``), as vLLM's does. Torch-free at import (the installer's tuner reads it).
"""
from __future__ import annotations

from engine.models.rope import max_positions


def max_context(cfg: dict) -> tuple[int, str]:
    """(the longest prompt + completion the model serves, in tokens; the reason, for messages and the tuner).
    Raises ``rope.RopeError`` for RoPE settings not served."""
    cfg = cfg.get("text_config") or cfg
    limit, why = max_positions(cfg), "the model's max_position_embeddings"
    if limit != int(cfg.get("max_position_embeddings") or 4096):
        why = "the model's max_position_embeddings with its RoPE scaling"
    return limit, why

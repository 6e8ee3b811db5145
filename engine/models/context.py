"""How long a sequence a model serves: the positions its RoPE is meant for (``rope.max_positions``), capped by
a sliding window, which the engine's attention does not implement.

Mistral's configs (v0.1) attend over the last ``sliding_window`` tokens only; up to that length full attention is
the same, so the engine serves them that long, as vLLM does with its sliding window turned off. Qwen2 and Qwen3
carry a ``sliding_window`` that applies only with ``use_sliding_window``, which ``llama.check_architecture``
refuses. Torch-free at import (the installer's tuner reads it).
"""
from __future__ import annotations

from engine.models.rope import max_positions


def max_context(cfg: dict) -> tuple[int, str]:
    """(the longest prompt + completion the model serves, in tokens; the reason, for messages and the tuner).
    Raises ``rope.RopeError`` for RoPE settings not served."""
    arch = (cfg.get("architectures") or [""])[0]
    cfg = cfg.get("text_config") or cfg
    limit, why = max_positions(cfg), "the model's max_position_embeddings"
    if limit != int(cfg.get("max_position_embeddings") or 4096):
        why = "the model's max_position_embeddings with its RoPE scaling"
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM" and isinstance(window, int) and 0 < window < limit:
        limit, why = window, (f"the model's sliding window ({window} tokens; beyond it this engine's full "
                              "attention would differ from the model's)")
    return limit, why

"""A model folder's config.json checked for what the engine serves, without torch (the installer, the planner and
``appliance serve`` refuse a model in one line before anything loads; the loader checks the same at load):
its architecture and RoPE (:func:`check_architecture`), its quantization (:func:`check_quantization`)."""
from __future__ import annotations

import json
from pathlib import Path

from engine.models.rope import RopeError, rope_scaling
from kernels.quant_config import SUPPORTED_BITS, parse_quant_config

#: config.json ``architectures`` the engine serves (all with the Llama code: ``llama.MODELS``)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class CheckpointError(ValueError):
    """The folder is not a checkpoint we can load; the message says what is missing or unsupported."""


def read_config(folder: Path) -> dict:
    """A model folder's config.json as a dict; raises CheckpointError when it is missing, not JSON, or not an
    object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return cfg


def check_quantization(cfg: dict) -> None:
    """Raise CheckpointError for a ``quantization_config`` this loader cannot read (design.md §5): a method or
    format other than AWQ gemm, GPTQ v1/v2 and compressed-tensors pack-quantized, or a bit width the format does
    not hold here (AWQ gemm: 4; the others: ``quant_config.SUPPORTED_BITS``). Nothing for a dense config."""
    qc = cfg.get("quantization_config")
    if not qc:  # absent, null or {}: dense, as the installer and the planner read it
        return
    try:
        if not isinstance(qc, dict):
            raise ValueError("not an object")
        spec = parse_quant_config(qc)
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # AttributeError: a list where a dict belongs
        raise CheckpointError(f"quantization_config: {e}") from None
    allowed = (4,) if spec.method == "awq" else SUPPORTED_BITS
    if spec.bits not in allowed:
        raise CheckpointError(f"quantization_config: {spec.method} with {spec.bits}-bit weights is not supported "
                              f"(bits: {', '.join(map(str, allowed))})")


def check_architecture(cfg: dict) -> str:
    """The :data:`ARCHITECTURES` entry of a config.json dict (no ``architectures``: Llama). Raises CheckpointError
    for an architecture not served, sliding-window attention switched on in Qwen2 / Qwen3 (``use_sliding_window``, which
    their releases ship off; Mistral's window is served: ``llama.sliding_window``), or RoPE settings not served
    (``rope.rope_scaling``)."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"architecture {arch!r} is not supported yet (supported: {', '.join(ARCHITECTURES)})")
    if cfg.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window) is not supported yet")
    try:
        rope_scaling(cfg)
    except RopeError as exc:
        raise CheckpointError(str(exc)) from None
    return arch

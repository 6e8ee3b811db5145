"""A checkpoint's ``quantization_config`` read into a :class:`QuantSpec` (design.md §5: AWQ gemm, GPTQ v1/v2,
compressed-tensors pack-quantized), without torch: the installer and the planner check a model with it before
anything loads; ``quant_formats`` repacks the tensors it describes."""
from __future__ import annotations

from dataclasses import dataclass

#: bit widths the unpacking reads (AWQ gemm's interleaved layout: 4 only)
SUPPORTED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class QuantSpec:
    """A checkpoint's ``quantization_config`` normalised: method "awq" | "gptq" | "compressed-tensors"; fmt "gemm",
    "gptq", "gptq_v2" or "pack-quantized"; group_size -1 = per-channel."""

    method: str
    fmt: str
    bits: int
    group_size: int
    sym: bool
    desc_act: bool


def parse_quant_config(cfg: dict) -> QuantSpec:
    """Normalise a ``quantization_config`` (AutoAWQ, AutoGPTQ/gptqmodel or compressed-tensors spelling)."""
    method = str(cfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    sym = bool(cfg["sym"]) if "sym" in cfg else not cfg.get("zero_point", False)
    fmt = cfg.get("checkpoint_format") or cfg.get("format") or cfg.get("version")
    if method == "awq":
        fmt = str(fmt or "gemm").lower()
        if fmt != "gemm":
            raise ValueError(f"AWQ version {fmt!r} is not supported (only 'gemm')")
    elif method == "gptq":
        fmt = str(fmt or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (only 'gptq' and 'gptq_v2')")
    else:
        raise ValueError(f"quant_method {method!r} is not supported (awq, gptq, compressed-tensors)")
    return QuantSpec(method, fmt, bits, group_size, sym, bool(cfg.get("desc_act", False)))


def _parse_compressed_tensors(cfg: dict) -> QuantSpec:
    fmt = cfg.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (only 'pack-quantized')")
    schemes = {repr(sorted(g.get("weights", {}).items())): g["weights"] for g in cfg.get("config_groups", {}).values()}
    if len(schemes) != 1:
        raise ValueError(f"compressed-tensors: expected one weight scheme in config_groups, found {len(schemes)}")
    w = next(iter(schemes.values()))
    if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel"):
        raise ValueError(f"compressed-tensors: weight type {w.get('type')!r} / strategy {w.get('strategy')!r} "
                         "is not supported (int, group or channel)")
    group_size = int(w["group_size"]) if w["strategy"] == "group" else -1
    return QuantSpec("compressed-tensors", fmt, int(w["num_bits"]), group_size, bool(w.get("symmetric", True)),
                     w.get("actorder") not in (None, False))

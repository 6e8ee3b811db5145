"""Reading a Hugging Face-style checkpoint folder: config.json, *.safetensors, optional quantization_config.

Dense tensors are read as stored; quantized linears (AWQ gemm, GPTQ v1/v2, compressed-tensors pack-quantized;
design.md §5) are repacked by ``kernels.quant_formats`` into its one internal layout.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import quant_formats
from kernels.quant_formats import QuantizedWeight


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
    not hold here (AWQ gemm: 4; the others: ``quant_formats.SUPPORTED_BITS``). Nothing for a dense config."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    try:
        if not isinstance(qc, dict):
            raise ValueError("not an object")
        spec = quant_formats.parse_quant_config(qc)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"quantization_config: {e}") from None
    allowed = (4,) if spec.method == "awq" else quant_formats.SUPPORTED_BITS
    if spec.bits not in allowed:
        raise CheckpointError(f"quantization_config: {spec.method} with {spec.bits}-bit weights is not supported "
                              f"(bits: {', '.join(map(str, allowed))})")


class SafetensorsIndex(Mapping):
    """Read-only ``{tensor name: tensor}`` view over every ``*.safetensors`` file of a folder, loaded lazily."""

    def __init__(self, folder: Path, device: str = "cpu"):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} has no *.safetensors file")
        self._handles = [safe_open(str(f), framework="pt", device=device) for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class CheckpointReader:
    """Tensors of one checkpoint folder, by Hugging Face parameter name.

    ``quant_config``: the config's ``quantization_config`` dict, or None for a dense checkpoint. Tensors are
    read straight onto ``device`` (so repacking 4-bit weights runs there too). Raises CheckpointError for a
    config.json that is missing or unreadable (:func:`read_config`), a quantization it cannot read
    (:func:`check_quantization`: before any tensor is read) or a folder without safetensors.
    """

    def __init__(self, model_dir: str | Path, device: str = "cpu"):
        self.folder = Path(model_dir)
        self.config = read_config(self.folder)
        check_quantization(self.config)
        self.quant_config: dict | None = self.config.get("quantization_config")
        self.tensors = SafetensorsIndex(self.folder, device)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name``; raises CheckpointError when absent."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing")
        return self.tensors[name]

    def linear(self, prefix: str) -> torch.Tensor | QuantizedWeight:
        """The weight of the linear layer at ``prefix``: dense [N, K], or a QuantizedWeight."""
        if quant_formats.is_quantized(self.tensors, prefix):
            if self.quant_config is None:
                raise CheckpointError(f"{prefix} is quantized but config.json has no quantization_config")
            return quant_formats.from_checkpoint(self.tensors, prefix, self.quant_config)
        return self.tensor(f"{prefix}.weight")

    def bias(self, prefix: str) -> torch.Tensor | None:
        name = f"{prefix}.bias"
        return self.tensors[name] if name in self.tensors else None

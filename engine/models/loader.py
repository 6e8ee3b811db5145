"""Reading a Hugging Face-style checkpoint folder: config.json, *.safetensors, optional quantization_config.

Dense tensors are read as stored; quantized linears (AWQ gemm, GPTQ v1/v2, compressed-tensors pack-quantized;
design.md §5) are repacked by ``kernels.quant_formats`` into its one internal layout.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.checkpoint_config import CheckpointError, check_quantization, read_config
from kernels import quant_formats
from kernels.quant_formats import QuantizedWeight


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

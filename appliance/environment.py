"""Checks of the Python environment the appliance runs in, made before anything slow starts.

The Hugging Face ``kernels`` package (a dependency of transformers 5.25 and later) is imported as ``kernels``, the
name of this product's Triton package (``kernels/``, fixed by the design card). With both installed, one of them
shadows the other: transformers then fails at its first model config (``ImportError: cannot import name
'CUDAProperties' from 'kernels'``) or the engine at its first kernel import. pyproject pins transformers below 5.25;
this finds an environment where the other package came in anyway (a later ``pip install``).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from appliance.errors import ApplianceError

#: the folder our ``kernels`` package must be imported from: beside ``appliance/``
OURS = Path(__file__).resolve().parent.parent / "kernels"


def kernels_clash() -> str | None:
    """What shadows our ``kernels`` package, or None: the Hugging Face ``kernels`` distribution installed, or a
    ``kernels`` module imported from elsewhere."""
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None:
        return f"the Hugging Face `kernels` package {version} is installed"
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if origin is not None and origin != OURS:
        return f"`import kernels` finds {origin}, not {OURS}"
    return None


def check_kernels_package() -> None:
    """Raise ApplianceError (with the fix) when :func:`kernels_clash` finds something."""
    clash = kernels_clash()
    if clash:
        raise ApplianceError(f"{clash}; it shares the import name of this product's kernels/ package",
                             "pip uninstall -y kernels && pip install 'transformers<5.25'")

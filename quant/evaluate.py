"""Held-out perplexity (design.md §6): the Gospel of Luke, first 32,768 tokens, stride-512 windows, fp32.

Evaluation is not the serving path, so it runs transformers' own model class; a quantized folder is loaded by
dequantizing every quantized linear with :mod:`kernels.quant_formats` into a plain fp32 model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kernels.quant_formats import dequantize, from_checkpoint, is_quantized

from .calibration import heldout_text


def load_state(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's ``*.safetensors`` files."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


def load_dequantized(model_dir, dtype: torch.dtype = torch.float32):
    """A transformers causal LM (``AutoModelForCausalLM.from_config``) holding the folder's weights in ``dtype``;
    quantized linears (any format of kernels.quant_formats) are dequantized exactly, then cast to ``dtype``.
    Raises ValueError when a checkpoint tensor is left over or a model weight is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    quant_config = raw.get("quantization_config")
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with _no_init():  # every weight is overwritten below; random init of 135M parameters costs seconds
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_state(model_dir)
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quant_config and is_quantized(tensors, name):
            state[f"{name}.weight"] = dequantize(from_checkpoint(tensors, name, quant_config))
            for key in [k for k in tensors if k.startswith(f"{name}.") and k != f"{name}.bias"]:
                tensors.pop(key)
    state.update(tensors)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{model_dir}: unexpected tensors {sorted(unexpected)[:5]}, "
                         f"missing weights {sorted(set(missing) - tied)[:5]}")
    model.tie_weights()
    return model.eval()


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


@torch.inference_mode()
def perplexity(model_dir, max_tokens: int = 32768, window: int = 512, batch_size: int = 8) -> float:
    """Perplexity of the model folder (quantized or not) on Luke: the first ``max_tokens`` tokens cut into
    non-overlapping ``window``-token windows (a shorter last window is dropped), each scored from its own start,
    in fp32.  exp(mean negative log-likelihood over every predicted token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(heldout_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][0][:max_tokens]
    n_windows = ids.numel() // window
    if n_windows == 0:
        raise ValueError(f"the held-out text has {ids.numel()} tokens, fewer than one window of {window}")
    windows = ids[: n_windows * window].view(n_windows, window)
    model = load_dequantized(model_dir, torch.float32)
    total_nll, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                reduction="sum")
        total_nll += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total_nll / count)

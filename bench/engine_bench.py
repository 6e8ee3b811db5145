"""Engine-level GPU benchmarks of issue 3 (called by ``bench/gpu_suite.py``; every figure a ratio to a baseline
timed in the same run).

* batch-1 decode of a Llama-2-7B-shaped random AWQ model, CUDA graphs on, against the bandwidth bound
  (bytes read per step / measured copy bandwidth), and against our own eager engine; and where its step goes (the
  step with some ops launching nothing, against the whole step);
* a prefill step (one 32-, 128-, 512- and 2,048-token prompt), run eagerly, against its kernels' GPU time: how much of
  TTFT is host time, with a cProfile of it in the log; and, up to 256 tokens, replayed from its prefill CUDA graph
  against the eager step (no target);
* 256 concurrent requests (128 prompt / 512 output tokens) against transformers bf16 ``generate`` at batch 128
  on same-shaped random weights;
* greedy agreement of CUDA graphs, eager Triton and the torch references on a small random model, and of the
  GPU path with the CPU reference on the SmolLM2 demo checkpoint when it was brought over (in parts).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import tempfile
import time
from unittest import mock
from pathlib import Path

import torch

from bench.random_model import write_random_awq_model
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.config import checkpoint_dtype, compute_dtype
from kernels import ops, w4a16
from kernels._triton import pdl, without_early_trigger, without_pdl


#: Engine options of every row but ``measured_plan_rows``: the built-in W4A16 plans (w4a16.TUNED, measured on an
#: H200 for these shapes, else choose_plan's rules), nothing measured at start-up, no plan file read.
_NO_PLANS = tempfile.TemporaryDirectory(prefix="no-plans-")  # empty; removed when the process exits
BUILT_IN = dict(tune_kernels=False, kernel_plans_dir=_NO_PLANS.name)


def _prefill_graphs(on: bool):
    """While it lasts, engines built capture prefill graphs or not (``APPLIANCE_PREFILL_GRAPHS``, read by
    ``engine.cuda_graphs.prefill_graphs_on``; on by default), whatever the caller's environment says."""
    return mock.patch.dict(os.environ, {"APPLIANCE_PREFILL_GRAPHS": "1" if on else "0"})


@contextlib.contextmanager
def _torch_references():
    """While it lasts, engines built run the torch reference ops instead of the Triton kernels
    (``APPLIANCE_KERNELS=torch``)."""
    os.environ["APPLIANCE_KERNELS"] = "torch"
    try:
        yield
    finally:
        del os.environ["APPLIANCE_KERNELS"]


def _free() -> None:
    """Return freed GPU memory to the device (callers ``del`` their references first)."""
    gc.collect()
    torch.cuda.empty_cache()


def _model_7b(ctx: dict) -> str:
    """The Llama-2-7B-shaped random AWQ checkpoint, written once per suite run (``ctx["model_7b"]``): 3.7 GB, which
    each row that needs it wrote again before (``dict.setdefault`` evaluates its default first)."""
    if "model_7b" not in ctx:
        ctx["model_7b"] = str(write_random_awq_model("/tmp/rand_7b"))
    return ctx["model_7b"]


def _weight_bytes(llm: LLM) -> int:
    """Bytes the model reads per decode step: every layer's packed or dense weights, plus one embedding row."""
    total = 0
    for layer in llm.engine.runner.model.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if lin.qweight is not None:
                total += sum(t.numel() * t.element_size() for t in (lin.qweight.qweight, lin.qweight.qzeros,
                                                                       lin.qweight.scales))
            else:
                total += lin.weight.numel() * lin.weight.element_size()
        total += 2 * layer.input_layernorm.weight.numel() * layer.input_layernorm.weight.element_size()
    head = llm.engine.runner.model.lm_head.weight
    return total + head.numel() * head.element_size()


def _batch_decode_tok_s(llm: LLM, batch: int, prompt_len: int, steps: int, warm_steps: int = 4, device: str = "cuda",
                        **params) -> float:
    """Output tokens per second of ``batch`` sequences decoding together, summed: ``steps`` engine steps timed
    after ``warm_steps`` (the prefills, then every sequence decoding); the requests are aborted afterwards.
    ``params``: more SamplingParams fields (greedy by default)."""
    engine = llm.engine
    ids = [f"bench{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, list(range(3 + i, 3 + i + prompt_len)),
                           SamplingParams(**{"temperature": 0, "max_tokens": steps + 8, "ignore_eos": True,
                                             **params}))
    for _ in range(warm_steps):
        engine.step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return batch * steps / elapsed


def _decode_tok_s(llm: LLM, prompt_len: int, steps: int, **params) -> float:
    """Tokens per second of one sequence decoding (timed after its prefill and one decode step)."""
    return _batch_decode_tok_s(llm, 1, prompt_len, steps, warm_steps=2, **params)


#: the penalties of the penalised rows: Qwen2.5-Instruct's generation_config.json sets repetition_penalty 1.05,
#: so every request to it is penalised; OpenAI SDK users often set frequency_penalty
PENALTIES = dict(repetition_penalty=1.05, frequency_penalty=0.3)


def _profile_steps(engine, steps: int) -> tuple[float, list[tuple[str, float, int]]]:
    """Run ``steps`` engine steps under the CUDA profiler: (wall µs per step, [(kernel, GPU µs per step, launches
    per step)] largest first)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e6
    rows = sorted(((e.key, e.device_time_total / steps, e.count // steps) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    return wall, rows


def _step_profile(llm: LLM, steps: int = 8, top: int = 12) -> list[tuple[str, float, int]]:
    """GPU time per decode step by kernel (eager engine, batch 1): [(kernel, µs per step, launches per step)],
    largest first; printed. The sum against the step time shows launch gaps."""
    engine = llm.engine
    engine.add_request("prof", list(range(3, 35)), SamplingParams(temperature=0, max_tokens=steps + 4,
                                                                   ignore_eos=True))
    engine.step()
    engine.step()
    _, rows = _profile_steps(engine, steps)
    engine.abort_request("prof")
    engine.step()
    total = sum(r[1] for r in rows)
    print(f"decode step kernels (eager, bs1): {total:.0f} us of GPU time per step")
    for name, us, count in rows[:top]:
        print(f"  {us:8.1f} us  x{count:<4d} {name[:90]}")
    return rows[:top]


def _decode_engine(model_dir: str, eager: bool = False, batch: int = 1, dtype: str = "auto") -> LLM:
    """The 7B-shaped model on the GPU for ``batch`` sequences, warmed up (graphs captured unless ``eager``)."""
    llm = LLM(model_dir, device="cuda", **BUILT_IN, max_num_seqs=batch, max_model_len=1024, enforce_eager=eager,
              gpu_memory_utilization=0.3, dtype=dtype)
    _batch_decode_tok_s(llm, batch, 32, 16, warm_steps=2 if batch == 1 else 4)
    return llm


def _bytes_per_step(llm: LLM, batch: int = 1, context: int = 160) -> float:
    """Bytes a decode step of ``batch`` sequences reads: the weights once, and each sequence's KV cache
    (``context`` tokens, about the mean of the timed steps)."""
    kv_per_token = llm.engine.runner._bytes_per_block() / llm.engine.config.block_size
    return _weight_bytes(llm) + kv_per_token * context * batch


#: The CUDA-core GEMV plans the tensor-core ("mma") GEMV replaced at M = 1 (TUNED before the fifth session)
CUDA_CORE_M1 = {(1, 12288, 4096): w4a16.Plan("gemv", 1, 128, 128, 896),
                (1, 22016, 4096): w4a16.Plan("gemv", 1, 128, 128, 1408),
                (1, 4096, 11008): w4a16.Plan("gemv", 1, 128, 128, 1408)}


@contextlib.contextmanager
def cuda_core_gemv():
    """While it lasts, M = 1 products of the Llama-7B shapes run the CUDA-core GEMV (``CUDA_CORE_M1``), not the
    tensor-core one (the baseline of the "tensor-core GEMV vs CUDA-core" row)."""
    before = {key: w4a16.TUNED[key] for key in CUDA_CORE_M1}
    w4a16.TUNED.update(CUDA_CORE_M1)
    w4a16.choose_plan.cache_clear()
    try:
        yield
    finally:
        w4a16.TUNED.update(before)
        w4a16.choose_plan.cache_clear()


def _bs1_tok_s_under(model_dir: str, context, dtype: str = "auto") -> float:
    """Batch-1 tok/s of a graphs-on engine in ``dtype`` built, captured and timed inside ``context``; the engine is
    freed."""
    with context:
        llm = _decode_engine(model_dir, dtype=dtype)
        tok_s = _decode_tok_s(llm, 32, 256)
    del llm
    _free()
    return tok_s


def decode_rows(ctx: dict, make_row) -> list:
    """Batch-1 decode of the 7B-shaped model: graphs on vs the bandwidth bound, graphs on vs eager, async
    scheduling (the default) vs reading every step back before scheduling the next, and programmatic dependent
    launch (the default on Hopper) vs not (``APPLIANCE_PDL=0`` while the engine is built and captured), its early
    trigger vs not (``APPLIANCE_PDL_TRIGGER=0``), and the tensor-core GEMV vs the CUDA-core one
    (:func:`cuda_core_gemv` while the engine is built and captured); the dtype "auto" picks (the float16 the
    random checkpoint names, as an AWQ checkpoint's config.json does) vs bfloat16 (no target); and a decode step of
    8 sequences (the M = 8 products) against its bandwidth bound (no target)."""
    model_dir = _model_7b(ctx)
    tok_s, notes = {}, {}
    for eager in (False, True):
        torch.cuda.reset_peak_memory_stats()
        llm = _decode_engine(model_dir, eager)
        tok_s[eager] = _decode_tok_s(llm, 32, 256)
        if not eager:
            tok_s["penalised"] = _decode_tok_s(llm, 32, 256, **PENALTIES)
            tok_s["logprobs"] = _decode_tok_s(llm, 32, 256, logprobs=1)
            llm.engine.async_scheduling = False
            tok_s["sync"] = _decode_tok_s(llm, 32, 256)
            tok_s["penalised_sync"] = _decode_tok_s(llm, 32, 256, **PENALTIES)
            tok_s["logprobs_sync"] = _decode_tok_s(llm, 32, 256, logprobs=1)
        if eager:
            ctx["log"]["decode_profile"] = _step_profile(llm)
        bytes_per_step = _bytes_per_step(llm)
        notes[eager] = (f"{tok_s[eager]:.0f} tok/s; {bytes_per_step / 1e9:.2f} GB/step; "
                        f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        del llm
        _free()
    with_pdl = pdl(torch.empty(0, device="cuda"))
    if with_pdl:  # Hopper: the same graphs, captured with every kernel launched without PDL; with PDL but each
        # kernel's next one launched as its programs exit
        tok_s["nopdl"] = _bs1_tok_s_under(model_dir, without_pdl())
        tok_s["late"] = _bs1_tok_s_under(model_dir, without_early_trigger())
    tok_s["cuda_core"] = _bs1_tok_s_under(model_dir, cuda_core_gemv())
    auto = auto_dtype(model_dir)  # float16 or bfloat16: the other one's tok/s for the dtype row
    tok_s["other"] = _bs1_tok_s_under(model_dir, contextlib.nullcontext(), OTHER_16_BIT[auto])
    llm = _decode_engine(model_dir, batch=8)
    tok_s["batch8"] = _batch_decode_tok_s(llm, 8, 32, 256)
    bytes8 = _bytes_per_step(llm, batch=8)
    del llm
    _free()
    bound_us = bytes_per_step / ctx["copy_bw"] * 1e6
    rows = [
        make_row("7B AWQ decode bs1, CUDA graphs, vs bandwidth bound", "Llama-2-7B shape, ctx ~160",
                 1e6 / tok_s[False], "bytes/step ÷ copy BW", bound_us, 0.70, notes[False]),
        make_row("7B AWQ decode bs1, CUDA graphs vs eager", "same", 1e6 / tok_s[False], "our eager engine",
                 1e6 / tok_s[True], 2.0, notes[True] + " (eager)"),
        make_row("7B AWQ decode bs1, async scheduling vs not", "same, graphs on", 1e6 / tok_s[False],
                 "each step read back before the next", 1e6 / tok_s["sync"], 1.0,
                 f"{tok_s['sync']:.0f} tok/s without"),
        make_row("7B AWQ decode bs1, penalised vs not", "same, graphs on, repetition 1.05 + frequency 0.3",
                 1e6 / tok_s["penalised"], "the same step unpenalised", 1e6 / tok_s[False], None,
                 f"{tok_s['penalised']:.0f} tok/s penalised; {tok_s['penalised_sync']:.0f} with each step read "
                 f"back (the engine before penalties counted pending tokens on the device)"),
        make_row("7B AWQ decode bs1, logprobs=1 vs not", "same, graphs on", 1e6 / tok_s["logprobs"],
                 "the same step without logprobs", 1e6 / tok_s[False], None,
                 f"{tok_s['logprobs']:.0f} tok/s with logprobs; {tok_s['logprobs_sync']:.0f} with each step read "
                 f"back (the engine before logprobs were read back a step later)"),
    ]
    if with_pdl:  # Hopper: each kernel may start as the previous one ends
        rows.append(make_row("7B AWQ decode bs1, PDL vs not", "same, graphs on", 1e6 / tok_s[False],
                             "kernels launched without PDL", 1e6 / tok_s["nopdl"], 1.0,
                             f"{tok_s['nopdl']:.0f} tok/s without"))
        rows.append(make_row("7B AWQ decode bs1, PDL early trigger vs not", "same, graphs on", 1e6 / tok_s[False],
                             "PDL, next kernel launched as programs exit", 1e6 / tok_s["late"], 1.0,
                             f"{tok_s['late']:.0f} tok/s without"))
    rows.append(make_row("7B AWQ decode bs1, tensor-core GEMV vs CUDA-core", "same, graphs on", 1e6 / tok_s[False],
                         "M=1 q/k/v, gate/up, down on the CUDA-core GEMV", 1e6 / tok_s["cuda_core"], 1.0,
                         f"{tok_s['cuda_core']:.0f} tok/s with the CUDA-core GEMV"))
    rows.append(make_row(f"7B AWQ decode bs1, {auto} (auto) vs {OTHER_16_BIT[auto]}", "same, graphs on",
                         1e6 / tok_s[False], f"the same engine in {OTHER_16_BIT[auto]}", 1e6 / tok_s["other"], None,
                         f"{tok_s['other']:.0f} tok/s in {OTHER_16_BIT[auto]}"))
    step8 = 8e6 / tok_s["batch8"]  # µs per step of 8 sequences
    rows.append(make_row("7B AWQ decode, 8 sequences, CUDA graphs, vs bandwidth bound", "same, ctx ~160 each",
                         step8, "bytes/step ÷ copy BW", bytes8 / ctx["copy_bw"] * 1e6, None,
                         f"{tok_s['batch8']:.0f} tok/s in all ({tok_s['batch8'] / tok_s[False]:.2f}x bs1); "
                         f"{bytes8 / 1e9:.2f} GB/step"))
    return rows


OTHER_16_BIT = {"float16": "bfloat16", "bfloat16": "float16"}


def auto_dtype(model_dir: str) -> str:
    """The dtype "auto" computes the checkpoint in ``model_dir`` in on CUDA (the float16 an AWQ config.json names)."""
    return compute_dtype("auto", "cuda", checkpoint_dtype(json.loads((Path(model_dir) / "config.json").read_text())))


@contextlib.contextmanager
def _patched(module, values: dict):
    """While it lasts, ``module``'s attributes named in ``values`` are those values; all restored after, also on an
    error."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def _skipped(names: tuple[str, ...]):
    """While it lasts, the ``kernels.ops`` ops in ``names`` launch nothing (wrong results, for timing only):
    ``rms_norm`` returns its input twice, ``rotary_write_kv`` an uninitialised q (and writes no KV),
    ``paged_attention_decode`` its q (no decode or merge kernel). KeyError for another name, before any patch."""
    fakes = {"rms_norm": lambda x, w, eps, residual=None: (x, x),
             "rotary_write_kv": lambda positions, q, *a, **kw: torch.empty(q.shape, dtype=q.dtype, device=q.device),
             "paged_attention_decode": lambda q, *a, **kw: q}
    return _patched(ops, {name: fakes[name] for name in names})


#: The ablations of :func:`decode_ablation_rows`: (label, the ops skipped)
ABLATIONS = (("RMSNorm (65 launches)", ("rms_norm",)), ("rotary + KV write (32)", ("rotary_write_kv",)),
             ("decode attention + split merge (64)", ("paged_attention_decode",)),
             ("all three: W4A16 products, LM head and sampling left", ("rms_norm", "rotary_write_kv",
                                                                       "paged_attention_decode")))


def decode_ablation_rows(ctx: dict, make_row) -> list:
    """Where a batch-1 decode step of the 7B-shaped model goes, CUDA graphs on: the step timed with some ops
    launching nothing (:data:`ABLATIONS`; their outputs are wrong, the W4A16 products' bytes and launches the
    same) against the whole step, in the same run; both in µs per step (1e6 / tok/s). The difference is what those
    launches cost in the graph, their waits on the kernel before them included: the most that fusing them away could
    save (no target). The whole step is timed once, each ablation in an engine of its own: builds of one engine
    vary by a few percent."""
    model_dir = _model_7b(ctx)
    full = _bs1_tok_s_under(model_dir, contextlib.nullcontext())
    rows = []
    for label, names in ABLATIONS:
        tok_s = _bs1_tok_s_under(model_dir, _skipped(names))
        rows.append(make_row(f"7B AWQ decode bs1 without {label}", "Llama-2-7B shape, ctx ~160, graphs on",
                             1e6 / tok_s, "the whole step", 1e6 / full, None,
                             f"{tok_s:.0f} against {full:.0f} tok/s: skipping them saves "
                             f"{1e6 / full - 1e6 / tok_s:+.0f} µs a step"))
    return rows


def _hf_generate_tok_s(model_dir: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float, float]:
    """transformers bf16 ``generate`` (greedy, ``new_tokens`` each) at ``batch``: (best of two timed runs, the
    first timed run, peak GiB), output tok/s. The first full-length run measured 2.8x slower than the second on an
    H200 (1,468 against 4,149 tok/s at batch 128, 128 + 512 tokens, bench/RESULTS.md run 47): the short warm-up does
    not grow the caching allocator's pools to the full KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.pop("quantization_config")
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    ids = torch.randint(3, cfg["vocab_size"], (batch, prompt_len), device="cuda")
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    seconds = []
    for _ in range(2):  # best of two, as our engine's rows (the first run pays the allocator's growth)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    _free()
    return batch * new_tokens / min(seconds), batch * new_tokens / seconds[0], peak


def _host_profile(llm: LLM, prompts: list, tokens: int = 64, top: int = 25) -> str:
    """Where the host's time goes while the engine runs the full batch: cProfile of one shorter ``generate``
    (profiling slows Python, so the figure is not reported), top functions by own time; printed."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    return out.getvalue()


def _batch_step_profile(llm: LLM, prompts: list, at_steps=(24, 470), steps: int = 4, top: int = 10) -> dict:
    """GPU time by kernel and wall time of a decode step of the whole batch, early and late in the 512 tokens
    (the context grows from 128 to 640): {step: (wall µs, GPU µs, [(kernel, µs, launches)])}, printed. Shows what
    of a step is device work and what is host time the overlap does not hide."""
    engine, out, done = llm.engine, {}, 0
    params = SamplingParams(temperature=0, max_tokens=max(at_steps) + steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof{i}", p, params)
    for at in at_steps:
        while done < at:
            engine.step()
            done += 1
        wall, rows = _profile_steps(engine, steps)
        done += steps
        gpu = sum(r[1] for r in rows)
        print(f"batch step {at}: wall {wall:.0f} us (profiled), GPU {gpu:.0f} us")
        for name, us, count in rows[:top]:
            print(f"  {us:8.1f} us  x{count:<4d} {name[:90]}")
        out[at] = (wall, gpu, rows[:top])
    for i in range(len(prompts)):
        engine.abort_request(f"prof{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_step(step, device: str) -> float:
    """Wall µs of one call of ``step`` (an engine step), synchronized before and after."""
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return (time.perf_counter() - start) * 1e6


def _prompt(prompt_len: int) -> list[int]:
    """The benchmark's ``prompt_len``-token prompt (ids spread over the vocabulary, the same for a length)."""
    return [3 + (i * 7919 + prompt_len) % 31000 for i in range(prompt_len)]


def _prefill_step(llm: LLM, prompt_len: int, tag: str, device: str = "cuda") -> float:
    """Wall µs of the engine step that prefills one new ``prompt_len``-token prompt (max_tokens 1; synchronized
    before and after), the request then run to its end."""
    engine = llm.engine
    engine.add_request(tag, _prompt(prompt_len), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    wall = _timed_step(engine.step, device)
    while engine.has_unfinished_requests():
        engine.step()
    return wall


def prefill_host_rows(ctx: dict, make_row, lengths=(32, 128, 512, 2048), reps: int = 3, top: int = 20,
                      device: str = "cuda") -> list:
    """Where a prefill step's time goes (TTFT), 7B-shaped random AWQ model, for a ``lengths`` prompt each (prefix
    caching off: every prompt computed in full). Per length: the eager step's wall time against the GPU time of its
    kernels (torch.profiler, summed; the ratio is the share of the step the GPU is busy, the rest host time that
    nothing overlaps), and, where a prefill graph holds the prompt (``cuda_graphs.PREFILL_TOKEN_BUCKETS``), the
    step replayed from its graph against the eager one. A cProfile of the eager steps, top ``top`` by own time,
    goes to the log (``prefill_host_profile``). No target (issue 3 sets none). ``device="cpu"``: a smoke run of
    this code (no GPU time: the ratio reads 0; no graphs)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    with _prefill_graphs(True):
        llm = LLM(_model_7b(ctx), device=device, **BUILT_IN, max_num_seqs=4, max_model_len=4096,
                  enable_prefix_caching=False, gpu_memory_utilization=0.3)
    graphs = llm.engine.runner.graphs
    buckets = graphs.prefill_buckets if graphs is not None else ()
    rows, text = [], io.StringIO()
    for n in lengths:
        if graphs is not None:
            graphs.prefill_buckets = ()  # eager prefill steps
        _prefill_step(llm, n, f"warm{n}", device)  # compiles and tunes nothing inside the timed steps
        wall = min(_prefill_step(llm, n, f"p{n}-{i}", device) for i in range(reps))
        with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
            _prefill_step(llm, n, f"gpu{n}", device)
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        gpu = sum(e.device_time_total for e in kernels)
        launches = sum(e.count for e in kernels)
        prof_c = cProfile.Profile()
        prof_c.enable()
        _prefill_step(llm, n, f"host{n}", device)
        prof_c.disable()
        text.write(f"--- prefill of {n} tokens\n")
        pstats.Stats(prof_c, stream=text).sort_stats("tottime").print_stats(top)
        rows.append(make_row("7B AWQ prefill step: GPU busy vs wall", f"one {n}-token prompt, eager step", wall,
                             "the step's kernels' GPU time", gpu, None,
                             f"{launches} kernel launches; {(wall - gpu) / max(launches, 1):.1f} µs of host time "
                             f"per launch beyond the GPU's"))
        if graphs is not None and n <= max(buckets, default=0):
            graphs.prefill_buckets = buckets
            _prefill_step(llm, n, f"gwarm{n}", device)
            replayed = min(_prefill_step(llm, n, f"g{n}-{i}", device) for i in range(reps))
            rows.append(make_row("7B AWQ prefill step: graph vs eager", f"one {n}-token prompt", replayed,
                                 "the same step eager", wall, None,
                                 f"{wall / 1e3:.1f} -> {replayed / 1e3:.1f} ms; kernels {gpu / 1e3:.1f} ms eager; "
                                 f"{len(graphs.graphs)} graphs captured in {graphs.capture_s:.1f} s, "
                                 f"{graphs.pool_bytes / 2**20:.0f} MiB"))
    if graphs is not None:
        graphs.prefill_buckets = buckets
    ctx["log"]["prefill_host_profile"] = text.getvalue()
    print(text.getvalue())
    del llm
    _free()
    return rows


def _mixed_step(llm: LLM, running: int, prompt_len: int, tag: str, device: str = "cuda") -> tuple[float, tuple, list]:
    """Wall µs of the engine step that decodes ``running`` sequences (16-token prompts, already past their
    prefill) and prefills one new ``prompt_len``-token prompt with them (synchronized before and after), the
    (sequences, tokens) of each batch launched in that step (to check that it was that step), and every
    request's greedy tokens, in the order the requests were added; every request run to its end."""
    engine, launched, tokens = llm.engine, [], {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)

    quick = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    order = [f"{tag}-r{i}" for i in range(running)] + [tag]
    for i, rid in enumerate(order[:-1]):
        engine.add_request(rid, [3 + (i * 31 + j) % 31000 for j in range(16)], quick)
    for _ in range(2):  # the running sequences' prefill, then a decode step: all of them decoding
        step()
    engine.add_request(tag, _prompt(prompt_len), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    launch = engine.runner.launch

    def recording(batch, *args):
        launched.append((len(batch.seqs), batch.num_batched_tokens))
        return launch(batch, *args)

    with mock.patch.object(engine.runner, "launch", recording):
        wall = _timed_step(step, device)
    while engine.has_unfinished_requests():
        step()
    return wall, tuple(launched[:1]), [tokens[rid] for rid in order]


#: mixed_step_rows' engines: ``engine.cuda_graphs`` settings each is built with ({}: the defaults). Runs 97-98
#: compared sequence classes (16,), (64,) and the default (16, 64); run 99 token buckets every 16-32 tokens
#: against the default's (the W4A16 M buckets: no faster).
MIXED_STEP_CONFIGS = (dict(PREFILL_SEQ_CLASSES=(16,)), {})


def mixed_step_rows(ctx: dict, make_row, configs=MIXED_STEP_CONFIGS, running=(0, 15, 47),
                    prompt_len: int = 128, reps: int = 3, device: str = "cuda", model_dir: str | None = None) -> list:
    """Which prefill graphs to capture (``cuda_graphs.PREFILL_SEQ_CLASSES``, ``PREFILL_TOKEN_BUCKETS``): 7B-shaped
    random AWQ model, ``max_num_seqs`` 64, one engine per entry of ``configs`` (the settings it is built with);
    per engine, the step that prefills one ``prompt_len``-token prompt beside ``running`` decoding sequences, from
    a graph where one holds the step (the smallest class that holds its sequences, padded to the smallest token
    bucket that holds its tokens) and eagerly (prefill graphs set aside). A graph's absent sequences cost the
    prefill attention one query tile per head each, which find no tokens and return; a step with more sequences
    than the largest class runs eagerly. No target."""
    from engine import cuda_graphs

    rows = []
    for c, config in enumerate(configs):
        with _patched(cuda_graphs, config), _prefill_graphs(True):
            llm = LLM(model_dir or _model_7b(ctx), device=device, **BUILT_IN, max_num_seqs=64, max_model_len=1024,
                      enable_prefix_caching=False, gpu_memory_utilization=0.3)
        graphs = llm.engine.runner.graphs
        what = ", ".join(f"{k} {v}" for k, v in config.items()) or "defaults"
        buckets = graphs.prefill_buckets if graphs is not None else ()
        for r in running:
            tag = f"c{c}r{r}"
            try:
                if graphs is not None:
                    graphs.prefill_buckets = ()
                _mixed_step(llm, r, prompt_len, f"{tag}w", device)
                eager = [_mixed_step(llm, r, prompt_len, f"{tag}e{i}", device) for i in range(reps)]
            finally:
                if graphs is not None:
                    graphs.prefill_buckets = buckets
            key = graphs.prefill_bucket_for(prompt_len + r, r + 1) if graphs is not None else None
            _mixed_step(llm, r, prompt_len, f"{tag}gw", device)
            replayed = [_mixed_step(llm, r, prompt_len, f"{tag}g{i}", device) for i in range(reps)]
            how = "no graphs" if graphs is None else f"graph {key}" if key else "eager: too many sequences"
            wall_e, wall_g = min(w for w, _, _ in eager), min(w for w, _, _ in replayed)
            rows.append(make_row(f"7B AWQ step, {prompt_len}-token prompt + {r} decodes: graphs ({what}) vs eager",
                                 f"max_num_seqs 64, {how}",
                                 wall_g, "the same step, prefill graphs set aside", wall_e, None,
                                 f"{wall_e / 1e3:.1f} -> {wall_g / 1e3:.1f} ms" + (
                                     f"; {len(graphs.graphs)} graphs in {graphs.capture_s:.1f} s, "
                                     f"{graphs.pool_bytes / 2**20:.0f} MiB" if graphs else "")))
            # every timed step was the one meant (the prompt beside r decodes), and every request of the other
            # runs got the first eager run's greedy tokens
            want, others = eager[0][2], eager[1:] + replayed
            same = sum(a == b for run in others for a, b in zip(run[2], want))
            meant = sum(run[1] == ((r + 1, prompt_len + r),) for run in eager + replayed)
            rows.append(make_row("  same greedy tokens as the first eager run (counts, not µs)",
                                 f"{r + 1} requests x {len(others)} runs ({reps} replayed)", len(others) * (r + 1),
                                 "requests identical", same, 1.0,
                                 f"{meant} of {2 * reps} timed steps launched {r + 1} sequences, "
                                 f"{prompt_len + r} tokens"))
        del llm, graphs
        _free()
    return rows


def throughput_rows(ctx: dict, make_row, requests: int = 256, prompt_len: int = 128, output_len: int = 512) -> list:
    """256 concurrent requests through ``LLM.generate`` vs transformers bf16 ``generate`` at batch 128, the same
    prompt and output lengths."""
    model_dir = _model_7b(ctx)
    hf, hf_first, hf_peak = _hf_generate_tok_s(model_dir, 128, prompt_len, output_len)
    torch.cuda.reset_peak_memory_stats()
    # 256 x (128 + 512) tokens of a 7B model's KV need ~84 GB: the pool must hold them all, or preemption (and
    # recompute) is what gets measured
    llm = LLM(model_dir, device="cuda", **BUILT_IN, max_num_seqs=256, max_model_len=1024, gpu_memory_utilization=0.9)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompts = [torch.randint(3, 32000, (prompt_len,), generator=gen, device="cpu").tolist() for _ in range(requests)]
    # warm-up: every prefill and mixed-step shape of the run compiles its kernels here, not inside a timed run
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def tok_s(**params) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True, **params))
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)

    best = {True: 0.0, False: 0.0}
    for async_scheduling in (True, False, True, False):  # interleaved, best of two each: order effects cancel
        llm.engine.async_scheduling = async_scheduling
        best[async_scheduling] = max(best[async_scheduling], tok_s(temperature=0))
    ours, sync = best[True], best[False]
    peak = torch.cuda.max_memory_allocated() / 2**30
    preempted = llm.engine.scheduler.num_preemptions
    llm.engine.async_scheduling = True
    sampled = tok_s(temperature=0.8, top_p=0.95)
    penalised = tok_s(temperature=0, **PENALTIES)
    llm.engine.async_scheduling = False
    penalised_sync = tok_s(temperature=0, **PENALTIES)
    llm.engine.async_scheduling = True
    ctx["log"]["throughput_step_profile"] = _batch_step_profile(llm, prompts)
    ctx["log"]["throughput_host_profile"] = _host_profile(llm, prompts)
    del llm
    _free()
    # the same with an fp8 KV cache (half the bytes that attention reads per step, twice the blocks), then int8
    # (codes and a 4-byte scale per token and head: 132 bytes per head against bf16's 256)
    quantized = {}
    for kv_dtype in ("fp8", "int8"):
        llm = LLM(model_dir, device="cuda", **BUILT_IN, max_num_seqs=256, max_model_len=1024,
                  gpu_memory_utilization=0.9, kv_cache_dtype=kv_dtype)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        # best of two, as above: a first run of a new engine may still meet what its warm-up did not (it compiled
        # prefill variants, 3 s with a cold Triton cache, before the prefill kernel stopped specializing on the
        # batch; bench/RESULTS.md, seventh session)
        quantized[kv_dtype] = (max(tok_s(temperature=0), tok_s(temperature=0)), llm.engine.runner.num_blocks)
        del llm
        _free()
    (fp8, fp8_blocks), (int8, int8_blocks) = quantized["fp8"], quantized["int8"]
    shape = f"{prompt_len} prompt / {output_len} output"
    baseline = "HF bf16 generate bs128, best of 2"
    return [make_row(f"{requests} concurrent requests, output tok/s", shape, 1e6 / ours, baseline, 1e6 / hf, 15.0,
                     f"{ours:.0f} vs {hf:.0f} tok/s (HF's first run {hf_first:.0f}); {preempted} preemptions; "
                     f"peak {peak:.1f} GiB (HF {hf_peak:.1f})"),
            make_row(f"{requests} requests sampled (T 0.8, top-p 0.95), output tok/s", shape, 1e6 / sampled,
                     baseline + ", greedy", 1e6 / hf, 15.0, f"{sampled:.0f} vs {hf:.0f} tok/s"),
            make_row(f"{requests} requests, fp8 KV cache, output tok/s", shape, 1e6 / fp8, baseline, 1e6 / hf, 15.0,
                     f"{fp8:.0f} vs {hf:.0f} tok/s; {fp8_blocks} KV blocks"),
            make_row(f"{requests} requests, int8 KV cache, output tok/s", shape, 1e6 / int8, baseline, 1e6 / hf, 15.0,
                     f"{int8:.0f} vs {hf:.0f} tok/s; {int8_blocks} KV blocks"),
            make_row(f"{requests} requests, async scheduling vs not", shape + ", greedy", 1e6 / ours,
                     "each step read back before the next", 1e6 / sync, 1.0, f"{sync:.0f} tok/s without"),
            make_row(f"{requests} requests penalised vs not", shape + ", greedy, repetition 1.05 + frequency 0.3",
                     1e6 / penalised, "the same requests unpenalised", 1e6 / ours, None,
                     f"{penalised:.0f} tok/s penalised; {penalised_sync:.0f} with each step read back")]


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers (8 significant bits) at magnitude |x|: 2 ** (floor(log2 |x|) - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def divergence_report(got: list[list[int]], logprobs: list[list[dict]], refs: list[list[int]],
                      ref_top: list[list[list[float]]] | None) -> tuple[int, list[str]]:
    """(prompts whose greedy tokens equal ``refs`` or first differ at a near-tie, a note per divergence). A near-tie
    (issue 3: "a divergence only where the two top logits are within bf16 rounding"): the reference's two largest
    logits at that step (``ref_top[i][step]``, fp32, raw or, for structured outputs, after the grammar's mask, the
    second -inf where one token was allowed; same context: the tokens agree up to there) are at most one bf16
    spacing (the coarser of the two's) apart, so rounding the logits to bf16 could tie or swap them.
    ``logprobs``: each prompt's entries (the two largest at each step) for the gap this path saw. Without
    ``ref_top`` no divergence counts."""
    allowed, notes = 0, []
    for i, (tokens, entries, ref) in enumerate(zip(got, logprobs, refs)):
        if tokens == ref:
            allowed += 1
            continue
        step = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
        if step is None:  # one is the other's start: it stopped (at most max_tokens) where the other went on
            notes.append(f"prompt {i} ends after {len(tokens)} tokens, the reference after {len(ref)}")
            continue
        top = sorted(entries[step].values(), reverse=True)[:2]
        note = f"prompt {i} diverges at token {step} (top-2 gap {top[0] - top[1]:.3f} nats here"
        if ref_top is not None:
            l1, l2 = ref_top[i][step]
            # the coarser of the two (-0.99 against -1.0: -1.0's); one allowed token (l2 -inf) is no tie
            spacing = max(bf16_ulp(l1), bf16_ulp(l2)) if math.isfinite(l2) else math.inf
            near = math.isfinite(l2) and l1 - l2 <= spacing
            allowed += near
            note += (f"; the reference's top-2 logits {l1:.3f} / {l2:.3f}, {l1 - l2:.3f} apart, "
                     f"{'within' if near else 'over'} one bf16 spacing ({spacing:.3f})")
        notes.append(note + ")")
    return allowed, notes


def smollm2_rows(ctx: dict, make_row, model_dir: str = "/tmp/smol/awq") -> list:
    """Greedy GPU tokens vs the CPU reference's (fp32) on the SmolLM2 AWQ checkpoint, when it was brought over
    (``expected.json`` beside it: {"prompts": [...], "tokens": [[...]], "top_logits": [[[l1, l2] per step]]};
    ``bench/smollm2_parts.py`` makes both, in two parts for two device calls), in the engine's default dtype for it
    (``dtype="auto"``: the float16 its config.json names, as vLLM), and vs the torch references run on the GPU in
    that dtype (``APPLIANCE_KERNELS=torch``, eager); then again with the other 16-bit dtype's activations
    (bfloat16), and the CPU reference in bf16 against itself in fp32 (:func:`control_row`, when ``expected.json``
    has it). The rows' numbers are counts: sequences identical, and sequences identical or diverging first at a
    near-tie of the CPU reference (:func:`divergence_report`).
    """
    expected_path = Path(model_dir).parent / "expected.json"
    if not expected_path.is_file():
        return []
    expected = json.loads(expected_path.read_text())
    auto = auto_dtype(model_dir)
    other = OTHER_16_BIT[auto]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = _smollm2_outputs(model_dir, expected["prompts"], params)
    with _torch_references():
        ref_outs = _smollm2_outputs(model_dir, expected["prompts"], params, enforce_eager=True)
    got = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    rows = []
    for what, refs in (("CPU reference (fp32)", expected["tokens"]),
                       (f"torch reference on the GPU ({auto})", [o.outputs[0].token_ids for o in ref_outs])):
        same = sum(a == b for a, b in zip(got, refs))
        _, notes = divergence_report(got, logprobs, refs, None)
        total = len(refs)
        rows.append(make_row(f"SmolLM2 AWQ greedy, {auto} (auto): GPU = {what} (counts, not µs)",
                             f"{total} prompts x 32 tokens", total, "sequences identical", same, 1.0,
                             "; ".join(notes) or "no divergence"))
    if "top_logits" in expected:
        rows.append(_near_tie_row(make_row, f"SmolLM2 AWQ greedy, {auto} (auto): GPU = CPU reference but at bf16 "
                                  "near-ties (counts, not µs)", "the reference's", 1.0, expected, got, logprobs))
        # the other 16-bit dtype: bfloat16 rounds 8x coarser than float16 (7 against 10 mantissa bits)
        again = _smollm2_outputs(model_dir, expected["prompts"], params, dtype=other)
        rows.append(_near_tie_row(make_row, f"SmolLM2 AWQ greedy, {other} activations: GPU = CPU reference but at "
                                  "bf16 near-ties (counts, not µs)", "the reference's", 1.0, expected,
                                  [o.outputs[0].token_ids for o in again], [o.outputs[0].logprobs for o in again]))
    return rows + control_row(expected, make_row) + _structured_rows(model_dir, expected.get("structured"), make_row)


def control_row(expected: dict, make_row) -> list:
    """The yardstick of the near-tie rule, from ``expected.json`` alone (``bench/smollm2_parts.py`` runs it on the
    CPU): the torch reference in bf16 against itself in fp32, counted as :func:`divergence_report` counts the GPU
    (no target: it shows how far bf16 arithmetic alone moves the greedy tokens). [] without it."""
    control = expected.get("bf16_cpu")
    if control is None or "top_logits" not in expected:
        return []
    entries = [[dict(enumerate(step)) for step in steps] for steps in control["top_logprobs"]]
    return [_near_tie_row(make_row, "SmolLM2 AWQ greedy, control: CPU reference in bf16 = itself in fp32 but at bf16 "
                          "near-ties (counts, not µs)", "the fp32", None, expected, control["tokens"], entries)]


def _near_tie_row(make_row, measure: str, whose: str, goal: float | None, expected: dict, got: list[list[int]],
                  logprobs: list[list[dict]]):
    """One row counting the runs ``got`` (their per-step logprob entries ``logprobs``) that equal the CPU fp32
    reference's tokens or first differ at a near-tie of its logits (:func:`divergence_report`), the identical ones
    first in the note; ``whose`` names the logits in the baseline's text."""
    allowed, notes = divergence_report(got, logprobs, expected["tokens"], expected["top_logits"])
    same = sum(a == b for a, b in zip(got, expected["tokens"]))
    return make_row(measure, f"{len(got)} prompts x 32 tokens", len(got),
                    f"identical, or first diverging where {whose} top-2 logits are within one bf16 spacing", allowed,
                    goal, f"{same} of {len(got)} identical; " + ("; ".join(notes) or "no divergence"))


def follows_schema(text: str, schema: dict) -> bool:
    """Whether ``text`` is a JSON object with the flat ``schema``'s required keys, no others when it says so, and
    each value of its property's ``type`` (one name, or none), within its ``enum`` and ``maxLength``: the subset of
    JSON Schema the structured rows use."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = schema.get("properties", {})
    if not isinstance(value, dict) or not set(schema.get("required", ())) <= value.keys():
        return False
    if schema.get("additionalProperties") is False and not value.keys() <= props.keys():
        return False
    types = {"string": str, "boolean": bool, "integer": (int, float), "number": (int, float), "array": list,
             "object": dict, "null": type(None)}
    for key, v in value.items():
        spec = props.get(key, {})
        kind = spec.get("type")
        if not isinstance(v, types.get(kind, object)):
            return False
        if kind in ("integer", "number") and isinstance(v, bool):  # JSON's true is not a number
            return False
        if kind == "integer" and not float(v).is_integer():  # 2.0 is an integer in JSON Schema
            return False
        if v not in spec.get("enum", [v]) or len(v if isinstance(v, str) else "") > spec.get("maxLength", 1 << 30):
            return False
    return True


def _structured_rows(model_dir: str, expected: dict | None, make_row) -> list:
    """Structured outputs on the GPU (xgrammar's mask applied to the logits on the device): the SmolLM2 greedy
    answers under the JSON schema ``expected["schema"]`` that follow it, those equal to the CPU engine's
    (``expected["tokens"]``), and those equal or first diverging at a near-tie of the CPU engine's masked logits
    (``expected["top_logits"]``, when recorded: :func:`divergence_report`; the logprobs here are of the masked
    logits too). No rows when the check was not brought over or xgrammar is not installed (the device image has
    none: carry its wheels; the run's log says so)."""
    if not expected:
        return []
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("structured-output rows skipped: xgrammar is not installed here", flush=True)
        return []
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=expected["schema"]))
    outs = [o.outputs[0] for o in _smollm2_outputs(model_dir, expected["prompts"], params)]
    valid = sum(follows_schema(o.text, expected["schema"]) for o in outs)
    same = sum(o.token_ids == ref for o, ref in zip(outs, expected["tokens"]))
    total = len(outs)
    shape = f"{total} chat questions, greedy, json_schema, <= 64 tokens"
    def cell(texts: list) -> str:  # one table cell: newlines shown as \n, no column bars
        return " / ".join(t.replace("\n", "\\n").replace("|", "¦") for t in texts)
    rows = [make_row("SmolLM2 structured outputs on CUDA: answers that follow the schema (counts, not µs)", shape,
                     total, "answers", valid, 1.0, cell([o.text for o in outs])),
            make_row("SmolLM2 structured outputs: GPU = CPU reference (counts, not µs)", shape, total,
                     "answers identical", same, 1.0,
                     "CPU: " + cell(expected["texts"]))]
    if "top_logits" in expected:
        allowed, notes = divergence_report([o.token_ids for o in outs], [o.logprobs for o in outs],
                                           expected["tokens"], expected["top_logits"])
        rows.append(make_row("SmolLM2 structured outputs: GPU = CPU reference but at bf16 near-ties (counts, not µs)",
                             shape, total, "identical, or first diverging where the reference's top-2 allowed logits "
                             "are within one bf16 spacing", allowed, 1.0, "; ".join(notes) or "no divergence"))
    return rows


def _smollm2_outputs(model_dir: str, prompts: list, params: SamplingParams, **kw) -> list:
    llm = LLM(model_dir, device="cuda", **BUILT_IN, max_num_seqs=8, gpu_memory_utilization=0.2, **kw)
    outs = llm.generate(prompts, params)
    del llm
    _free()
    return outs


def _small_model_tokens(model_dir: str, params: dict | None = None, outputs: bool = False, **kw) -> list:
    """Greedy token ids of six prompts (``outputs``: (token ids, logprobs) pairs) from a fresh engine."""
    llm = LLM(model_dir, device="cuda", **BUILT_IN, gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=16,
              **kw)
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 16, 17, 40, 100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **(params or {})))
    del llm
    _free()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) if outputs else o.outputs[0].token_ids for o in outs]


def _launches_without_sync(model_dir: str, steps: int = 4) -> int:
    """How many of ``steps`` decode-step launches (CUDA graph) ran under ``torch.cuda.set_sync_debug_mode("error")``
    without a host sync, for a batch mixing greedy, top-k/top-p/min-p, seeded and min_tokens rows, penalties
    (counting a pending token), logit_bias and logprobs: a sync there would make async scheduling wait for the
    step before."""
    llm = LLM(model_dir, device="cuda", **BUILT_IN, gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=16)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, min_tokens=12, stop_token_ids=[5], max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=0.2, **PENALTIES),
              SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, logit_bias={7: 2.0, 11: -5.0}),
              SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, logprobs=3)]
    for i, p in enumerate(params):
        engine.add_request(f"sync{i}", list(range(3, 23 + i)), p)
    engine.step()  # the prefill
    engine.step()
    launch, clean = engine.runner.launch, []

    def strict(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(*args)
            clean.append(1)
            return out
        except RuntimeError as e:
            print(f"decode launch synced: {e}")
            raise
        finally:
            torch.cuda.set_sync_debug_mode(0)

    engine.runner.launch = strict
    for _ in range(steps):
        try:
            engine.step()
        except Exception:  # noqa: BLE001 - counted as a launch that synced
            pass
    engine.runner.launch = launch
    del llm, engine, launch, strict
    _free()
    return len(clean)


def qwen_rows(ctx: dict, make_row) -> list:
    """Small random Qwen-shaped AWQ models: Qwen2's q/k/v biases (the rotary kernel adds them to the deferred split-K
    sums) and Qwen3's per-head q/k RMSNorm (q/k/v summed in the GEMV, the norm kernel on each head): CUDA graphs =
    eager Triton = the torch references, greedy, with the gap between the two paths' logprobs. Counts, not µs."""
    rows = []
    shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, vocab_size=4096,
                 max_position_embeddings=2048)
    for what, extra in (("Qwen2 q/k/v bias", dict(qkv_bias=True, num_attention_heads=8, num_key_value_heads=2)),
                        ("Qwen3 q/k norm", dict(qk_norm=True, num_attention_heads=16, num_key_value_heads=8,
                                                head_dim=128))):  # Qwen3-0.6B's heads: q is 2048 wide, hidden 1024
        small = str(write_random_awq_model(f"/tmp/rand_{what.split()[0].lower()}", **shape, **extra))
        rows += _equality_rows(small, what, make_row)
    return rows


def sliding_window_rows(ctx: dict, make_row) -> list:
    """A small random Mistral v0.1-style AWQ model whose 24-token window is shorter than most of the six prompts
    (1-100 tokens, 24 generated): the window in prefill (a cached prefix before the new tokens included: prompts
    share their first tokens) and in decode, CUDA graphs = eager Triton = the torch references, greedy. Counts."""
    small = str(write_random_awq_model("/tmp/rand_mistral", hidden_size=1024, intermediate_size=2816,
                                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                       vocab_size=4096, max_position_embeddings=2048, sliding_window=24))
    return _equality_rows(small, "Mistral 24-token window", make_row)


#: The largest logprob gap (nats) at which two bf16 paths over a random model may pick different tokens. These
#: models' next-token distributions are nearly flat (top logprobs about -6.3 over 4,096 tokens), so the two leading
#: tokens are often 0.001-0.03 nats apart, within what bf16 rounding moves them: on the H200 every divergence of
#: the Triton path from the torch one (13 of 36 sequences, `probe/diverge.py`, twenty-third session) was such a
#: swap, 0.0003-0.031 apart in both paths, with the third token 0.03-0.25 further down.
TIE_NATS = 0.05


def _largest_gap(a: list, b: list) -> float:
    """The largest difference between two runs' logprobs of one token where their tokens agree so far (nan when
    they never do), over (token ids, logprobs) per prompt."""
    gaps = []
    for (ta, la), (tb, lb) in zip(a, b):
        for x, y, pa, pb in zip(ta, tb, la, lb):
            if x != y:
                break
            gaps += [abs(pa[t] - pb[t]) for t in pa.keys() & pb.keys()]
    return max(gaps, default=float("nan"))


def tie_report(got: list, ref: list) -> tuple[int, int, str]:
    """Two runs' (token ids, logprobs) per prompt (``_small_model_tokens(..., outputs=True)``, logprobs >= 2):
    (sequences identical, sequences identical or first differing at a near tie, a note). A near tie: at the first
    step where the tokens differ, each run's top entries hold the other run's token, at most :data:`TIE_NATS` below
    its own."""
    if len(got) != len(ref):
        raise ValueError(f"tie_report: {len(got)} prompts against {len(ref)}")
    identical, gaps, others = 0, [], []
    for i, ((ta, la), (tb, lb)) in enumerate(zip(got, ref)):
        if ta == tb:
            identical += 1
            continue
        s = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if s is None:
            others.append(f"prompt {i}: {len(ta)} against {len(tb)} tokens")
            continue
        a, b = ta[s], tb[s]
        gap = max(la[s][a] - la[s][b], lb[s][b] - lb[s][a]) if b in la[s] and a in lb[s] else None
        if gap is not None and gap <= TIE_NATS:
            gaps.append(gap)
        else:
            top = [sorted(lp[s], key=lp[s].get, reverse=True) for lp in (la, lb)]
            others.append(f"prompt {i} at token {s}: top {top[0]} here, {top[1]} there")
    note = f"{identical} of {len(got)} identical"
    if gaps:
        note += f"; {len(gaps)} first differ at near ties, at most {max(gaps):.4f} nats apart"
    return identical, identical + len(gaps), "; ".join([note, *others])


def _equality_rows(small: str, what: str, make_row) -> list:
    """Two rows for the small model ``small``: CUDA graphs = eager, and eager Triton = the torch references
    (greedy, six prompts), each counting sequences identical or first differing at a near tie
    (:func:`tie_report`)."""
    lp = dict(logprobs=3)
    graphs = _small_model_tokens(small, lp, outputs=True)
    eager = _small_model_tokens(small, lp, enforce_eager=True, outputs=True)
    with _torch_references():
        ref = _small_model_tokens(small, lp, enforce_eager=True, outputs=True)
    n, distinct, auto = len(ref), len({t for tokens, _ in ref for t in tokens}), auto_dtype(small)
    _, same_ge, note_ge = tie_report(graphs, eager)
    _, same_er, note_er = tie_report(eager, ref)
    return [make_row(f"engine greedy, {what}: CUDA graphs = eager (counts, not µs)",
                     f"random 4-layer AWQ, {what}, 6 prompts, decode and prefill graphs", n,
                     "identical or a near tie", same_ge, 1.0,
                     note_ge),
            make_row(f"engine greedy, {what}: Triton = torch reference (counts, not µs)", "same", n,
                     "identical or a near tie", same_er, 1.0, f"{auto} both; {distinct} distinct tokens; {note_er}")]


def cuda_path_rows(ctx: dict, make_row) -> list:
    """On a small random AWQ model: CUDA graphs, eager Triton and the torch references give the same greedy
    tokens (six prompts of 1-100 tokens across block boundaries, 24 tokens each; the Triton and torch paths up to
    near ties, :func:`tie_report`), in the dtype "auto" picks (float16: the model's config.json names it, as an
    AWQ checkpoint's does), and Triton = torch in the other 16-bit dtype too. "Graphs on" is the default, decode
    and prefill graphs; the first row checks the decode graphs alone. Counts, not µs."""
    small = str(write_random_awq_model("/tmp/rand_small", hidden_size=1024, intermediate_size=2816,
                                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                       vocab_size=4096, max_position_embeddings=2048))
    lp = dict(logprobs=3)
    with _prefill_graphs(False):
        decode_graphed = _small_model_tokens(small, lp, outputs=True)
    graphs = _small_model_tokens(small, lp, outputs=True)  # the default: decode and prefill graphs
    unoverlapped = _small_model_tokens(small, lp, async_scheduling=False, outputs=True)
    eager = _small_model_tokens(small, lp, enforce_eager=True, outputs=True)
    fp8 = _small_model_tokens(small, lp, kv_cache_dtype="fp8", outputs=True)
    int8 = _small_model_tokens(small, lp, kv_cache_dtype="int8", outputs=True)
    auto = auto_dtype(small)
    other = _small_model_tokens(small, lp, enforce_eager=True, dtype=OTHER_16_BIT[auto], outputs=True)
    unsynced = _launches_without_sync(small)
    penalties = dict(presence_penalty=0.2, **PENALTIES)
    penalised = _small_model_tokens(small, penalties)
    penalised_sync = _small_model_tokens(small, penalties, async_scheduling=False)
    with_logprobs = _small_model_tokens(small, dict(logprobs=2), outputs=True)
    with_logprobs_sync = _small_model_tokens(small, dict(logprobs=2), async_scheduling=False, outputs=True)
    with _torch_references():
        ref = _small_model_tokens(small, lp, enforce_eager=True, outputs=True)
        ref_fp8 = _small_model_tokens(small, lp, enforce_eager=True, kv_cache_dtype="fp8", outputs=True)
        ref_int8 = _small_model_tokens(small, lp, enforce_eager=True, kv_cache_dtype="int8", outputs=True)
        ref_other = _small_model_tokens(small, lp, enforce_eager=True, dtype=OTHER_16_BIT[auto], outputs=True)
    n = len(ref)
    ties = {kv: tie_report(got, want) for kv, got, want in ((auto, eager, ref), ("fp8", fp8, ref_fp8),
                                                            ("int8", int8, ref_int8), ("other", other, ref_other))}
    distinct = len({t for tokens, _ in ref for t in tokens})
    return [make_row("engine greedy: CUDA graphs = eager (counts, not µs)",
                     "random 4-layer AWQ, 6 prompts, decode graphs only", n,
                     "sequences identical", sum(a[0] == b[0] for a, b in zip(decode_graphed, eager)), 1.0,
                     f"{distinct} distinct tokens; top-3 logprobs at most {_largest_gap(decode_graphed, eager):.4f} "
                     "apart"),
            make_row("engine greedy: prefill graphs too = eager (counts, not µs)", "same, 179 prompt tokens in one "
                     "256-token graph", n, "sequences identical",
                     sum(a[0] == b[0] for a, b in zip(graphs, eager)), 1.0,
                     f"top-3 logprobs at most {_largest_gap(graphs, eager):.4f} apart"),
            make_row("engine greedy: async scheduling = not (counts, not µs)", "same, graphs on", n,
                     "sequences identical", sum(a == b for a, b in zip(graphs, unoverlapped)), 1.0, ""),
            make_row("engine greedy: Triton = torch reference (counts, not µs)", "same", n,
                     "identical or a near tie", ties[auto][1], 1.0, f"{auto} both; {ties[auto][2]}"),
            make_row(f"engine greedy, {OTHER_16_BIT[auto]}: Triton = torch reference (counts, not µs)", "same", n,
                     "identical or a near tie", ties["other"][1], 1.0,
                     f"{OTHER_16_BIT[auto]} both; {ties['other'][2]}"),
            make_row("decode launches without a host sync (counts, not µs)", "same, graphs, 6 mixed rows", 4,
                     "launches", unsynced, 1.0,
                     "greedy, top-k/p + min-p, seeded + min_tokens, penalised, logit_bias, logprobs rows"),
            make_row("engine logprobs=2: async scheduling = not (counts, not µs)", "same, graphs on", n,
                     "sequences identical", sum(a == b for a, b in zip(with_logprobs, with_logprobs_sync)), 1.0,
                     "tokens and every logprobs entry, read back a step later"),
            make_row("engine penalised greedy: async scheduling = not (counts, not µs)", "same, graphs on", n,
                     "sequences identical", sum(a == b for a, b in zip(penalised, penalised_sync)), 1.0,
                     "repetition 1.05, frequency 0.3, presence 0.2: a pending token counted on the device"),
            *(make_row(f"engine greedy, {kv} KV: Triton = torch reference (counts, not µs)", "same", n,
                       "identical or a near tie", ties[kv][1], 1.0,
                       f"{ties[kv][2]}; {sum(a[0] == b[0] for a, b in zip(got, graphs))} of {n} equal to the {auto} "
                       "cache's") for kv, got in (("fp8", fp8), ("int8", int8)))]


#: Llama-3-8B's shapes (GQA 32 / 8 heads, a 14336-wide MLP, a 128k vocabulary): no plan of w4a16.TUNED fits them
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def measured_plan_rows(ctx: dict, make_row) -> list:
    """Plans measured on this GPU at start-up (engine/kernel_plans.py) against the built-in ones (TUNED, else
    choose_plan's rules), on a Llama-3-8B-shaped random AWQ model (no TUNED plan fits it) and on the Llama-2-7B one
    (TUNED was measured for it on an H200): decode at 1, 8 and 64 sequences, graphs on. The rows elsewhere run the
    built-in plans (``tune_kernels=False``), as before this row existed."""
    from kernels import w4a16_tune

    models = [("8B", "Llama-3-8B shape", lambda: str(write_random_awq_model("/tmp/rand_8b", **LLAMA3_8B))),
              ("7B", "Llama-2-7B shape",
               lambda: _model_7b(ctx))]
    rows = []
    for name, shape, write in models:
        model_dir, plans_dir = write(), tempfile.mkdtemp(prefix="plans-")
        tok_s, notes = {}, {}
        for measured in (False, True):
            start = time.perf_counter()
            llm = LLM(model_dir, device="cuda", max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=0.4,
                      tune_kernels=measured, kernel_plans_dir=plans_dir)
            notes[measured] = f"start-up {time.perf_counter() - start:.0f} s; {llm.engine.runner.kernel_plans}"
            for batch in (1, 8, 64):
                _batch_decode_tok_s(llm, batch, 32, 8)  # warm-up
                tok_s[measured, batch] = _batch_decode_tok_s(llm, batch, 32, 256)
            del llm
            _free()
        files = list(Path(plans_dir).glob("*.json"))
        picks = json.loads(files[0].read_text())["plans"] if files else []
        ctx["log"][f"measured_plans_{name}"] = picks
        for r in picks:
            print(f"  {name} M={r['m']:<3d} {r['k']}->{r['n']}{' gated' if r['gated'] else ''}: {r['us']:.1f} us "
                  f"({r['default_us']:.1f} built-in) {r['plan']}")
        w4a16_tune.install([])  # later rows run the built-in plans
        for batch in (1, 8, 64):
            ours, base = batch * 1e6 / tok_s[True, batch], batch * 1e6 / tok_s[False, batch]
            rows.append(make_row(f"{name} AWQ decode, {batch} sequence{'s' if batch > 1 else ''}, plans measured "
                                 "here vs built-in", f"{shape}, ctx ~160, graphs on", ours, "built-in plans", base,
                                 1.0, f"{tok_s[True, batch]:.0f} vs {tok_s[False, batch]:.0f} tok/s"
                                 + (f"; {notes[True]}; built-in: {notes[False]}" if batch == 1 else "")))
    return rows


#: Llama 3.1's RoPE (config.json ``rope_scaling``), and YaRN as Qwen's long-context recipe sets it
LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)


def scaled_rope_rows(ctx: dict, make_row) -> list:
    """Scaled RoPE on CUDA (engine/models/rope.py: the cos/sin table changes, the kernels do not). Small random
    AWQ models with Llama 3.1's ``llama3`` RoPE (its original context shortened to 64 tokens, so that the scaling
    moves the angles of these short prompts) and with YaRN (Qwen2-shaped, original context 256; its attention factor
    scales cos and sin):
    CUDA graphs = eager = the torch references, greedy, with logprob gaps. Then batch-1 decode of a Llama-3.1-8B-
    shaped model (128k vocabulary, llama3 RoPE, max_position_embeddings 131072) against its bandwidth bound."""
    rows = []
    shape = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, vocab_size=4096,
                 num_attention_heads=8, num_key_value_heads=2)
    for what, extra in (("llama3 RoPE", dict(rope_theta=500000.0, max_position_embeddings=131072,
                                              rope_scaling={**LLAMA31_ROPE, "original_max_position_embeddings": 64})),
                        ("YaRN RoPE", dict(qkv_bias=True, rope_theta=1e6, max_position_embeddings=32768,
                                           rope_scaling={**YARN_ROPE, "original_max_position_embeddings": 256}))):
        small = str(write_random_awq_model(f"/tmp/rand_{what.split()[0].lower()}", **shape, **extra))
        rows += _equality_rows(small, what, make_row)
    model_dir = _model_8b_31(ctx)
    torch.cuda.reset_peak_memory_stats()
    llm = _decode_engine(model_dir)
    tok_s = _decode_tok_s(llm, 32, 256)
    bytes_per_step = _bytes_per_step(llm)
    rows.append(make_row("Llama-3.1-8B AWQ decode bs1, CUDA graphs, vs bandwidth bound",
                         "Llama-3.1-8B shape, llama3 RoPE, ctx ~160", 1e6 / tok_s, "bytes/step ÷ copy BW",
                         bytes_per_step / ctx["copy_bw"] * 1e6, None,
                         f"{tok_s:.0f} tok/s; {bytes_per_step / 1e9:.2f} GB/step; built-in plans; peak "
                         f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"))
    del llm
    _free()
    return rows


#: http_rows' load: (concurrency, requests, output tokens per request), 128-token prompts
HTTP_LEVELS = ((1, 4, 256), (16, 32, 256), (64, 64, 256), (256, 256, 512))
if os.environ.get("HTTP_LEVELS"):  # "c:n:t,c:n:t": a shorter run
    HTTP_LEVELS = tuple(tuple(int(x) for x in lv.split(":")) for lv in os.environ["HTTP_LEVELS"].split(","))


def _offline_tok_s(llm: LLM, prompt: str, concurrency: int, tokens: int) -> float:
    """Output tok/s of ``concurrency`` copies of ``prompt`` through ``LLM.generate`` at once, best of two."""
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        outs = llm.generate([prompt] * concurrency, SamplingParams(temperature=0, max_tokens=tokens,
                                                                   ignore_eos=True))
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return best


def http_rows(ctx: dict, make_row, device: str = "cuda", levels=HTTP_LEVELS) -> list:
    """What a client of the OpenAI server gets against the engine in process: the 7B-shaped model behind
    ``python -m engine.server`` (a subprocess on a free port; 256 sequences, 1,024-token context, built-in plans),
    loaded by ``appliance bench``'s load generator (streamed completions, 128-token prompts), output tok/s per
    concurrency level against ``LLM.generate`` of the same prompts at once, same settings; TTFT, ITL and TPOT in
    the note. For each of :data:`HTTP_MODES`: the engine in a process of its own (the default on CUDA), the same
    without uvloop and httptools, and on the server's engine thread (``--no-engine-process``). Needs the server's
    wheels on the GPU machine (fastapi, starlette, uvicorn, uvloop, httptools, sse-starlette, pydantic,
    pydantic-core, annotated-types, typing-inspection, opentelemetry-api, anyio, typing-extensions, tomli-w, and
    whatever of click, h11, httpx, prometheus-client, psutil, rich it lacks: carried
    as ``.whl``, the device README's recipe). ``device``, ``levels``: for a smoke run on the CPU (a small model in
    ``ctx["model_7b"]``). The servers' logs: ``$OUT/http_server_*.log``."""
    model_dir = _model_7b(ctx)
    print(f"[http_rows] checkpoint ready at {time.strftime('%H:%M:%S')}", flush=True)
    settings = dict(max_num_seqs=256, max_model_len=1024, gpu_memory_utilization=0.85)
    prompt = "hello " * 128  # 128 tokens: this tokenizer makes every unknown word one token ("t0")
    llm = LLM(model_dir, device=device, **BUILT_IN, **settings)
    llm.generate([prompt] * max(c for c, _, _ in levels), SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True))  # warm-up
    offline = {c: _offline_tok_s(llm, prompt, c, tokens) for c, _, tokens in levels}
    print(f"[http_rows] offline done at {time.strftime('%H:%M:%S')}", flush=True)
    del llm
    _free()
    rows = []
    for mode, flag, plain in HTTP_MODES:
        results = _serve_levels(model_dir, settings, device, flag, levels, plain)
        print(f"[http_rows] {mode} done at {time.strftime('%H:%M:%S')}", flush=True)
        for (conc, n, tokens), r in zip(levels, results):
            rows.append(make_row(f"OpenAI server over HTTP ({mode}) vs in process, {conc} concurrent",
                                 f"7B shape, {n} streamed completions, 128 + {tokens} tokens",
                                 1e6 / max(r.output_tok_per_s, 1e-9), "LLM.generate, same prompts at once",
                                 1e6 / offline[conc], None,
                                 f"{r.output_tok_per_s:.0f} vs {offline[conc]:.0f} tok/s (µs per output token); "
                                 f"TTFT median {r.ttft.median * 1e3:.1f} ms, p99 {r.ttft.p99 * 1e3:.1f}; ITL median "
                                 f"{r.itl.median * 1e3:.2f} ms, p99 {r.itl.p99 * 1e3:.2f}; TPOT median "
                                 f"{r.tpot.median * 1e3:.2f} ms; {r.errors} failed; {http_clients(conc)} client "
                                 f"process(es)"))
    return rows


def http_clients(concurrency: int) -> int:
    """Load-generator processes for a level of ``http_rows``: one per 32 streams. One Python client takes about
    180 µs of CPU per streamed chunk (``bench/server_cpu.py``), so a single one capped runs 88-92 near 9k tok/s,
    below what the server sends."""
    return max(1, concurrency // 32)


#: The servers ``http_rows`` measures: (mode, engine flag, plain), where ``plain`` hides uvloop and httptools
#: from the server so that uvicorn falls back to asyncio's loop and h11 (what it ran on before they were
#: dependencies).
HTTP_MODES = [("engine process", "--engine-process", False),
              ("engine process, asyncio + h11", "--engine-process", True),
              ("engine thread", "--no-engine-process", False)]

#: ``python -c`` code that runs ``engine.server`` as ``-m`` would with uvloop and httptools unimportable
_PLAIN_SERVER = ("import runpy, sys; sys.modules['uvloop'] = sys.modules['httptools'] = None; "
                 "sys.argv[0] = 'engine.server'; runpy.run_module('engine.server', run_name='__main__')")


def _serve_levels(model_dir: str, settings: dict, device: str, flag: str, levels, plain: bool = False) -> list:
    """``python -m engine.server`` over ``model_dir`` with ``flag`` on a free port (``plain``: see
    :data:`HTTP_MODES`), each level of ``levels`` run against it once its shapes are compiled (a short run
    first); the load generator's results, in order."""
    import asyncio
    import socket
    import subprocess
    import sys

    from appliance import loadgen
    from appliance.installer import server_health

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [sys.executable, *(["-c", _PLAIN_SERVER] if plain else ["-m", "engine.server"]), "--model", model_dir, "--port", str(port), "--no-tune-kernels",
            "--kernel-plans-dir", _NO_PLANS.name, "--log-level", "warning", "--device", device,
            flag, *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]
    log = Path(os.environ.get("OUT", "/tmp")) / f"http_server_{flag.strip('-')}{'_plain' if plain else ''}.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, health = time.monotonic() + 300, None
        while time.monotonic() < deadline and server.poll() is None:
            health = server_health(url, timeout=2)
            if health.state in ("ready", "failed"):
                break
            time.sleep(1)
        if server.poll() is not None or health is None or health.state != "ready":
            raise RuntimeError(f"the server did not come up ({health.detail if health else 'exited'}; see {log})")
        name = loadgen.served_model(url)
        print(f"[http_rows] server ({flag}) ready at {time.strftime('%H:%M:%S')}", flush=True)
        results = []
        for conc, n, tokens in levels:
            asyncio.run(loadgen.run_level(url, name, conc, conc, 128, 8))  # the level's shapes compiled
            results.append(asyncio.run(loadgen.run_level(url, name, conc, n, 128, tokens,
                                                         processes=http_clients(conc))))
        return results
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _model_8b_31(ctx: dict) -> str:
    """The Llama-3.1-8B-shaped random AWQ checkpoint (128k vocabulary, llama3 RoPE to 131,072 tokens), written
    once per suite run (``ctx["model_8b_31"]``)."""
    if "model_8b_31" not in ctx:
        ctx["model_8b_31"] = str(write_random_awq_model(
            "/tmp/rand_8b_31", **{**LLAMA3_8B, "max_position_embeddings": 131072}, rope_theta=500000.0,
            rope_scaling=LLAMA31_ROPE))
    return ctx["model_8b_31"]


def consumer_fit_rows(ctx: dict, make_row) -> list:
    """The tuner's plans on 8, 12 and 24 GiB of a consumer card's memory (bench/consumer_fit.py)."""
    from bench.consumer_fit import consumer_fit_rows as rows

    def model(write):
        def folder() -> str:
            path = write(ctx)
            _free()  # the writer's random numbers were drawn on the GPU: give the memory back before the hog
            return path
        return folder

    from bench.consumer_fit import breakdown_rows

    _free()
    models = {"llama2_7b": model(_model_7b), "llama31_8b": model(_model_8b_31)}
    first = [] if os.environ.get("CONSUMER_FIT_BREAKDOWN") == "0" else breakdown_rows(
        ctx, make_row, {"llama31_8b": models["llama31_8b"]})
    return first + rows(ctx, make_row, models)


#: What ``bench/gpu_suite.py`` runs after its kernel rows, in order; ``ENGINE_ROWS=name,name`` picks some, in
#: the order given (an unknown name is an error).
SUITE_ROWS = [cuda_path_rows, qwen_rows, sliding_window_rows, scaled_rope_rows, smollm2_rows, decode_rows,
              decode_ablation_rows, prefill_host_rows, mixed_step_rows, measured_plan_rows, throughput_rows,
              http_rows, consumer_fit_rows]
if os.environ.get("ENGINE_ROWS"):
    _BY_NAME = {fn.__name__: fn for fn in SUITE_ROWS}
    _unknown = [n for n in os.environ["ENGINE_ROWS"].split(",") if n not in _BY_NAME]
    if _unknown:
        raise SystemExit(f"ENGINE_ROWS: unknown {', '.join(_unknown)}; choose from {', '.join(_BY_NAME)}")
    SUITE_ROWS = [_BY_NAME[n] for n in os.environ["ENGINE_ROWS"].split(",")]

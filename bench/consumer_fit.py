"""Does the tuner's plan run on a consumer GPU's memory? One big GPU plays an 8, 12 or 24 GiB card.

A "hog" process holds all of the GPU's memory but what a card of that size, with a desktop on it, leaves free; then
a fresh process does what ``appliance install`` and the service do: ``appliance.tuner.plan`` on what
``appliance.hardware.detect`` reports (NVML, before CUDA is touched), then the engine with that plan's
``gpu_memory_utilization``, ``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``, ``kv_cache_dtype`` and
``dtype``, the start-up kernel tuning on (the service's default). It then runs what fills every buffer the plan counts:

- long: prompts of up to 8,192 tokens (and one of ``max_model_len`` if that is at most 32,768), one more than the
  KV cache holds at once, 16 tokens each: chunked prefill at the step's token budget, preemption;
- wide: ``max_num_seqs`` prompts of 128 tokens at once, 128 tokens each, sampled (top-k, top-p, penalties, 5
  logprobs): the largest decode batch and the sampler's [rows, vocab] buffers;
- prompt logprobs: two 4,096-token prompts with ``prompt_logprobs=5`` (the other peak the plan counts).

The parent samples the device's used memory (NVML) every 20 ms while the child runs: the child's footprint is the
peak less what was used before it started. The plan holds when the child finishes every request and its footprint
stays within its share (``gpu_memory_utilization`` x total memory). The tuner picks the share in steps of 1% of the
total, 0.8 GiB on an H100, too coarse to play a small card: so the child plans with the share a card of that size
gets given as ``gpu_memory_utilization`` (as ``--gpu-memory-utilization`` would; the plan sizes all else), and the
hog leaves that share and 0.55 GiB free: about what a real card's tuner keeps spare.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from appliance.tuner import GPU_FREE_MARGIN

GIB = 2**30
MIB = 2**20
#: (what the simulated card is, model, the engine's share of the card in GiB, --max-num-batched-tokens or None):
#: with a desktop holding 0.6 GiB the tuner gives an 8 GiB card 86% (6.88 GiB), a 12 or 24 GiB one 90%. The first
#: ran out of memory at start-up on an H100 (7.41 GiB used; 2026-12-07), with the tuner's then fallback to
#: 256-token steps; the tuner refuses that plan now, so it is asked for with the flag
SCENARIOS = (("8 GiB card (RTX 4060 Ti 8 GB, 3070), 256-token steps", "llama31_8b", 6.88, 256),
             ("24 GiB card (RTX 3090 / 4090)", "llama31_8b", 21.6, None),
             ("12 GiB card (RTX 3060 12 GB)", "llama31_8b", 10.8, None),
             ("8 GiB card", "llama2_7b", 6.88, None))
if os.environ.get("CONSUMER_FIT_SCENARIOS"):  # "0,3": those of SCENARIOS only (a shorter call)
    SCENARIOS = tuple(SCENARIOS[int(i)] for i in os.environ["CONSUMER_FIT_SCENARIOS"].split(","))
MODEL_NAMES = {"llama2_7b": "Llama-2-7B AWQ", "llama31_8b": "Llama-3.1-8B AWQ"}
TUNER_SPARE = GPU_FREE_MARGIN  # what the tuner keeps free when other processes hold memory
HOG_SLACK = 48 * MIB  # free memory over the tuner's spare and the share: less than 1% of the big GPU
CHILD_TIMEOUT_S = 300
#: where each child's JSON report goes (``$CONSUMER_FIT_DIR``: the device's $OUT keeps them if the call is cut short)
REPORTS = os.environ.get("CONSUMER_FIT_DIR", "/tmp")
REPO = Path(__file__).parent.parent
LONG_PROMPT_CAP, FULL_LENGTH_CAP, WIDE_PROMPT, WIDE_TOKENS, PL_PROMPT = 8192, 32768, 128, 128, 4096


def _this(*args: str) -> list[str]:
    """The command line that runs this file's ``args[0]`` mode (hog, child, breakdown) in a process of its own."""
    return [sys.executable, "-m", "bench.consumer_fit", *args]


def hog_free(share_bytes: float) -> int:
    """The free bytes the hog leaves: the share, the tuner's spare and :data:`HOG_SLACK`."""
    return int(share_bytes) + TUNER_SPARE + HOG_SLACK


# --- the hog: holds GPU memory until its stdin closes -------------------------------------------------------------

def hog() -> None:
    """Read "alloc N" lines: allocate N bytes and answer "ok"; exit when stdin closes."""
    import torch

    held = []
    for line in sys.stdin:
        n = int(line.split()[1])
        if n > 0:
            held.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        print("ok", flush=True)


class Hog:
    """The hog process, holding all but ``free`` bytes of the device (within 2 MiB: the allocator's rounding)."""

    def __init__(self, nvml, handle, free: int):
        self.proc = subprocess.Popen(_this("hog"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        now = nvml.nvmlDeviceGetMemoryInfo(handle).free
        self._alloc(now - free - GIB)  # its CUDA context takes some of the first GiB; the top-up takes the rest
        self._alloc(nvml.nvmlDeviceGetMemoryInfo(handle).free - free)

    def _alloc(self, n: int) -> None:
        self.proc.stdin.write(f"alloc {max(0, n)}\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError(f"the memory hog failed to allocate {n / GIB:.2f} GiB")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


# --- the child: plan, engine, load ---------------------------------------------------------------------------------

def _prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def child(model_dir: str, out: str, utilization: str = "", device: str = "cuda", step: str = "") -> None:
    """Plan as ``appliance tune`` does (``utilization`` and ``step``, if not empty, given as
    --gpu-memory-utilization and --max-num-batched-tokens), start the engine with the plan as the service would,
    run the three loads; write a JSON report."""
    from appliance import hardware, tuner

    hw = hardware.detect()
    report: dict = {"total": hw.gpu.total_memory if hw.gpu else 0, "free": hw.gpu.free_memory if hw.gpu else 0,
                    "phases": {}}
    try:
        plan = tuner.plan(tuner.ModelInfo.from_dir(model_dir), hw,
                          gpu_memory_utilization=float(utilization) if utilization else None,
                          max_num_batched_tokens=int(step) if step else None)
    except tuner.TuneError as exc:
        report["refused"] = str(exc)
        Path(out).write_text(json.dumps(report))
        return
    report["plan"] = plan.to_dict()
    Path(out).write_text(json.dumps(report))
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model_dir, device=device, tune_kernels=device == "cuda", kernel_plans_dir="/tmp/consumer_fit_plans",
              gpu_memory_utilization=plan.gpu_memory_utilization, max_num_seqs=plan.max_num_seqs,
              max_model_len=plan.max_model_len, max_num_batched_tokens=plan.max_num_batched_tokens,
              kv_cache_dtype=plan.kv_cache_dtype, dtype=plan.dtype, cpu_kv_cache_gib=plan.cpu_kv_cache_gib)
    engine = llm.engine
    blocks, block_size = engine.runner.num_blocks, plan.block_size
    report.update(start_s=time.perf_counter() - start, num_blocks=blocks)
    vocab = engine.vocab_size
    kv_tokens = blocks * block_size
    long_len = min(plan.max_model_len - 16, LONG_PROMPT_CAP)
    long = _prompts(min(plan.max_num_seqs, kv_tokens // long_len + 1), long_len, vocab, 1)
    if long_len < plan.max_model_len - 16 <= FULL_LENGTH_CAP:
        long += _prompts(1, plan.max_model_len - 16, vocab, 2)
    wide = _prompts(plan.max_num_seqs, min(WIDE_PROMPT, plan.max_model_len - WIDE_TOKENS), vocab, 3)
    pl = _prompts(2, min(PL_PROMPT, plan.max_model_len - 4), vocab, 4)
    loads = (("long", long, [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(long)),
             ("wide", wide, [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1,
                                            frequency_penalty=0.2, logprobs=5, seed=i, max_tokens=WIDE_TOKENS,
                                            ignore_eos=True) for i in range(len(wide))]),
             ("prompt logprobs", pl, [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5,
                                                       ignore_eos=True)] * len(pl)))
    import torch

    cuda = device == "cuda"
    if cuda:  # at rest: weights, KV cache, persistent buffers (torch's), and what the process holds in all
        report.update(rest_allocated=torch.cuda.memory_allocated(), rest_reserved=torch.cuda.memory_reserved(),
                      kv_bytes=blocks * engine.runner._bytes_per_block(), rest_free=torch.cuda.mem_get_info()[0])
    for name, prompts, params in loads:
        before = engine.scheduler.num_preemptions
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        report["phases"][name] = dict(
            requests=len(prompts), prompt_tokens=len(prompts[0]["prompt_token_ids"]),
            finished=sum(o.outputs[0].finish_reason == "length" for o in outs),
            tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            preemptions=engine.scheduler.num_preemptions - before, seconds=time.perf_counter() - start,
            peak_over_rest=(torch.cuda.max_memory_allocated() - report["rest_allocated"]) if cuda else 0)
        Path(out).write_text(json.dumps(report))
    if cuda:
        report["torch_peak_reserved"] = torch.cuda.max_memory_reserved()
    report["free_blocks_after"] = engine.scheduler.block_manager.num_free_blocks
    Path(out).write_text(json.dumps(report))


BREAKDOWN_STEPS = (256, 512, 1024, 2048)


def breakdown(model_dir: str, out: str, used_before: str) -> None:
    """What the memory plan's reserves hold, measured: an engine of 256 sequences and a step of 2,048 tokens with
    a small KV cache (256 blocks); at rest, the bytes outside torch's allocator (CUDA context, cuBLAS, compiled
    kernels: the device's used memory less ``used_before`` less torch's reserved) and the CUDA graphs' pool; then
    the peak over rest of one prefill step of each of :data:`BREAKDOWN_STEPS` tokens (activations, and above 256
    rows the whole weight dequantized for cuBLAS) and of a 256-row sampled step."""
    import pynvml as nvml
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cuda", max_num_seqs=256, max_model_len=4096, num_kv_blocks=256,
              tune_kernels=False, kernel_plans_dir="/tmp/consumer_fit_no_plans")
    engine = llm.engine
    nvml.nvmlInit()
    used = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0)).used  # the parent's reading's API
    nvml.nvmlShutdown()
    report = dict(used_before=int(used_before), used_at_rest=used, reserved=torch.cuda.memory_reserved(),
                  allocated=torch.cuda.memory_allocated(),
                  graph_pool=getattr(engine.runner.graphs, "pool_bytes", None), steps={})
    report["non_torch"] = report["used_at_rest"] - report["used_before"] - report["reserved"]
    vocab = engine.vocab_size
    for tokens in BREAKDOWN_STEPS:
        prompt = _prompts(1, tokens, vocab, tokens)
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))  # compiles
        torch.cuda.synchronize()
        rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        llm.generate(_prompts(1, tokens, vocab, tokens + 1), SamplingParams(temperature=0, max_tokens=1,
                                                                            ignore_eos=True))
        report["steps"][tokens] = torch.cuda.max_memory_allocated() - rest
    for i, prompt in enumerate(_prompts(256, 4, vocab, 7)):  # 256 rows sampled: the peak of decode steps only
        engine.add_request(f"wide-{i}", prompt["prompt_token_ids"], SamplingParams(
            temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1, logprobs=5, seed=i, max_tokens=8,
            ignore_eos=True))
    for _ in range(3):  # the 1,024-token prefill (one step), then decodes
        engine.step()
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    report["sampler_256"] = torch.cuda.max_memory_allocated() - rest
    while engine.has_unfinished_requests():
        engine.step()
    report["reserved_peak"] = torch.cuda.max_memory_reserved()
    Path(out).write_text(json.dumps(report))


def breakdown_rows(ctx: dict, make_row, models: dict) -> list:
    """One row per model: the non-torch bytes against ``NON_TORCH_BYTES``; the note has every figure."""
    import pynvml as nvml

    from engine.memory import ACTIVATION_BUFFERS, ACTIVATION_SPARE, NON_TORCH_BYTES

    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    rows = []
    for model in models:
        model_dir = models[model]()
        out = f"{REPORTS}/consumer_fit_breakdown_{model}.json"
        used = nvml.nvmlDeviceGetMemoryInfo(handle).used
        proc = subprocess.run(_this("breakdown", model_dir, out, str(used)), cwd=REPO, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
        if proc.returncode:
            rows.append(make_row(f"memory plan's reserves measured: {MODEL_NAMES[model]} (MiB, not µs)", "",
                                 float("nan"), "NON_TORCH_BYTES", NON_TORCH_BYTES / MIB, None,
                                 f"EXIT {proc.returncode}: {_last_line(proc.stderr)}"))
            continue
        r = json.loads(Path(out).read_text())
        ctx["log"].setdefault("consumer_fit_breakdown", {})[model] = r
        reserve = ACTIVATION_SPARE * ACTIVATION_BUFFERS * 4096 * 2  # bytes a step token reserves (hidden 4096)
        steps = ", ".join(f"{t} tokens {b / MIB:.0f} MiB (reserved {reserve * int(t) / MIB:.0f})"
                          for t, b in r["steps"].items())
        rows.append(make_row(f"memory plan's reserves measured: {MODEL_NAMES[model]} (MiB, not µs)",
                             "256 sequences, step 2048, 256 KV blocks", r["non_torch"] / MIB,
                             "NON_TORCH_BYTES", NON_TORCH_BYTES / MIB, None,
                             f"non-torch {r['non_torch'] / MIB:.0f} MiB, graph pool "
                             f"{(r['graph_pool'] or 0) / MIB:.0f}; "
                             f"torch at rest {r['allocated'] / GIB:.2f} GiB allocated, {r['reserved'] / GIB:.2f} "
                             f"reserved; prefill step peaks over rest: {steps}; 256-row sampled step "
                             f"{r['sampler_256'] / MIB:.0f} MiB"))
    nvml.nvmlShutdown()
    return rows


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


# --- the parent: one suite row per scenario -----------------------------------------------------------------------

def _run_child(nvml, handle, model_dir: str, out: str, util: float, step: int | None) -> tuple[int, int, int, str]:
    """Run the child; return (exit status, peak used bytes, lowest free bytes, stderr's tail) while it ran."""
    peak, low, done = [0], [1 << 62], threading.Event()

    def sample() -> None:
        while not done.is_set():
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            peak[0], low[0] = max(peak[0], mem.used), min(low[0], mem.free)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = subprocess.run(_this("child", model_dir, out, repr(util), "cuda", str(step or "")), cwd=REPO,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        status, err = proc.returncode, proc.stderr[-3000:]
    except subprocess.TimeoutExpired as exc:
        status, err = -9, f"no end in {CHILD_TIMEOUT_S} s: {(exc.stderr or b'')[-2000:]!r}"
    finally:
        done.set()
        sampler.join()
    return status, peak[0], low[0], err


def consumer_fit_rows(ctx: dict, make_row, models: dict, scenarios=SCENARIOS) -> list:
    """One row per scenario: ours = the child's peak footprint (GiB), baseline = its share (GiB); ratio >= 1 when
    it fits. ``models`` maps SCENARIOS' model keys to a function returning the checkpoint folder."""
    import pynvml as nvml

    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    total = nvml.nvmlDeviceGetMemoryInfo(handle).total
    rows, log = [], ctx["log"].setdefault("consumer_fit", [])
    for card, model, share_gib, step in scenarios:
        model_dir = models[model]()
        util = share_gib * GIB / total
        hog_ = Hog(nvml, handle, hog_free(share_gib * GIB))
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out = f"{REPORTS}/consumer_fit_{len(rows)}.json"
            Path(out).unlink(missing_ok=True)  # a warm machine keeps /tmp: never read an older run's report
            status, peak, low, err = _run_child(nvml, handle, model_dir, out, util, step)
        finally:
            hog_.close()
        report = json.loads(Path(out).read_text()) if Path(out).exists() else {}
        report.update(card=card, model=model, status=status, free_before=mem.free, footprint=peak - mem.used,
                      lowest_free=low, stderr=err if status else "")
        log.append(report)
        plan, phases = report.get("plan", {}), report.get("phases", {})
        done = all(p["finished"] == p["requests"] for p in phases.values()) and len(phases) == 3
        if "refused" in report:
            rows.append(make_row(f"tuned plan fits: {card} (GiB, not µs)", MODEL_NAMES[model], float("nan"),
                                 "util x total", util * total / GIB, None, f"the tuner refused: {report['refused']}"))
            continue
        footprint = (peak - mem.used) / GIB
        # what makes the row say no whatever its footprint (engine rows carry their verdicts: gpu_suite runs as
        # __main__, so its FAILURES list is not the one ``import bench.gpu_suite`` would reach)
        problems = [f"EXIT {status}: {_last_line(err)}"] if status else []
        if not done:
            problems.append(f"loads finished: {sorted(phases)}")
        if "num_blocks" in report and report["num_blocks"] < plan["num_kv_blocks"]:
            problems.append(f"the engine got {report['num_blocks']} KV blocks, the plan {plan['num_kv_blocks']}")
        mib = {k: f"{p['peak_over_rest'] / MIB:.0f}" for k, p in phases.items()}
        note = (f"util {util:.4f}, step {plan.get('max_num_batched_tokens')}, "
                f"max_model_len {plan.get('max_model_len')}, "
                f"max_num_seqs {plan.get('max_num_seqs')}, "
                f"{report.get('num_blocks')} KV blocks (plan {plan.get('num_kv_blocks')}); free before "
                f"{mem.free / GIB:.2f} GiB, lowest {low / GIB:.2f}; "
                + "; ".join(f"{k}: {p['finished']}/{p['requests']} x {p['prompt_tokens']} tok, "
                            f"{p['preemptions']} preempted, {p['seconds']:.1f} s" for k, p in phases.items())
                + f"; torch at rest {report.get('rest_allocated', 0) / GIB:.2f} GiB allocated (KV "
                  f"{report.get('kv_bytes', 0) / GIB:.2f}), "
                  f"{report.get('rest_reserved', 0) / GIB:.2f} reserved; peaks over rest (MiB) {mib}"
                + (f"; FAILED (footprint {footprint:.2f} GiB): {'; '.join(problems)}" if problems else ""))
        rows.append(make_row(f"tuned plan fits: {card}, footprint vs share (GiB, not µs)", MODEL_NAMES[model],
                             float("inf") if problems else footprint, "util x total", util * total / GIB, 1.0, note))
    nvml.nvmlShutdown()
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "hog":
        hog()
    elif sys.argv[1] == "breakdown":
        breakdown(*sys.argv[2:])
    elif sys.argv[1] == "child":
        child(*sys.argv[2:])

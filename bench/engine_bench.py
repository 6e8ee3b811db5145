"""Engine-level GPU benchmarks of issue 3 (called by ``bench/gpu_suite.py``; every figure a ratio to a baseline
timed in the same run).

* batch-1 decode of a Llama-2-7B-shaped random AWQ model, CUDA graphs on, against the bandwidth bound
  (bytes read per step / measured copy bandwidth), and against our own eager engine;
* 256 concurrent requests (128 prompt / 512 output tokens) against transformers bf16 ``generate`` at batch 128
  on same-shaped random weights;
* greedy agreement of the GPU path with the CPU reference on the SmolLM2 demo checkpoint, when present.
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams


def _free() -> None:
    """Return freed GPU memory to the device (callers ``del`` their references first)."""
    gc.collect()
    torch.cuda.empty_cache()


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


def _decode_tok_s(llm: LLM, prompt_len: int, steps: int) -> float:
    engine = llm.engine
    engine.add_request("bench", list(range(3, 3 + prompt_len)),
                       SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    engine.abort_request("bench")
    engine.step()
    return steps / elapsed


def bench_decode_bs1(model_dir: str, copy_bw: float, rows: list) -> None:
    """copy_bw: measured device copy bandwidth in bytes/s."""
    results = {}
    for eager in (False, True):
        torch.cuda.reset_peak_memory_stats()
        llm = LLM(model_dir, device="cuda", max_num_seqs=1, max_model_len=1024, enforce_eager=eager,
                  gpu_memory_utilization=0.3)
        _decode_tok_s(llm, 32, 16)  # warm-up
        results[eager] = _decode_tok_s(llm, 32, 256)
        kv_bytes = llm.engine.runner._bytes_per_block() / llm.engine.config.block_size * 160
        bytes_per_step = _weight_bytes(llm) + kv_bytes
        peak = torch.cuda.max_memory_allocated() / 2**30
        del llm
        _free()
        rows.append((f"7B AWQ bs1 decode, {'eager' if eager else 'CUDA graphs'}", f"{results[eager]:.0f} tok/s",
                     f"bound {copy_bw / bytes_per_step:.0f} tok/s", f"{results[eager] * bytes_per_step / copy_bw:.2f}",
                     f"{peak:.1f} GiB"))
    rows.append(("7B AWQ bs1 decode, graphs vs eager", f"{results[False]:.0f} tok/s", f"{results[True]:.0f} tok/s",
                 f"{results[False] / results[True]:.2f}", ""))


def _hf_generate_tok_s(model_dir: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.pop("quantization_config")
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    ids = torch.randint(3, cfg["vocab_size"], (batch, prompt_len), device="cuda")
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    tok_s = batch * new_tokens / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model
    _free()
    return tok_s, peak


def bench_throughput(model_dir: str, rows: list, requests: int = 256, prompt_len: int = 128,
                     output_len: int = 512, hf_new_tokens: int = 128) -> None:
    hf, hf_peak = _hf_generate_tok_s(model_dir, 128, prompt_len, hf_new_tokens)
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(model_dir, device="cuda", max_num_seqs=256, max_model_len=1024, gpu_memory_utilization=0.5)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (prompt_len,), generator=gen).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    peak = torch.cuda.max_memory_allocated() / 2**30
    del llm, outs
    _free()
    rows.append((f"{requests} requests x {prompt_len}/{output_len} tokens, output tok/s", f"{ours:.0f} tok/s",
                 f"HF bf16 generate bs128 ({hf_new_tokens} new) {hf:.0f} tok/s", f"{ours / hf:.2f}",
                 f"{peak:.1f} GiB (HF {hf_peak:.1f})"))


def check_smollm2(model_dir: str, expected: dict, rows: list) -> None:
    """Greedy GPU tokens vs the CPU reference's (``expected``: {"prompts": [...], "tokens": [[...]]}).

    At a divergence, reports the gap between the GPU's two best log-probabilities at that step: a gap within
    bf16 rounding (< 0.05 nats) is a tie the two paths may break differently.
    """
    llm = LLM(model_dir, device="cuda", max_num_seqs=8, gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    outs = llm.generate(expected["prompts"], params)
    same, notes = 0, []
    for i, (out, ref) in enumerate(zip(outs, expected["tokens"])):
        got = out.outputs[0].token_ids
        if got == ref:
            same += 1
            continue
        step = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
        top = sorted(out.outputs[0].logprobs[step].values(), reverse=True)[:2]
        notes.append(f"prompt {i} diverges at token {step}, top-2 gap {top[0] - top[1]:.4f} nats")
    del llm, outs
    _free()
    rows.append(("SmolLM2 AWQ greedy, GPU vs CPU reference (8 x 32 tokens)", f"{same}/8 identical", "; ".join(notes)
                 or "no divergence", f"{same / 8:.2f}", ""))

"""The CPU path's step times, in process (no server):

    python bench/cpu_steps.py [MODEL] [--dtype bfloat16] [--prompt-lens 1024,2000] [--batches 1,8] [--reps 2]

MODEL defaults to the converted demo model (SmolLM2-135M-Instruct). Prefill: one prompt of each length computed in
one step (the step budget raised to the longest), best of ``--reps``; decode: the median step of BATCH sequences
with 64-token prompts generating 40 tokens each, best of ``--reps``. Prefix caching is off, so every prompt is
computed in full. Prints one line per figure, in ms. Set ``OMP_NUM_THREADS`` to the cores to use; on a shared VM
run it more than once (bench/RESULTS.md: the same code lands in a fast or a slow mode from process to process).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

from engine import LLM, SamplingParams  # noqa: E402


def prefill_ms(engine, n: int, name: str) -> float:
    """Wall time of the step that computes a fresh ``n``-token prompt (and samples its first token)."""
    engine.add_request(name, [(i * 7919) % 40000 + 100 for i in range(n)], SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    engine.step()
    took = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return took * 1e3


def decode_ms(engine, batch: int, name: str) -> float:
    """Median wall time of the decode steps of ``batch`` sequences (64-token prompts, 40 tokens each)."""
    for j in range(batch):
        engine.add_request(f"{name}-{j}", [(i * 31 + j) % 40000 + 100 for i in range(64)],
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # the prefills
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-lens", default="1024,2000")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    if args.model is None:
        from appliance.demo_model import demo_model_dir
        args.model = str(demo_model_dir())
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_model_len=max(lengths) + 64,
              max_num_seqs=max(batches), enable_prefix_caching=False, max_num_batched_tokens=max(lengths) + 64)
    engine = llm.engine
    prefill_ms(engine, 256, "warm-up")  # first-call costs (allocations, kernel choices) outside the timed steps
    for n in lengths:
        best = min(prefill_ms(engine, n, f"p{n}-{r}") for r in range(args.reps))
        print(f"prefill step, one {n}-token prompt ({args.dtype}): {best:.0f} ms")
    for b in batches:
        best = min(decode_ms(engine, b, f"d{b}-{r}") for r in range(args.reps))
        print(f"decode step, {b} sequence(s), 64-104 tokens of context ({args.dtype}): {best:.1f} ms")


if __name__ == "__main__":
    main()

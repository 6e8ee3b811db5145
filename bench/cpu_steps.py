"""The CPU path's step times, in process (no server):

    python bench/cpu_steps.py [MODEL] [--dtype bfloat16] [--prompt-lens 1024,2000] [--batches 1,8] [--reps 2]

MODEL defaults to the converted demo model (SmolLM2-135M-Instruct). Prefill: one prompt of each length computed in
one step (the step budget raised to the longest), best of ``--reps``; decode: the mean of 32 steps of BATCH
sequences with 64-token prompts (after their prefills and 3 decode steps), best of ``--reps``; the timing helpers
are ``bench/engine_bench.py``'s. Prefix caching is off, so every prompt is computed in full. Prints one line per
figure, in ms. Set ``OMP_NUM_THREADS`` to the cores to use; on a shared VM
run it more than once (bench/RESULTS.md: the same code lands in a fast or a slow mode from process to process).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

from bench.engine_bench import _batch_decode_tok_s, _prefill_step  # noqa: E402
from engine import LLM  # noqa: E402


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
    _prefill_step(llm, 256, "warm-up", "cpu")  # first-call costs (allocations, kernel choices) outside the timings
    for n in lengths:
        best = min(_prefill_step(llm, n, f"p{n}-{r}", "cpu") for r in range(args.reps)) / 1e3
        print(f"prefill step, one {n}-token prompt ({args.dtype}): {best:.0f} ms")
    for b in batches:
        best = min(b / _batch_decode_tok_s(llm, b, 64, 32, device="cpu") for _ in range(args.reps)) * 1e3
        print(f"decode step, {b} sequence(s), 68-100 tokens of context ({args.dtype}): {best:.1f} ms")


if __name__ == "__main__":
    main()

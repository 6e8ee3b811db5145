"""Peak memory of one sampling step, in [S, V] float32 buffers beyond the logits (the figure behind
``engine.memory.SAMPLER_BUFFERS``, which counts the logits too). The CPU path runs the same torch ops as the
GPU's (the penalties there: the torch reference, two [S, V] buffers, where the GPU's kernel takes one int32
scratch); the peak is the process's maximum resident size (``ru_maxrss``) after the step less before, each
configuration in a fresh process, large allocations from mmap so that freed ones leave the heap.

    python bench/sampler_memory.py [ROWS] [VOCAB]   # default 64 x 152064 (Qwen2.5's vocabulary)
"""
from __future__ import annotations

import os
import subprocess
import sys

CONFIGS = {"temperature alone": dict(temperature=0.7),
           "temperature, top-k/p, min-p, penalties, logprobs 5": dict(
               temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.05, frequency_penalty=0.3,
               logprobs=5)}


def one(rows: int, vocab: int, name: str) -> float:
    """[S, V] float32 buffers the step added to the peak (run in this process: call it in a fresh one)."""
    import gc
    import resource

    import torch

    from engine.sampler import sample_tokens, step_logprobs
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

    torch.set_num_threads(1)
    logits = torch.randn(rows, vocab)
    seqs = [Sequence("r", i, list(range(100)), SamplingParams(**CONFIGS[name])) for i in range(rows)]
    for s in seqs:
        s.token_ids += list(range(50))
    sample_tokens(logits[:1], seqs[:1], set())  # imports and one-off allocations before the baseline
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step_logprobs(logits, sample_tokens(logits, seqs, set()), seqs)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) * 1024 / (rows * vocab * 4)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 152064
    if len(sys.argv) > 3:  # the child
        print(f"{one(rows, vocab, sys.argv[3]):.2f}")
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for name in CONFIGS:
        out = subprocess.run([sys.executable, __file__, str(rows), str(vocab), name], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        print(f"{rows} x {vocab}, {name}: {out} [S, V] float32 buffers beyond the logits")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()

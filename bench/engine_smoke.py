"""Quick GPU smoke test of the engine's CUDA path on a small random AWQ model: eager, CUDA graphs and the torch
reference kernels must agree; then the engine-level benchmarks (``bench/engine_bench.py``) when asked.

Usage on the GPU machine: ``python bench/engine_smoke.py [--bench]``.
"""
from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.random_model import write_random_awq_model  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def tokens(model_dir, **kw):
    llm = LLM(model_dir, device="cuda", gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=16, **kw)
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 16, 17, 40, 100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def main():
    small = write_random_awq_model("/tmp/rand_small", hidden_size=1024, intermediate_size=2816,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                   vocab_size=4096, max_position_embeddings=2048)
    t = time.time()
    graphs = tokens(str(small))
    eager = tokens(str(small), enforce_eager=True)
    os.environ["APPLIANCE_KERNELS"] = "torch"
    ref = tokens(str(small), enforce_eager=True)
    del os.environ["APPLIANCE_KERNELS"]
    print(f"small model: graphs==eager {graphs == eager}; triton==torch-ref "
          f"{sum(a == b for a, b in zip(graphs, ref))}/{len(ref)} sequences ({time.time() - t:.1f}s)")
    for a, b in zip(graphs, ref):
        if a != b:
            print("  diverge at", next(i for i, (x, y) in enumerate(zip(a, b)) if x != y), a[:8], b[:8])
    if "--bench" in sys.argv:
        from bench.engine_bench import bench_decode_bs1
        big = write_random_awq_model("/tmp/rand_7b")
        src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
        bw = 2 * 20 * 2**30 / (time.perf_counter() - t0)
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        llm = LLM(str(big), device="cuda", max_num_seqs=1, max_model_len=1024, gpu_memory_utilization=0.3)
        g = llm.engine.runner.graphs
        g.context_lens[:1] = 100
        for _ in range(5):
            g.graphs[1].replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            g.graphs[1].replay()
        torch.cuda.synchronize()
        print(f"bs1 graph replay alone: {(time.perf_counter() - t0) * 10:.3f} ms/step")
        head = llm.engine.runner.model.lm_head
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            head(x)
        torch.cuda.synchronize()
        print(f"lm_head: {(time.perf_counter() - t0) * 10:.3f} ms")
        from torch.profiler import profile, ProfilerActivity
        eng = llm.engine
        eng.add_request("p", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        eng.step()
        for _ in range(5):
            eng.step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        eng.abort_request("p")
        del llm, g, eng, prof
        gc.collect()
        torch.cuda.empty_cache()
        rows = []
        bench_decode_bs1(str(big), bw, rows)
        from bench.engine_bench import bench_throughput
        bench_throughput(str(big), rows)
        for r in rows:
            print(" | ".join(map(str, r)))


if __name__ == "__main__":
    main()

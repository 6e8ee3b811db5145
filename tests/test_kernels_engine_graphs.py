"""On a GPU (``KERNEL_TEST_DEVICE=cuda``, as bench/gpu_suite.py runs the kernel tests): the CUDA graphs of a small
random AWQ model (with prefill graphs off and on: ``APPLIANCE_PREFILL_GRAPHS`` 0 / 1) give the eager engine's greedy
tokens when batches of different sizes follow each other.

The regression this guards: the split-K GEMV's arrival counters (``w4a16._locks``) were allocated inside the first
decode-graph capture that needed them, from the graphs' shared pool (a block a larger bucket's graph may write on
replay) and zeroed only when that one graph replayed; small batches after large ones could then add the wrong
partial sums. Skipped on CPU (no graphs there).
"""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("KERNEL_TEST_DEVICE", "cpu") != "cuda",
                                reason="CUDA graphs: GPU only")


def _tokens(model_dir: str, plans_dir: str, batches: list, **kw) -> list:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, device="cuda", max_num_seqs=32, max_model_len=256, gpu_memory_utilization=0.2,
              tune_kernels=False, kernel_plans_dir=plans_dir, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = [[o.outputs[0].token_ids for o in llm.generate(batch, params)] for batch in batches]
    del llm
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("prefill_graphs", ["0", "1"])
def test_small_batches_after_large_ones_replay_the_eager_tokens(tmp_path, monkeypatch, prefill_graphs):
    """Batches of 3 prompts (111 tokens: a 128-token prefill graph of 16 sequences), 32 (1,184 tokens: eager), 3,
    20 (740 tokens: eager), 24 short ones (192 tokens: a 256-token graph of 32 sequences, the larger class capped by
    max_num_seqs), 1 (37 tokens: 64), with prefill graphs off and on."""
    from bench.random_model import write_random_awq_model

    monkeypatch.setenv("APPLIANCE_PREFILL_GRAPHS", prefill_graphs)
    model = str(write_random_awq_model(tmp_path / "model", hidden_size=1024, intermediate_size=2816,
                                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                       vocab_size=4096, max_position_embeddings=512))
    big = [list(range(3 + i, 40 + i)) for i in range(32)]
    short = [b[:8] for b in big[:24]]
    batches = [big[:3], big, big[:3], big[:20], short, big[:1]]  # buckets of 1-16 rows (split-K GEMVs) after 17-32
    graphs = _tokens(model, str(tmp_path / "plans"), batches)
    eager = _tokens(model, str(tmp_path / "plans"), batches, enforce_eager=True)
    assert [len(b) for b in graphs] == [3, 32, 3, 20, 24, 1]
    assert graphs == eager

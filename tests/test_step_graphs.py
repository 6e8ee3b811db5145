"""The CUDA graphs' inputs (``engine.cuda_graphs.StepGraphs``) checked on the CPU path, where nothing is captured:
uncaptured, a replay runs the same forward pass over the graphs' padded buffers (padding tokens, absent
sequences, pending tokens read from ``last_tokens``, block-table rows left from earlier steps). The CPU path is
batch invariant, so every request must get exactly the tokens, text and logprobs of the engine without graphs.
On a GPU, bench/gpu_suite.py's CUDA-path rows compare captured graphs against the eager engine."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.cuda_graphs import PREFILL_SEQ_CLASSES, PREFILL_TOKEN_BUCKETS, StepGraphs, prefill_buckets
from kernels import w4a16
from test_async_scheduling import SMALL, expected, mixed_params, run, texts  # noqa: F401 - fixtures


def with_uncaptured_graphs(llm: LLM, buckets=None, classes=None) -> dict:
    """Give ``llm``'s runner its uncaptured graphs (prefill token ``buckets`` and sequence ``classes``
    overridden where given); returns the count of each kind of step: through a decode graph, a prefill graph,
    eagerly, and of prefill-graph steps with a pending token ("pending"), and the set of sequence classes the
    prefill-graph steps took ("classes")."""
    runner = llm.engine.runner
    counts = {"decode": 0, "prefill": 0, "eager": 0, "pending": 0, "classes": set()}
    graphs = runner.step_graphs(llm.engine.max_model_len, capture=False, prefill=True)
    graphs.prefill_buckets = buckets or graphs.prefill_buckets
    graphs.prefill_classes = classes or graphs.prefill_classes
    assert graphs.prefill_classes[-1] <= graphs.block_tables.shape[0]  # the buffers hold the largest class
    for owner, name, kind in ((graphs, "replay", "decode"), (graphs, "replay_prefill", "prefill"),
                              (runner, "prepare_prefill", "eager"), (runner, "prepare_decode", "eager")):
        method = getattr(owner, name)

        def counted(*args, method=method, kind=kind):
            counts[kind] += 1
            counts["pending"] += kind == "prefill" and max(args[1]) >= 0  # args[1]: prev_rows
            key = kind == "prefill" and graphs.prefill_bucket_for(len(args[0]), len(args[4]) - 1)  # ids, cu_seqlens
            if key:
                counts["classes"].add(key[1])
            return method(*args)
        setattr(owner, name, counted)
    runner.graphs = graphs
    return counts


@pytest.fixture(scope="module")
def runner(demo_model):
    """A model runner of the demo model, for graphs built by hand (:func:`_graphs`)."""
    return LLM(str(demo_model), **SMALL).engine.runner


def _graphs(runner, max_num_seqs: int, token_budget: int = 2048) -> StepGraphs:
    """Uncaptured graphs of ``runner``'s model for an engine of ``max_num_seqs`` and ``token_budget``."""
    return StepGraphs(runner.model, max_num_seqs, token_budget, 8, runner.model.config["hidden_size"], runner.dtype,
                      runner.device, torch.zeros(max_num_seqs, dtype=torch.int64), capture=False)


@pytest.mark.parametrize("extra, buckets, classes, eager, pending, preempted, used", [
    # the 9 sequences' prompts (1 to 38 tokens each, 118 in all) in one 128-token graph, then decode graphs
    ({}, None, None, False, False, False, {16}),
    # mixed steps of 20 tokens at most: chunks, decode rows, pending tokens read from last_tokens
    ({"async_scheduling": True, "max_num_batched_tokens": 20}, None, None, False, True, False, {16}),
    # the same steps (of 3, 5 and 6 sequences) through graphs of 4 and of 9 sequences (absent sequences in both)
    ({"async_scheduling": True, "max_num_batched_tokens": 20}, None, (4, 9), False, True, False, {4, 9}),
    # preemption by recompute (single prompts of up to 64 tokens: graphs); the first step (9 sequences > 4) eager
    ({"async_scheduling": True, "num_kv_blocks": 10}, (1, 8, 16, 64), (4,), True, True, True, {4}),
], ids=["roomy", "async-chunked", "async-chunked-two-classes", "async-recompute-eager-fallback"])
def test_graph_buffers_give_the_tokens_of_the_engine_without_graphs(demo_model, texts, expected, extra, buckets,
                                                                    classes, eager, pending, preempted, used):
    llm = LLM(str(demo_model), **SMALL, **extra)
    counts = with_uncaptured_graphs(llm, buckets, classes)
    got, _ = run(llm, texts, mixed_params())
    assert got == expected
    assert counts["decode"] > 10 and counts["prefill"] >= 1 and (counts["eager"] > 0) == eager
    assert (counts["pending"] > 0) == pending and (llm.engine.scheduler.num_preemptions > 0) == preempted
    assert counts["classes"] == used


def test_a_padded_prefill_writes_the_eager_kv_and_hidden_rows(demo_model):
    """Two sequences' 5 new tokens (one with 3 cached tokens before them) through the 8-token graph, after a
    3-sequence 8-token step left its values in every buffer: the same KV cache and hidden rows as the eager step;
    the 3 padding tokens write nothing."""
    llm = LLM(str(demo_model), **SMALL)
    runner = llm.engine.runner
    with_uncaptured_graphs(llm)
    runner.graphs.replay_prefill([5] * 8, [-1] * 8, list(range(8)), list(range(80, 88)), [0, 2, 5, 8], [2, 3, 3],
                                 [[10, 11, 12], [13], [14, 15]])
    tables = [[3, 5], [7]]
    ids, positions, slots = [11, 12, 13, 14, 15], [3, 4, 5, 0, 1], [27, 28, 29, 56, 57]
    cu, context_lens = [0, 3, 5], [6, 2]
    for kv in runner.kv_caches:
        kv.normal_()
    before = [kv.clone() for kv in runner.kv_caches]
    hidden = runner.graphs.replay_prefill(ids, [-1] * 5, positions, slots, cu, context_lens, tables).clone()
    graph_kv = [kv.clone() for kv in runner.kv_caches]
    for kv, old in zip(runner.kv_caches, before):
        kv.copy_(old)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor(slots),
                             block_tables=torch.tensor(tables[:1] + [[7, -1]], dtype=torch.int32),
                             context_lens=torch.tensor(context_lens, dtype=torch.int32),
                             cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    with torch.inference_mode():
        eager = runner.model(torch.tensor(ids), torch.tensor(positions), meta)
    assert hidden.shape == eager.shape and torch.equal(hidden, eager)
    assert all(torch.equal(a, b) for a, b in zip(graph_kv, runner.kv_caches))
    changed = sum(int((a != b).any(dim=-1).any(dim=-1).sum()) for a, b in zip(graph_kv, before))
    assert changed == 5 * 2 * len(before)  # K and V of the 5 real tokens in every layer, no padding slot


def test_prefill_buckets_stop_at_the_first_that_holds_the_step_budget():
    assert prefill_buckets(2048) == PREFILL_TOKEN_BUCKETS == w4a16.M_BUCKETS == (1, 8, 16, 64, 128, 256)
    assert prefill_buckets(256) == PREFILL_TOKEN_BUCKETS
    assert prefill_buckets(20) == (1, 8, 16, 64) and prefill_buckets(16) == (1, 8, 16) and prefill_buckets(1) == (1,)


def test_the_larger_sequence_class_has_graphs_only_for_steps_it_can_take(runner):
    """With ``max_num_seqs`` 64: prefill graphs of 16 sequences for every token bucket, of 64 only for buckets
    above 16 tokens (a step of 17 or more sequences has at least 17 tokens); a step takes the smallest class
    that holds its sequences."""
    graphs = _graphs(runner, 64)
    assert PREFILL_SEQ_CLASSES == (16, 64) and graphs.prefill_classes == (16, 64)
    assert [k for k in graphs.keys() if k[0] == "prefill"] == [
        ("prefill", 256, 64), ("prefill", 256, 16), ("prefill", 128, 64), ("prefill", 128, 16), ("prefill", 64, 64),
        ("prefill", 64, 16), ("prefill", 16, 16), ("prefill", 8, 16), ("prefill", 1, 16)]
    assert graphs.prefill_bucket_for(20, 16) == (64, 16) and graphs.prefill_bucket_for(20, 17) == (64, 64)
    assert graphs.prefill_bucket_for(256, 64) == (256, 64) and graphs.prefill_bucket_for(65, 65) is None


def test_a_step_of_the_larger_class_pads_every_row_of_it(runner):
    """A 20-sequence step after a 40-sequence one, both in graphs of 64: rows 20-63 of cu_seqlens hold the step's
    token count (no new tokens) and of context_lens 0, none of the earlier step's values (the prefill attention's
    binary search over cu_seqlens needs them in order)."""
    graphs = _graphs(runner, 64)
    graphs.replay_prefill([5] * 40, [-1] * 40, [0] * 40, [-1] * 40, list(range(41)), [1] * 40, [[0]] * 40)
    graphs.replay_prefill([5] * 20, [-1] * 20, [0] * 20, [-1] * 20, list(range(21)), [1] * 20, [[0]] * 20)
    assert graphs.cu_seqlens[:65].tolist() == list(range(21)) + [20] * 44
    assert graphs.context_lens[:64].tolist() == [1] * 20 + [0] * 44


@pytest.mark.parametrize("max_num_seqs, token_budget", [(1, 1), (4, 20), (15, 15), (16, 2048), (17, 17),
                                                        (20, 100), (32, 256), (64, 64), (100, 2048)])
def test_every_step_a_graph_holds_has_its_graph_captured(runner, max_num_seqs, token_budget):
    """For every step of ``seqs`` <= ``tokens`` (each sequence has a new token) within the budget: where
    ``prefill_bucket_for`` gives a key, ``keys()`` has it; and every prefill key of ``keys()`` is some step's."""
    graphs = _graphs(runner, max_num_seqs, token_budget)
    captured = {k for k in graphs.keys() if k[0] == "prefill"}
    taken = set()
    for tokens in range(1, token_budget + 1):
        for seqs in range(1, min(tokens, max_num_seqs) + 1):
            key = graphs.prefill_bucket_for(tokens, seqs)
            if key is not None:
                assert ("prefill", *key) in captured, (tokens, seqs, key)
                taken.add(("prefill", *key))
            elif tokens <= graphs.prefill_buckets[-1] and seqs <= graphs.prefill_classes[-1]:
                raise AssertionError(f"no graph for {tokens} tokens of {seqs} sequences")
    assert taken == captured


def test_a_step_past_the_buckets_or_the_sequences_has_no_prefill_graph(demo_model):
    llm = LLM(str(demo_model), **SMALL)
    with_uncaptured_graphs(llm)
    graphs = llm.engine.runner.graphs
    assert graphs.prefill_classes == (16,) and SMALL["max_num_seqs"] == 16
    assert graphs.prefill_bucket_for(5, 2) == (8, 16) and graphs.prefill_bucket_for(65, 1) == (128, 16)
    assert graphs.prefill_bucket_for(256, 16) == (256, 16)
    assert graphs.prefill_bucket_for(257, 1) is None
    assert graphs.prefill_bucket_for(20, 17) is None
    with pytest.raises(ValueError, match="no prefill graph for 257 tokens"):
        graphs.replay_prefill([1] * 257, [-1] * 257, list(range(257)), [-1] * 257, [0, 257], [257], [[0]])


def test_prompt_logprobs_from_graph_rows_equal_the_engine_without_graphs(demo_model, texts):
    """Prompt logprobs read the hidden rows a prefill graph returns (prompts of 18, 37 and 38 tokens in chunks of
    at most 20 tokens, two prompts sharing a step): every prompt token's entries equal those of the engine without
    graphs."""
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    prompts = [texts[2], texts[6], texts[7]]
    plain = LLM(str(demo_model), **SMALL, max_num_batched_tokens=20).generate(prompts, params)
    llm = LLM(str(demo_model), **SMALL, max_num_batched_tokens=20)
    counts = with_uncaptured_graphs(llm)
    graphed = llm.generate(prompts, params)
    assert counts["prefill"] >= 5 and counts["eager"] == 0
    assert [o.prompt_logprobs for o in graphed] == [o.prompt_logprobs for o in plain]
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in plain]
    assert all(len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in graphed)


def test_prefill_graphs_unless_turned_off(demo_model, monkeypatch):
    """On by default; ``APPLIANCE_PREFILL_GRAPHS`` 0 / false / off (any case) turns them off."""
    llm = LLM(str(demo_model), **SMALL)
    runner = llm.engine.runner
    monkeypatch.delenv("APPLIANCE_PREFILL_GRAPHS", raising=False)
    assert runner.step_graphs(llm.engine.max_model_len, capture=False).prefill_buckets == PREFILL_TOKEN_BUCKETS
    for off in ("0", "false", "Off"):
        monkeypatch.setenv("APPLIANCE_PREFILL_GRAPHS", off)
        graphs = runner.step_graphs(llm.engine.max_model_len, capture=False)
        assert graphs.prefill_buckets == () and graphs.prefill_bucket_for(5, 1) is None


def test_a_step_samples_in_inference_mode(demo_model, monkeypatch):
    """``launch`` runs the forward pass and the sampling under ``torch.inference_mode`` (no autograd records)."""
    from engine import model_runner

    seen, sample = [], model_runner.sample_tokens

    def recording(*args, **kwargs):
        seen.append(torch.is_inference_mode_enabled())
        return sample(*args, **kwargs)
    monkeypatch.setattr(model_runner, "sample_tokens", recording)
    llm = LLM(str(demo_model), **SMALL)
    with_uncaptured_graphs(llm)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))
    assert seen == [True] * 3

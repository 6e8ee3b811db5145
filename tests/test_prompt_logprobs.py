"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``) on the demo model, CPU reference path: each prompt
token's entry equals the logprob the engine gives that token when it generates it, whatever the chunking, the
prefix cache, async scheduling or preemption; which hidden rows a prefill step takes them from."""
from __future__ import annotations

import pytest

from engine.prompt_logprobs import rows_to_launch
from engine_fixtures import as_floats
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BUDGET = 32  # tokens per step: prompts over it are prefilled in chunks
GENERATE = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
SCORE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=3)


def _close(got: list, want: list) -> bool:
    """Entries ({token_id: Logprob}) equal in tokens and within 1e-5 in logprob (None where None)."""
    got, want = as_floats(got), as_floats(want)
    return len(got) == len(want) and all(
        (a is None and b is None) or (a is not None and b is not None and a.keys() == b.keys()
                                      and a == pytest.approx(b, abs=1e-5)) for a, b in zip(got, want))


def _llm(demo_model, **kw):
    from engine import LLM
    return LLM(str(demo_model), device="cpu", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=BUDGET,
               **kw)


@pytest.fixture(scope="module")
def llm(demo_model):
    return _llm(demo_model)


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    from engine_fixtures import RAW_PROMPTS
    ids = llm.get_tokenizer().encode(" ".join(RAW_PROMPTS * 2), add_special_tokens=False)
    assert len(ids) > 2 * BUDGET
    return ids[:70]


@pytest.fixture(scope="module")
def generated(llm, prompt):
    """(prompt + the 6 greedy tokens, their logprobs entries) generated from ``prompt``."""
    out = llm.generate([prompt], GENERATE)[0].outputs[0]
    return prompt + out.token_ids, out.logprobs


def test_prompt_logprobs_equal_the_logprobs_of_generating_those_tokens(llm, prompt, generated):
    ids, entries = generated
    out = llm.generate([ids], SCORE)[0]
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        assert next(iter(got[t])) == ids[t] and len(got[t]) in (3, 4), t  # the prompt token, and the top 3
        values = [lp.logprob for lp in got[t].values()][1:]
        assert values == sorted(values, reverse=True)
    for j, entry in enumerate(entries):  # the same positions, computed by decode steps then
        scored = got[len(prompt) + j]
        assert scored.keys() == entry.keys()
        assert as_floats([scored])[0] == pytest.approx(as_floats([entry])[0], abs=1e-4), j
        assert [lp.rank for lp in scored.values()] == [lp.rank for lp in entry.values()], j
    assert out.outputs[0].logprobs is None  # not asked for the generated token


def test_prompt_token_ranks_are_their_places_in_the_sorted_distribution(llm, prompt, generated, monkeypatch):
    """Each prompt token's rank (vLLM's ``Logprob.rank``) is its place in its position's logits sorted
    descending, from 1: 1 for the greedy tokens, its place among the top k when there, else beyond k."""
    import torch

    from engine import prompt_logprobs as module
    ids, _ = generated
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = module.logprobs_of

    def watched(logits, tokens, rows, k, ranks=False):
        seen.append((logits.clone(), tokens.clone()))
        return real(logits, tokens, rows, k, ranks)

    monkeypatch.setattr(module, "logprobs_of", watched)
    out = llm.generate([ids], SCORE)[0]
    logits = torch.cat([lg for lg, _ in seen])
    targets = torch.cat([t for _, t in seen])
    assert targets.tolist() == ids[1:]  # one row per prompt token after the first, in order (3 chunks here)
    order = torch.argsort(logits, dim=-1, descending=True, stable=True)
    places = ((order == targets[:, None]).nonzero()[:, 1] + 1).tolist()
    ranks = out.prompt_logprob_ranks
    assert ranks[0] is None and ranks[1:] == places
    assert all(r == 1 for r in ranks[len(prompt):])  # the greedy continuation
    assert any(r > 3 for r in ranks[1:]) and any(r == 1 for r in ranks[1:len(prompt)])
    for t in range(1, len(ids)):
        entry = out.prompt_logprobs[t]
        top = sorted(entry, key=lambda tok: -entry[tok].logprob)[:3]
        assert (ids[t] in top) == (ranks[t] <= 3) and (ranks[t] > 3 or top.index(ids[t]) == ranks[t] - 1), t
        assert entry[ids[t]].rank == ranks[t]  # vLLM's Logprob.rank


def test_ranks_over_several_row_slices_count_ties_ahead():
    """``logprobs_of``'s ranks, counted ``RANK_ROWS`` rows at a time: the count of tokens at least as likely as
    the row's token (a tie counts ahead, as vLLM counts), across slice boundaries."""
    import torch

    from engine.sampler import RANK_ROWS, logprobs_of
    gen = torch.Generator().manual_seed(0)
    rows = 2 * RANK_ROWS + 5
    logits = torch.randint(0, 6, (rows, 40), generator=gen).float()  # many ties
    tokens = torch.randint(0, 40, (rows,), generator=gen)
    got = logprobs_of(logits, tokens, list(range(rows)), [2] * rows, ranks=True).ranks.tolist()
    want = [int((logits[i] >= logits[i, tokens[i]]).sum()) for i in range(rows)]
    assert got == want and len(set(got)) > 5


def test_chunking_the_prefix_cache_and_async_scheduling_change_nothing(demo_model, llm, generated):
    ids, _ = generated
    first = llm.generate([ids], SCORE)[0].prompt_logprobs
    stats = llm.engine.get_stats()
    again = llm.generate([ids], SCORE)[0]  # its blocks are cached now: a request without prompt logprobs would hit
    assert again.prompt_logprobs == first
    assert llm.engine.get_stats().prefix_cache_hits_total == stats.prefix_cache_hits_total  # no hit taken
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.prompt_logprobs is None and llm.engine.get_stats().prefix_cache_hits_total > \
        stats.prefix_cache_hits_total
    sched = llm.engine.scheduler
    sched.enable_chunked_prefill, sched.max_num_batched_tokens = False, 4096
    try:
        whole = llm.generate([ids], SCORE)[0].prompt_logprobs
    finally:
        sched.enable_chunked_prefill, sched.max_num_batched_tokens = True, BUDGET
    assert _close(whole, first)
    overlapped = _llm(demo_model, async_scheduling=True).generate([ids], SCORE)[0].prompt_logprobs
    assert overlapped == first


def test_zero_top_logprobs_and_several_choices(llm, generated):
    ids, _ = generated
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=2, n=2, prompt_logprobs=0)
    out = llm.generate([ids[:20]], params)[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == 20
    assert all(list(e) == [ids[t]] for t, e in enumerate(out.prompt_logprobs) if t)  # the prompt token alone


def test_preemption_by_recompute_changes_no_entry(demo_model, llm, prompt, monkeypatch):
    """On a pool too small for the five requests, preempted ones are prefilled again (prompt + output): each
    prompt token's entry is still launched once, and the entries equal those of a roomy run."""
    from engine import LLM, model_runner
    texts = [prompt[i:i + 40] for i in range(0, 30, 6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    want = [o.prompt_logprobs for o in llm.generate(texts, params)]
    tight = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=64, block_size=8, num_kv_blocks=12)
    launched: dict[int, list[int]] = {}
    real = model_runner.launch_prompt_logprobs

    def counted(model, hidden, plan):
        for seq, first, count, _ in plan:
            launched.setdefault(seq.seq_id, []).extend(range(first, first + count))
        return real(model, hidden, plan)

    monkeypatch.setattr(model_runner, "launch_prompt_logprobs", counted)
    got = [o.prompt_logprobs for o in tight.generate(texts, params)]
    assert tight.engine.get_stats().num_preemptions_total > 0
    assert sorted(map(sorted, launched.values())) == [list(range(1, 40))] * 5  # each token once
    assert all(_close(g, w) for g, w in zip(got, want))


def test_rows_to_launch_takes_each_prompt_token_once():
    a = Sequence("a", 0, list(range(10)), SamplingParams(prompt_logprobs=1))
    b = Sequence("b", 0, list(range(5)), SamplingParams())
    c = Sequence("c", 0, list(range(6)), SamplingParams(prompt_logprobs=0))
    c.num_computed_tokens = 2  # its next chunk starts at position 2
    plan = rows_to_launch([b, a, c], [5, 4, 4])  # rows 0-4: b; 5-8: a's positions 0-3; 9-12: c's positions 2-5
    assert [(s.request_id, first, n, row) for s, first, n, row in plan] == [("a", 1, 4, 5), ("c", 3, 3, 9)]
    assert (a.num_prompt_logprobs, c.num_prompt_logprobs) == (5, 6)
    a.num_computed_tokens = 4
    assert [(first, n, row) for _, first, n, row in rows_to_launch([a], [6])] == [(5, 5, 0)]
    a.num_computed_tokens = 0  # recomputed from the start after a preemption: nothing to launch again
    a.token_ids.append(7)
    assert rows_to_launch([a], [11]) == [] and not a.wants_prompt_logprobs


def test_outputs_wait_for_the_prompt_entries_to_be_read_back(llm, prompt, monkeypatch):
    """With two choices, the second may sample before the first's prompt entries are read back (here: the first's
    read-back is held); its outputs wait (they are cumulative) and come with every entry."""
    from engine.prompt_logprobs import PromptChunk
    engine, held = llm.engine, []
    real_fill = PromptChunk.fill
    monkeypatch.setattr(PromptChunk, "fill", lambda chunk: held.append(chunk))
    engine.add_request("two", prompt[:20], SamplingParams(temperature=0, max_tokens=3, n=2, prompt_logprobs=1))
    early = engine.step()  # both choices prefilled and sampled; choice 0's entries not read back
    assert early == [] and held and not engine.requests["two"].seqs[0].prompt_logprobs_ready
    for chunk in held:
        real_fill(chunk)
    monkeypatch.undo()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert all(None not in o.prompt_logprobs[1:] for o in outs) and outs[-1].finished
    assert outs[0].outputs[0].token_ids and outs[0].outputs[1].token_ids


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)

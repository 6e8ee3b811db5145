"""The sampler's logits processing against vLLM's formulas, on a hand-made row of logits (exact values).

vLLM (``vllm/model_executor/layers/utils.py::apply_penalties``, ``Sampler._apply_min_tokens_penalty``): min_tokens
masks the stop tokens (stop_token_ids, plus the EOS unless ignore_eos) while fewer than min_tokens were generated;
the repetition penalty divides positive and multiplies non-positive logits of every token of the prompt or the
output; the frequency penalty subtracts ``penalty * count in the output``, the presence penalty ``penalty`` for a
token present in the output; temperature comes after the penalties.
"""
from __future__ import annotations

import pytest
import torch

from engine.sampler import apply_penalties, penalty_inputs, process_batch, process_logits, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

EOS = 7
#: Token 7 (the EOS) is the arg-max, then 3, then 0; token 5 sits at exactly 0.
LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.5, 4.0])
PROMPT = [0, 1]
OUTPUT = [3, 3, 1, 5]  # 3 twice, 1 (also in the prompt) and 5 once each
INF = float("-inf")


def seq_with(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", 0, list(prompt), SamplingParams(**params))
    seq.token_ids += output
    return seq


@pytest.mark.parametrize("params,expected", [
    # repetition 2: prompt-or-output tokens 0, 1, 3, 5: 2/2, -1*2, 3/2, 0*2
    ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.5, 1.5, -2.0, 0.0, 1.5, 4.0]),
    # repetition 0.5 rewards them instead: 2/0.5, -1*0.5, 3/0.5
    ({"repetition_penalty": 0.5}, [4.0, -0.5, 0.5, 6.0, -2.0, 0.0, 1.5, 4.0]),
    # frequency 0.5 x output counts (3: 2, 1: 1, 5: 1); the prompt does not count
    ({"frequency_penalty": 0.5}, [2.0, -1.5, 0.5, 2.0, -2.0, -0.5, 1.5, 4.0]),
    ({"frequency_penalty": -0.5}, [2.0, -0.5, 0.5, 4.0, -2.0, 0.5, 1.5, 4.0]),
    # presence 0.25 once per token present in the output
    ({"presence_penalty": 0.25}, [2.0, -1.25, 0.5, 2.75, -2.0, -0.25, 1.5, 4.0]),
    # all three: repetition first, then frequency and presence
    ({"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25},
     [1.0, -2.75, 0.5, 0.25, -2.0, -0.75, 1.5, 4.0]),
    ({}, LOGITS.tolist()),
], ids=["repetition", "repetition-reward", "frequency", "frequency-reward", "presence", "all-three", "none"])
def test_penalties_match_vllm_formulas_exactly(params, expected):
    out = apply_penalties(LOGITS[None].clone(), [seq_with(PROMPT, OUTPUT, **params)])
    assert out.tolist() == [expected]


@pytest.mark.parametrize("params", [{"repetition_penalty": 2.0}, {"frequency_penalty": 0.5},
                                    {"presence_penalty": 0.25},
                                    {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.25}],
                         ids=["repetition", "frequency", "presence", "all-three"])
def test_a_pending_token_counts_like_one_read_back(params):
    """Async scheduling: a sequence's last output token may still be on the device (``pending``). The penalties
    count it as if it were in ``token_ids``: an output ending in token 6 (logit 1.5, not in the prompt) with the 6
    pending gives the same row as with the 6 read back, and a row without one (-1) is unchanged by the others'
    pending tokens."""
    output = [3, 3, 1, 6]
    full = seq_with(PROMPT, output, **params)
    short = seq_with(PROMPT, output[:-1], **params)
    short.num_pending_tokens = 1
    rows = torch.stack([LOGITS, LOGITS])
    got = apply_penalties(rows.clone(), [short, full], pending=torch.tensor([6, -1]))
    want = apply_penalties(LOGITS[None].clone(), [full])[0]
    assert got[0].tolist() == want.tolist() and got[1].tolist() == want.tolist()
    assert want[6].item() != LOGITS[6].item()  # the 6 was penalised ...
    assert apply_penalties(LOGITS[None].clone(), [short])[0, 6].item() == LOGITS[6].item()  # ... only as output


def test_penalties_on_some_rows_of_a_batch_with_pending_tokens():
    """Only the penalised rows change, each as it would alone; ``pending`` indexes all rows of the batch."""
    torch.manual_seed(0)
    logits = torch.randn(4, 16) * 3
    seqs = [seq_with([1, 2], [4], temperature=0),
            seq_with([1, 2], [4, 9], temperature=0, frequency_penalty=0.7),
            seq_with([3], [5, 5], temperature=0.8, repetition_penalty=1.5),
            seq_with([1, 2], [6], temperature=0, presence_penalty=-0.5)]
    pending = torch.tensor([11, 12, 13, -1])  # row 2's 13 only repetition-penalised, as output
    for i in (0, 1, 2):
        seqs[i].num_pending_tokens = 1
    batch = process_batch(logits, seqs, {EOS}, pending)
    for i, seq in enumerate(seqs):
        alone = seq_with(seq.prompt_token_ids, seq.output_token_ids + ([pending[i].item()] if pending[i] >= 0 else []),
                         **{k: getattr(seq.params, k) for k in ("temperature", "frequency_penalty",
                                                                "repetition_penalty", "presence_penalty")})
        assert batch[i].tolist() == process_logits(logits[i], alone, {EOS}).tolist(), i
    assert batch[0].tolist() == logits[0].tolist()  # not penalised: its pending token changes nothing
    assert batch[1, 12].item() == (logits[1, 12] - torch.tensor(0.7)).item()  # the pending token, counted once
    assert batch[2, 13].item() != process_logits(logits[2], seqs[2], {EOS})[13].item()  # 13 seen only pending


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_penalty_inputs_layout_and_alignment(count):
    """The kernel's inputs (kernels/penalties.py): each part starts 16 bytes into the one copy (Triton compiles one
    variant per alignment), prompts only for rows with a repetition penalty, outputs after them."""
    seqs = [seq_with([10 + i, 20 + i], [30 + i] * i, repetition_penalty=1.5 if i % 2 else 1.0,
                     frequency_penalty=0.25 * i) for i in range(count + 1)]
    rows = list(range(1, count + 1))
    got_rows, offsets, ids, params = penalty_inputs(seqs, rows, torch.device("cpu"))
    assert all(t.data_ptr() % 16 == 0 for t in (got_rows, offsets, ids, params))
    assert got_rows.tolist() == rows
    expect, bounds = [], [0]
    for i in rows:
        expect += ([10 + i, 20 + i] if i % 2 else [])
        bounds.append(len(expect))
        expect += [30 + i] * i
        bounds.append(len(expect))
    assert ids.tolist() == expect and offsets.tolist() == bounds
    assert params.tolist() == [[1.5 if i % 2 else 1.0 for i in rows], [0.25 * i for i in rows], [0.0] * count]


def test_penalties_come_before_temperature():
    """(logit - presence) / T, not logit / T - presence: token 7 (present) gives (4 - 1) / 0.5 = 6, not 7."""
    seq = seq_with(PROMPT, [EOS], presence_penalty=1.0, temperature=0.5, ignore_eos=True)
    assert process_logits(LOGITS, seq, {EOS}).tolist() == [4.0, -2.0, 1.0, 6.0, -4.0, 0.0, 3.0, 6.0]


@pytest.mark.parametrize("num_output,ignore_eos,masked,token", [
    (0, False, [3, EOS], 0), (2, False, [3, EOS], 0),  # below min_tokens: EOS and stop id 3 can't be drawn
    (3, False, [], EOS),  # min_tokens reached: nothing masked
    (0, True, [3], EOS),  # ignore_eos: the EOS is no stop token, so only stop_token_ids are masked
])
def test_min_tokens_masks_stop_tokens_until_reached(num_output, ignore_eos, masked, token):
    seq = seq_with(PROMPT, [2] * num_output, min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos,
                   temperature=0, max_tokens=8)
    expected = [INF if i in masked else v for i, v in enumerate(LOGITS.tolist())]
    assert process_logits(LOGITS, seq, {EOS}).tolist() == expected
    assert sample(LOGITS[None].clone(), [seq], {EOS}) == [token]
    assert LOGITS[EOS] == 4.0  # the input row is not changed in place


def test_min_tokens_mask_applies_to_sampling_too():
    """A sampled request below min_tokens never draws a stop token: its probability is exactly 0."""
    seq = seq_with(PROMPT, [], min_tokens=1, stop_token_ids=[3], temperature=1.0, seed=0,
                   max_tokens=8)
    probs = process_logits(LOGITS, seq, {EOS}).softmax(-1)
    assert probs[EOS].item() == 0.0 and probs[3].item() == 0.0
    kept = torch.tensor([2.0, -1.0, 0.5, -2.0, 0.0, 1.5]).softmax(-1)  # the other six, renormalised
    assert torch.allclose(probs[[0, 1, 2, 4, 5, 6]], kept, rtol=1e-6, atol=0)  # softmax rounding only


def test_batch_mixes_plain_greedy_and_penalised_rows_and_logprobs_stay_raw():
    """Row 0 plain greedy takes the EOS; row 1, the same logits with presence 1.5 on the EOS it already produced,
    takes token 3 (4 - 1.5 = 2.5 < 3). Its logprobs are the raw model distribution's (vLLM's raw_logprobs)."""
    plain = seq_with(PROMPT, [], temperature=0)
    penalised = seq_with(PROMPT, [EOS], temperature=0, presence_penalty=1.5, ignore_eos=True, logprobs=1)
    assert sample(torch.stack([LOGITS, LOGITS]), [plain, penalised], {EOS}) == [EOS, 3]
    raw = torch.log_softmax(LOGITS, -1)
    assert penalised.logprobs == [{3: raw[3].item(), EOS: raw[EOS].item()}]


def test_seeded_n_greater_than_one_does_not_depend_on_the_batch(demo_model):
    """Child i of a seeded request draws from seed + i (vLLM V1), so its samples do not depend on how its
    siblings are scheduled (one at a time or together)."""
    from engine import LLM

    params = SamplingParams(temperature=1.0, n=2, seed=1234, max_tokens=6, ignore_eos=True)
    got = [[o.token_ids for o in LLM(str(demo_model), device="cpu", max_num_seqs=m, max_model_len=128)
            .generate(["Once upon a time"], params)[0].outputs] for m in (8, 1)]
    assert got[0] == got[1] and got[0][0] != got[0][1]


def kept(seq_params: dict) -> set[int]:
    """The tokens of LOGITS left finite by the processing of a fresh request with these parameters."""
    row = process_logits(LOGITS, seq_with(PROMPT, [], **seq_params), {EOS})
    return {i for i, v in enumerate(row.tolist()) if v != INF}


# LOGITS sorted: 7 (4.0), 3 (3.0), 0 (2.0), 6 (1.5), 2, 5, 1, 4. Softmax at T=1: 0.6086, 0.2239, 0.0824, 0.0500, ...
# so the mass before each token is 0, 0.6086, 0.8325, 0.9149, ...; at T=0.5 token 7 alone holds 0.861.
@pytest.mark.parametrize("params,expected", [
    ({"top_k": 3}, {7, 3, 0}),
    ({"top_k": 1}, {7}),
    ({"top_k": 0}, set(range(8))), ({"top_k": -1}, set(range(8))), ({"top_k": 8}, set(range(8))),
    ({"top_p": 0.5}, {7}),
    ({"top_p": 0.8}, {7, 3}),  # 3 is kept: the mass before it (0.61) is short of 0.8
    ({"top_p": 0.9}, {7, 3, 0}),
    ({"top_p": 0.8, "temperature": 0.5}, {7}),  # temperature first: 7 alone already holds 0.86
    ({"top_p": 0.7}, {7, 3}),
    ({"top_p": 0.7, "top_k": 2}, {7}),  # top-p on the top-k renormalised: 7 holds 0.73 of {7, 3}
    ({"top_p": 1e-46}, {7}),  # valid (> 0) but 0 in float32: the most likely token still stays
    ({"min_p": 0.1}, {7, 3, 0}),  # floor 0.061: token 6 (0.050) goes
    ({"min_p": 0.3}, {7, 3}),
    ({"min_p": 1.0}, {7}),
    ({"top_p": 1.0, "min_p": 0.0}, set(range(8))),
], ids=lambda v: str(v))
def test_filters_keep_exactly_these_tokens(params, expected):
    assert kept({"temperature": 1.0, **params}) == expected


def test_top_k_keeps_ties_with_the_kth():
    row = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq = seq_with(PROMPT, [], temperature=1.0, top_k=2)
    assert process_logits(row, seq, {EOS}).tolist() == [1.0, 1.0, 1.0, INF]


def test_greedy_rows_are_not_filtered_and_temperature_divides():
    assert process_logits(LOGITS, seq_with(PROMPT, [], temperature=0, top_k=1), {EOS}).tolist() == LOGITS.tolist()
    assert process_logits(LOGITS, seq_with(PROMPT, [], temperature=2.0), {EOS}).tolist() == (LOGITS / 2).tolist()


def test_a_batch_processes_each_row_as_it_would_alone():
    """Mixed parameters in one batch (greedy, filters, penalties, min_tokens): every row equals the row alone."""
    torch.manual_seed(0)
    logits = torch.randn(5, 64) * 3
    seqs = [seq_with([1, 2], [5, 5], temperature=0, presence_penalty=0.5),
            seq_with([1, 2], [], temperature=0.7, top_k=5, top_p=0.9),
            seq_with([1, 2], [3], temperature=1.3, min_p=0.05, min_tokens=4, stop_token_ids=[9]),
            seq_with([1, 2], [], temperature=1.0),
            seq_with([1, 2], [7, 8], temperature=0.9, top_p=0.5, repetition_penalty=1.3)]
    batch = process_batch(logits, seqs, {EOS})
    for i, seq in enumerate(seqs):
        assert batch[i].tolist() == process_logits(logits[i], seq, {EOS}).tolist(), i
    assert batch[2, EOS].item() == INF and batch[2, 9].item() == INF  # min_tokens masked row 2's stop tokens


def test_sampling_draws_each_token_with_its_probability():
    """The exponential race argmax(p / q), q ~ Exp(1), picks token i with probability p_i: 20,000 draws of a
    4-token distribution land within 5 standard deviations of the expected counts (fixed generator: exact)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = 20000
    seqs = [seq_with(PROMPT, [], temperature=1.0, max_tokens=4) for _ in range(draws)]
    tokens = sample(probs.log()[None].expand(draws, 4).contiguous(), seqs, {EOS},
                    torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    sigma = (draws * probs * (1 - probs)).sqrt().double()
    assert ((counts - draws * probs.double()).abs() < 5 * sigma).all(), counts.tolist()


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    """A seeded request's draws come from its own generator: alone, or beside unseeded rows, it samples the same
    tokens (what makes ``seed`` reproducible under continuous batching)."""
    torch.manual_seed(1)
    logits = torch.randn(3, 1000)

    def draw(batch: bool) -> list[int]:
        seeded = Sequence("s", 0, [1, 2], SamplingParams(temperature=1.0, seed=7), torch.Generator().manual_seed(7))
        if not batch:
            return [sample(logits[1:2], [seeded], {EOS})[0] for _ in range(4)]
        others = [seq_with([1, 2], [], temperature=1.0) for _ in range(2)]
        return [sample(logits, [others[0], seeded, others[1]], {EOS})[1] for _ in range(4)]

    alone, batched = draw(False), draw(True)
    assert alone == batched and len(set(alone)) > 1


def test_logit_bias_is_added_first_and_clamped_to_100():
    """OpenAI's logit_bias: added to the raw logits before the penalties (vLLM V1's order), clamped to [-100, 100];
    a greedy row with a bias leaves the plain arg-max path."""
    seq = seq_with(PROMPT, [], logit_bias={"7": -100, 2: 3.0, 4: 500.0, 0: -5.0}, repetition_penalty=2.0,
                   temperature=0)
    assert seq.params.logit_bias == {7: -100.0, 2: 3.0, 4: 100.0, 0: -5.0}
    # the bias before repetition 2 on the prompt's 0 and 1: (2 - 5) * 2 (not 2/2 - 5) and -1*2; 2: 0.5 + 3;
    # 4: -2 + 100; 7: 4 - 100
    assert process_logits(LOGITS, seq, {EOS}).tolist() == [-6.0, -2.0, 3.5, 3.0, 98.0, 0.0, 1.5, -96.0]
    assert sample(LOGITS[None].clone(), [seq], {EOS}) == [4]
    ban = seq_with(PROMPT, [], logit_bias={EOS: -100.0}, temperature=0)
    assert sample(LOGITS[None].clone(), [ban], {EOS}) == [3]


def test_allowed_token_ids_mask_every_other_token_of_their_row_only():
    """vLLM's allowed_token_ids: the other tokens -inf (after logit_bias), in that row alone; a greedy row with them
    leaves the plain arg-max path; they must be a non-empty list of token ids."""
    only = seq_with(PROMPT, [], allowed_token_ids=[2, 5], temperature=0)
    free = seq_with(PROMPT, [], temperature=0)
    rows = process_batch(torch.stack([LOGITS, LOGITS]), [only, free], {EOS})
    assert rows[0].tolist() == [INF, INF, LOGITS[2].item(), INF, INF, LOGITS[5].item(), INF, INF]
    assert rows[1].tolist() == LOGITS.tolist()
    assert sample(torch.stack([LOGITS, LOGITS]), [only, free], {EOS}) == [2, 7]
    biased = seq_with(PROMPT, [], allowed_token_ids=[2, 5], logit_bias={3: 10.0}, temperature=0)
    assert sample(LOGITS[None].clone(), [biased], {EOS}) == [2]  # a bias lifts no token out of the mask
    assert biased.allowed_mask is not None and biased.allowed_mask.tolist() == [i in (2, 5) for i in range(8)]
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: float("nan")}, {3: float("inf")}])
def test_logit_bias_needs_token_ids_and_finite_values(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("field, value, message", [
    ("n", 2.0, "n: must be an integer, got 2.0"),
    ("n", True, "n: must be an integer, got True"),
    ("prompt_logprobs", 1.0, "prompt_logprobs: must be an integer"),
    ("top_k", 1.5, "top_k: must be an integer"),
    ("max_tokens", 5.0, "max_tokens: must be an integer"),
    ("seed", 3.0, "seed: must be an integer"),
    ("stop_token_ids", [2, 1.5], r"stop_token_ids: must be a list of integer token ids, got \[2, 1.5\]"),
    ("allowed_token_ids", [True], "allowed_token_ids: must be a list of integer token ids"),
])
def test_counts_ids_and_seeds_must_be_integers(field, value, message):
    """A float or a bool where an integer belongs is refused (a float n crashed the engine's loop, a float stop id
    never matched)."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_seed_minus_one_means_no_seed_logprobs_true_means_one_and_numpy_integers_are_ints():
    """vLLM's readings (logprobs=True crashed a step's top-k); a numpy integer is stored as a plain int."""
    import numpy as np

    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)
    params = SamplingParams(max_tokens=np.int64(5), n=np.int32(2))
    assert (params.max_tokens, params.n) == (5, 2) and type(params.max_tokens) is int and type(params.n) is int

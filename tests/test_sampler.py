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

from engine.sampler import apply_penalties, mask_min_tokens, process_logits, sample
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
    out = apply_penalties(LOGITS.clone(), seq_with(PROMPT, OUTPUT, **params))
    assert out.tolist() == expected


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
    assert mask_min_tokens(LOGITS, seq, {EOS}).tolist() == expected
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

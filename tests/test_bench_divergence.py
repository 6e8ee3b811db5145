"""The SmolLM2 rows' verdict (bench/engine_bench.py): a greedy divergence from the reference counts as allowed only
where the reference's two largest logits are within one bf16 spacing (issue 3); the random models' rows allow a
first divergence where each run ranks the other's token within TIE_NATS of its own."""
import pytest

from bench.engine_bench import bf16_ulp, divergence_report


@pytest.mark.parametrize("x,ulp", [(1.0, 2**-7), (1.99, 2**-7), (20.3, 0.125), (-20.3, 0.125), (32.0, 0.25),
                                   (0.3, 2**-9)])
def test_bf16_ulp_is_the_spacing_of_8_significant_bits(x, ulp):
    assert bf16_ulp(x) == ulp


def test_only_divergences_at_a_near_tie_of_the_reference_are_allowed():
    refs = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 3]]
    got = [[5, 6, 7], [5, 9, 9], [5, 6, 8], [4, 2, 3]]
    entries = [[{5: -0.1, 8: -2.5}, {6: -0.6, 9: -0.7}, {7: -0.2, 8: -0.4}]] * 4
    ref_top = [[[20.0, 18.0], [20.3, 20.2], [20.0, 19.8]],  # step 1: 0.1 <= 0.125; step 2: 0.2 > 0.125
               [[20.0, 18.0], [20.3, 20.2], [20.0, 19.8]],
               [[20.0, 18.0], [20.3, 20.2], [20.0, 19.8]],
               [[9.0, 8.95], [1.0, 0.0], [1.0, 0.0]]]  # step 0: 0.05 <= 0.0625
    allowed, notes = divergence_report(got, entries, refs, ref_top)
    assert allowed == 3  # identical, near-tie at step 1, near-tie at step 0; not prompt 2 (over at step 2)
    assert [n.split(" (")[0] for n in notes] == ["prompt 1 diverges at token 1", "prompt 2 diverges at token 2",
                                                 "prompt 3 diverges at token 0"]
    assert "within" in notes[0] and "over" in notes[1] and "top-2 gap 0.100 nats here" in notes[0]
    assert divergence_report(got, entries, refs, None)[0] == 1  # without the logits only identical ones count
    shorter = divergence_report([[5, 6]], entries[:1], [[5, 6, 7]], ref_top[:1])
    assert shorter == (0, ["prompt 0 ends after 2 tokens, the reference after 3"])
    forced = divergence_report([[5, 9, 9]], entries[:1], [[5, 6, 7]], [[[20.0, 18.0], [20.3, -float("inf")]]])
    assert forced[0] == 0 and "over one bf16 spacing (inf)" in forced[1][0]  # one allowed token: no tie
    across = divergence_report([[2]], [[{2: -0.1, 1: -0.2}]], [[1]], [[[-0.995, -1.0]]])  # 0.005 apart
    assert across[0] == 1 and "one bf16 spacing (0.008)" in across[1][0]  # -1.0's spacing, not -0.995's 0.004


def test_the_bf16_control_row_counts_the_cpu_bf16_run_by_the_same_rule():
    """The control row (the torch reference in bf16 against itself in fp32, from expected.json alone) counts
    identical runs and first divergences at a near-tie of the fp32 logits, and is absent without its data."""
    from bench.engine_bench import control_row

    expected = {"tokens": [[5, 6, 7], [5, 6, 7], [1, 2, 3]],
                "top_logits": [[[20.0, 18.0], [20.3, 20.2], [20.0, 19.8]]] * 2 + [[[9.0, 8.0], [1.0, 0.0], [1.0, 0.0]]],
                "bf16_cpu": {"tokens": [[5, 6, 7], [5, 9, 9], [4, 2, 3]],
                             "top_logprobs": [[[-0.1, -2.5], [-0.6, -0.7], [-0.2, -0.4]]] * 3}}
    rows = control_row(expected, lambda *args: args)
    assert len(rows) == 1
    measure, shape, total, _, allowed, goal, note = rows[0]
    # prompt 1 first differs at step 1 (fp32 top-2 0.1 apart, within 0.125); prompt 2 at step 0 (1.0 apart: over)
    assert (total, allowed, goal) == (3, 2, None) and "control" in measure and shape == "3 prompts x 32 tokens"
    assert note.startswith("1 of 3 identical; prompt 1 diverges at token 1 (top-2 gap 0.100 nats here")
    assert "prompt 2 diverges at token 0" in note and "over one bf16 spacing" in note
    assert control_row({k: v for k, v in expected.items() if k != "bf16_cpu"}, lambda *a: a) == []


def test_a_random_models_divergence_counts_only_at_a_near_tie_in_both_runs():
    from bench.engine_bench import TIE_NATS, tie_report

    ref = [([5, 6, 7], [{5: -6.1, 8: -6.4}, {6: -6.20, 9: -6.21, 4: -6.3}, {7: -6.2, 3: -6.3}])] * 5
    got = [([5, 6, 7], ref[0][1]),  # identical
           ([5, 9, 1], [{5: -6.1, 8: -6.4}, {9: -6.20, 6: -6.22}, {1: -6.0, 2: -6.1}]),  # 0.02 apart here
           ([5, 9, 7], [{5: -6.1, 8: -6.4}, {9: -6.1, 6: -6.1 - 2 * TIE_NATS}, {7: -6.2, 3: -6.3}]),  # too far
           ([5, 4, 7], [{5: -6.1, 8: -6.4}, {4: -6.20, 6: -6.205}, {7: -6.2, 3: -6.3}]),  # 0.1 down there
           ([5, 6], [{5: -6.1, 8: -6.4}, {6: -6.2, 9: -6.3}])]  # shorter
    identical, allowed, note = tie_report(got, ref)
    assert (identical, allowed) == (1, 2)
    assert note.startswith("1 of 5 identical; 1 first differ at near ties, at most 0.0200 nats apart")
    assert "prompt 2 at token 1: top [9, 6] here, [6, 9, 4] there" in note and "prompt 3 at token 1" in note
    assert "prompt 4: 2 against 3 tokens" in note
    three_way = [([1], [{1: -6.0, 2: -6.01, 3: -6.02}])], [([3], [{3: -6.0, 2: -6.01, 1: -6.03}])]
    assert tie_report(*three_way)[1] == 1  # each run's token third in the other's, within TIE_NATS


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "reason": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer"}},
          "required": ["answer", "reason"], "additionalProperties": False}


@pytest.mark.parametrize("text,ok", [
    ('{"answer": "yes", "reason": "sunny"}', True),
    ('{\n"answer" : "no", "reason": "", "n": 3}', True),
    ('{"answer": "maybe", "reason": "x"}', False),  # not in the enum
    ('{"answer": "yes"}', False),  # a required key missing
    ('{"answer": "yes", "reason": "x", "extra": 1}', False),  # additionalProperties false
    ('{"answer": "yes", "reason": "toolong"}', False),  # over maxLength
    ('{"answer": "yes", "reason": "x", "n": true}', False),  # a boolean is not an integer
    ('{"answer": "yes", "reason": "x", "n": 1.5}', False),
    ('{"answer": "yes", "reason": "x", "n": 2.0}', True),  # JSON Schema: a number with no fraction
    ('{"answer": "yes", "reason": "x", "free": true}', False),  # no such property (additionalProperties)
    ('{"answer": "yes", "reason": 3}', False),
    ('["yes"]', False), ('{"answer": "yes", "reason": "x"', False)])
def test_follows_schema_checks_keys_types_enum_and_length(text, ok):
    from bench.engine_bench import follows_schema
    assert follows_schema(text, SCHEMA) is ok


def test_follows_schema_takes_any_value_of_an_untyped_property_and_typed_containers():
    from bench.engine_bench import follows_schema
    schema = {"type": "object", "properties": {"any": {}, "list": {"type": "array"}, "obj": {"type": "object"}}}
    assert follows_schema('{"any": true, "list": [1], "obj": {}}', schema)
    assert not follows_schema('{"list": {}}', schema) and not follows_schema('{"obj": []}', schema)

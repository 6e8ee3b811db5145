"""The decode ablation rows (bench/engine_bench.py ``decode_ablation_rows``): inside ``_skipped(names)`` the named
ops launch nothing (their reference kernels are never entered) while the others still run, the engine still
generates, and every op is back when the context ends."""
from unittest import mock

import pytest

from bench.engine_bench import ABLATIONS, _skipped
from bench.random_model import write_random_awq_model
from engine import LLM, SamplingParams
from kernels import norm, paged_attention, rotary

#: each op the ablations may skip, and the reference it runs on the CPU
REFERENCES = {"rms_norm": (norm, "rms_norm_ref"), "rotary_write_kv": (rotary, "rotary_write_kv_ref"),
              "paged_attention_decode": (paged_attention, "paged_attention_decode_ref")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_random_awq_model(tmp_path_factory.mktemp("tiny"), group_size=64, device="cpu",
                                      hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256))


def _calls(model: str, names: tuple[str, ...]) -> dict[str, int]:
    """Generate 4 greedy tokens with ``names`` skipped; how often each reference ran."""
    calls = dict.fromkeys(REFERENCES, 0)
    patches = []
    for op, (module, attr) in REFERENCES.items():
        real = getattr(module, attr)

        def counted(*args, _op=op, _real=real, **kwargs):
            calls[_op] += 1
            return _real(*args, **kwargs)
        patches.append(mock.patch.object(module, attr, counted))
    for p in patches:
        p.start()
    try:
        with _skipped(names):
            llm = LLM(model, device="cpu", max_model_len=64)
            out = llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        for p in patches:
            p.stop()
    return calls


@pytest.mark.parametrize("label,names", ABLATIONS)
def test_skipped_ops_launch_nothing_and_the_others_run(tiny, label, names):
    calls = _calls(tiny, names)
    for op in REFERENCES:
        if op in names:
            assert calls[op] == 0, (label, op)
        else:
            assert calls[op] > 0, (label, op)


def test_every_op_is_back_after_the_context(tiny):
    with _skipped(tuple(REFERENCES)):
        pass
    assert all(n > 0 for n in _calls(tiny, ()).values())

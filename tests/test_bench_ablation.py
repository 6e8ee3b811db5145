"""The decode ablation rows (bench/engine_bench.py ``decode_ablation_rows``): inside ``_skipped(names)`` the named
ops launch nothing (their reference kernels are never entered) while the others run as often as without it, and
every op is back when the context ends, also after an error. On the CPU: no CUDA graph capture and no split-K
partial sums (``SplitK`` views of q), which the GPU row exercises."""
from unittest import mock

import pytest

from bench.engine_bench import ABLATIONS, _skipped
from bench.random_model import write_random_awq_model
from engine import LLM, SamplingParams
from kernels import norm, paged_attention, rotary

#: each op the ablations may skip, and the reference it runs on the CPU
REFERENCES = {"rms_norm": (norm, "rms_norm_ref"), "rotary_write_kv": (rotary, "rotary_write_kv_ref"),
              "paged_attention_decode": (paged_attention, "paged_attention_decode_ref")}
#: calls of each in 4 greedy tokens of the 2-layer model: 4 forward passes (the prompt, then 3 decode steps), each
#: with 2 norms a layer and the final one, a rotary a layer; decode attention a layer in the 3 decode steps
CALLS = {"rms_norm": 4 * (2 * 2 + 1), "rotary_write_kv": 4 * 2, "paged_attention_decode": 3 * 2}


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
            llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        for p in patches:
            p.stop()
    return calls


@pytest.mark.parametrize("label,names", ABLATIONS)
def test_skipped_ops_launch_nothing_and_the_others_run(tiny, label, names):
    assert _calls(tiny, names) == {op: 0 if op in names else n for op, n in CALLS.items()}, label


def test_every_op_is_back_after_the_context_and_after_an_error(tiny):
    with _skipped(tuple(REFERENCES)):
        pass
    with pytest.raises(RuntimeError), _skipped(("rms_norm",)):
        raise RuntimeError("inside")
    with pytest.raises(KeyError):
        with _skipped(("rms_norm", "no_such_op")):
            pass
    assert _calls(tiny, ()) == CALLS

"""Loading a model folder: its generation_config.json sampling values as defaults (engine/generation_config.py,
vLLM's ``--generation-config auto``), and a clear error for a folder that is not one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM
from engine.generation_config import sampling_defaults, with_defaults
from engine_fixtures import demo_dir


def test_sampling_defaults_reads_vllms_keys(tmp_path):
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "max_new_tokens": 64,
        "repetition_penalty": 1.1, "min_p": 0.05, "eos_token_id": [1, 2], "num_beams": 4}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64,
                                           "repetition_penalty": 1.1, "min_p": 0.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0, "top_k": "x"}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.7}  # the values SamplingParams refuses are left out
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        sampling_defaults(tmp_path)


@pytest.mark.parametrize("given,defaults,merged", [
    ({"max_tokens": None}, {}, {"max_tokens": None}),
    ({"max_tokens": None}, {"temperature": 0.6, "max_tokens": 64}, {"temperature": 0.6, "max_tokens": 64}),
    ({"temperature": 0.0, "max_tokens": 100}, {"temperature": 0.6, "max_tokens": 64},
     {"temperature": 0.0, "max_tokens": 64}),
    ({"top_p": 0.5, "max_tokens": 10}, {"temperature": 0.6, "max_tokens": 64},
     {"temperature": 0.6, "top_p": 0.5, "max_tokens": 10}),
])
def test_with_defaults_request_wins_and_max_new_tokens_caps(given, defaults, merged):
    assert with_defaults(given, defaults) == merged


def test_llm_generate_without_params_uses_the_models_values(tmp_path):
    """``LLM.generate(prompts)`` samples with the model's values (vLLM's ``get_default_sampling_params``): here
    greedy, 3 tokens, from a copy of the demo model (its files linked) whose generation_config.json says so."""
    for f in Path(demo_dir()).iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.engine.default_sampling == {"temperature": 0.0, "max_tokens": 3}
    [out] = llm.generate("The capital of France is")
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (3, "length")
    [again] = llm.generate("The capital of France is")
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # greedy: the same tokens


def test_a_missing_model_folder_is_named(tmp_path):
    """Not transformers' "Repo id must be in the form ..." (there are no hub downloads): the folder, and why."""
    with pytest.raises(FileNotFoundError, match=f"model: {tmp_path / 'nowhere'} is not a model folder"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), device="cpu")

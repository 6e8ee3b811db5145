"""The offline ``LLM`` API's vLLM forms: ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` prompts, ``use_tqdm``
and ``LLM.chat`` (the tokenizer's chat template, then generate), on the demo model on the CPU."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine_fixtures import demo_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_dir(), device="cpu", max_model_len=256, max_num_seqs=4)


def test_dict_prompts_and_use_tqdm_as_vllm(llm, capsys):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text, add_special_tokens=True)
    want = llm.generate([text], GREEDY)[0].outputs[0].token_ids
    got = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in got] == [want, want]
    assert got[0].prompt == text and got[1].prompt_token_ids == ids
    assert "Processed prompts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": text}], GREEDY)
    with pytest.raises(ValueError, match="prompt: multi_modal_data is not served"):  # not silently dropped
        llm.generate([{"prompt": text, "multi_modal_data": {"image": object()}}], GREEDY)


def test_chat_renders_the_template_then_generates(llm):
    tokenizer = llm.get_tokenizer()
    talk = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(talk, tokenize=False, add_generation_prompt=True)
    want = llm.generate([tokenizer.encode(rendered, add_special_tokens=False)], GREEDY)[0]
    one = llm.chat(talk, GREEDY)
    assert [o.outputs[0].token_ids for o in one] == [want.outputs[0].token_ids]
    assert one[0].prompt_token_ids == want.prompt_token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    lines = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(lines, GREEDY)[0].prompt_token_ids
    two = llm.chat([talk, [{"role": "user", "content": "Name a colour."}]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == want.outputs[0].token_ids
    goes_on = [*talk, {"role": "assistant", "content": "The capital"}]
    cont = llm.chat(goes_on, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert tokenizer.decode(cont.prompt_token_ids).rstrip().endswith("The capital")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(goes_on, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="messages: the chat template rejected them"):  # jinja's own error
        llm.chat([{"role": "user"}], GREEDY)  # no content: the template's concatenation fails


class _BosTokenizer:
    """Letters a-z as ids 10-35, a BOS (1) in front when special tokens are asked for, as a Llama tokenizer."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [10 + ord(c) - ord("a") for c in text]


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_a_texts_bos():
    """vLLM truncates on the left inside the tokenizer: a text keeps the BOS its encoding adds, and its last tokens
    fill the rest; token ids lose their first ones; -1 means max_model_len; more than that is refused."""
    from engine.errors import ContextLengthError
    from engine.llm_engine import prompt_token_ids

    def ids(prompt, k, max_model_len=16, max_tokens=2):
        params = SamplingParams(max_tokens=max_tokens, truncate_prompt_tokens=k)
        return prompt_token_ids(_BosTokenizer(), 100, max_model_len, prompt, params)

    assert ids("abcdef", 3) == [1, 14, 15]
    assert ids("abcdef", 7) == ids("abcdef", 12) == [1, 10, 11, 12, 13, 14, 15]  # nothing to cut
    assert ids([1, 10, 11, 12, 13, 14, 15], 3) == [13, 14, 15]
    assert ids("abc", -1, 8) == [1, 10, 11, 12]  # -1: max_model_len (8) tokens at most
    with pytest.raises(ContextLengthError, match=r"8 in the prompt"):  # which leave no room to generate
        ids("abcdefghij", -1, 8)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens: 20 is over max_model_len \(16\)"):
        ids("abcdef", 20)

    class Wrapped(_BosTokenizer):  # a BOS and an EOS around the text
        def encode(self, text, add_special_tokens=True):
            return super().encode(text, add_special_tokens) + ([2] if add_special_tokens else [])

    def wrapped(k):
        return prompt_token_ids(Wrapped(), 100, 16, "abcdef", SamplingParams(max_tokens=2, truncate_prompt_tokens=k))

    assert wrapped(4) == [1, 14, 15, 2] and wrapped(2) == [1, 2]  # the specials stay, the text fills the rest
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 1 is fewer than the 2 special tokens"):
        wrapped(1)


def test_logprobs_are_vllm_logprob_objects_with_ranks_and_a_cumulative_sum(llm):
    """As vLLM's offline API: per generated token {token_id: Logprob(logprob, rank, decoded_token)}, the sampled
    token first with its rank in the whole distribution, then the top k ranked 1 .. k; ``cumulative_logprob`` the
    sum of the sampled tokens' logprobs. The sampled tokens' ranks and logprobs equal those of the same tokens
    scored as a prompt (``prompt_logprobs``, whose ranks tests/test_prompt_logprobs.py checks against a sort)."""
    from engine.outputs import Logprob

    tok = llm.get_tokenizer()
    prompt = tok.encode("The capital of France is", add_special_tokens=True)
    params = SamplingParams(temperature=2.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
    choice = llm.generate([prompt], params)[0].outputs[0]
    scored = llm.generate([prompt + choice.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ranks = []
    for j, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        assert all(isinstance(v, Logprob) and v.decoded_token == tok.decode([t]) for t, v in entry.items())
        first, *top = entry.items()
        assert first[0] == token and len(entry) in (2, 3)
        if len(entry) == 3:  # sampled outside the top 2
            assert first[1].rank > 2 and [v.rank for _, v in top] == [1, 2]
        assert sorted(v.rank for v in entry.values())[:len(entry) - 1] in ([1], [1, 2])
        same = scored.prompt_logprobs[len(prompt) + j][token]
        assert first[1].rank == same.rank and first[1].logprob == pytest.approx(same.logprob, abs=1e-4), j
        ranks.append(first[1].rank)
    assert max(ranks) > 2  # the temperature sampled some token outside the top 2 (seeded: always the same run)
    assert choice.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(choice.token_ids,
                                                                                       choice.logprobs)))
    assert repr(choice.logprobs[0][choice.token_ids[0]]).startswith("Logprob(logprob=")
    plain = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_vllm_constructor_arguments(tmp_path):
    """vLLM's common ``LLM`` arguments are taken (or refused with the reason), before the model loads where they
    can be checked then; an unknown one is a TypeError naming ``LLM``. ``generation_config``: on a copy of the demo
    model whose generation_config.json sets a temperature, "auto" samples with it, "vllm" with SamplingParams'."""
    import json
    from pathlib import Path

    import torch

    model = tmp_path / "model"
    model.mkdir()
    for f in Path(demo_dir()).iterdir():
        if f.name != "generation_config.json":
            (model / f.name).symlink_to(f)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    small = dict(device="cpu", max_model_len=128, max_num_seqs=2)
    llm = LLM(str(model), trust_remote_code=True, tensor_parallel_size=1, disable_log_stats=True,
              tokenizer_mode="auto", max_logprobs=2, generation_config="vllm", dtype="float", **small)
    assert llm.llm_engine is llm.engine and llm.engine.runner.dtype == torch.float32
    assert llm.get_default_sampling_params() == SamplingParams()
    assert LLM(str(model), **small).get_default_sampling_params().temperature == 0.6
    assert LLM(demo_dir(), dtype=torch.float32, **small).engine.runner.dtype == torch.float32
    with pytest.raises(ValueError, match=r"logprobs: 3 is over max_logprobs \(2\)"):
        llm.generate(["Hi"], SamplingParams(max_tokens=1, logprobs=3))
    for kw, message in [(dict(tensor_parallel_size=2), "tensor_parallel_size: this engine runs on one GPU"),
                        (dict(quantization="awq"), "quantization: the checkpoint is not quantized, not awq"),
                        (dict(tokenizer_mode="slow"), "tokenizer_mode: only 'auto'"),
                        (dict(generation_config="/tmp"), "generation_config: 'auto' or 'vllm'")]:
        with pytest.raises(ValueError, match=message):
            LLM(demo_dir(), **kw, **small)
    with pytest.raises(TypeError, match="LLM: unexpected keyword argument.s. bogus"):
        LLM(demo_dir(), bogus=1, **small)


def test_vllm_call_arguments_and_outputs(llm):
    """``generate``'s ``lora_request`` / ``priority`` (None, or all 0), a per-prompt list of the wrong length,
    ``chat``'s own ``chat_template`` and ``tools``, ``CompletionOutput.finished()`` (a method, as vLLM's) and
    ``num_cached_tokens`` (the prefix-cache hit)."""
    out = llm.generate(["Hi"], GREEDY, lora_request=None, priority=[0])[0]
    assert out.outputs[0].finished() and out.num_cached_tokens == 0
    for kw, message in [(dict(lora_request=object()), "lora_request: LoRA adapters"),
                        (dict(priority=[1]), "priority: this engine schedules in arrival order")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(["Hi"], GREEDY, **kw)
    with pytest.raises(ValueError, match="sampling_params: got 0 for 1 prompts"):
        llm.generate(["Hi"], [])
    tokenizer = llm.get_tokenizer()
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{{ tools[0].function.name }}"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template, tools=tools)[0]
    assert chat.prompt_token_ids == tokenizer.encode("<<hi>>lookup", add_special_tokens=False)
    long = "The quick brown fox jumps over the lazy dog. " * 6  # over two 16-token blocks
    llm.generate([long], GREEDY)
    again, bs = llm.generate([long], GREEDY)[0], llm.engine.block_manager.block_size
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // bs * bs >= 32  # but the last token's block


def _holds_nothing(llm) -> bool:
    engine = llm.llm_engine
    return (not engine.requests and not engine.has_unfinished_requests()
            and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks)


def _count_steps(llm, monkeypatch, interrupt_in_launch_at: int | None = None) -> list:
    """Count the engine's steps; with ``interrupt_in_launch_at``, that launch raises KeyboardInterrupt (after the
    step scheduled its batch: where a Ctrl-C mostly lands on the CPU)."""
    steps, launches = [], []
    engine, real_step, real_launch = llm.llm_engine, llm.llm_engine.step, llm.llm_engine.runner.launch

    def launch(*args):
        launches.append(1)
        if len(launches) == interrupt_in_launch_at:
            raise KeyboardInterrupt
        return real_launch(*args)
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or real_step())
    monkeypatch.setattr(engine.runner, "launch", launch)
    return steps


def test_a_call_that_raises_leaves_no_request_for_the_next(llm, monkeypatch):
    """A request that cannot sample (EOS the only allowed token, masked by min_tokens) failed the call with the
    others still in the engine: the next call ran them to their end (34 s for 3 tokens) and threw them away."""
    eos = min(llm.llm_engine.eos_token_ids)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    stuck = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[eos])
    steps = _count_steps(llm, monkeypatch)
    with pytest.raises(ValueError, match="sampling: no token can be sampled"):
        llm.generate(["1", "2", "3"], [long, stuck, long])
    assert _holds_nothing(llm) and len(steps) <= 4  # not the others' 200 tokens
    steps.clear()
    assert len(llm.generate(["hi"], GREEDY)[0].outputs[0].token_ids) == 4
    assert len(steps) <= 5  # a prefill and three decodes (and the last read-back)


def test_ctrl_c_inside_a_step_leaves_no_unwritten_kv_in_the_prefix_cache(llm, monkeypatch):
    """A Ctrl-C after a step scheduled its batch left the prompt's blocks registered in the prefix cache with their
    K/V never written: the same prompt next hit them (num_cached_tokens 32) and answered other tokens."""
    prompt = "Ctrl-C test: the quick brown fox jumps over the lazy dog, then runs far away into the woods. " * 2
    cached = llm.llm_engine.block_manager.num_cached_blocks
    _count_steps(llm, monkeypatch, interrupt_in_launch_at=1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], GREEDY)
    assert _holds_nothing(llm) and llm.llm_engine.block_manager.num_cached_blocks == cached
    monkeypatch.undo()
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 0 and len(again.prompt_token_ids) > 32  # over two 16-token blocks


def test_a_failing_call_leaves_requests_added_to_the_engine_directly(llm, monkeypatch):
    """The clean-up of a failed call ran every request to its end, a request the user added to ``llm_engine``
    too (150 steps, its output thrown away)."""
    eos = min(llm.llm_engine.eos_token_ids)
    llm.llm_engine.add_request("theirs", "Hello", SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    steps = _count_steps(llm, monkeypatch)
    try:
        with pytest.raises(ValueError, match="sampling: no token can be sampled"):
            llm.generate(["1"], SamplingParams(max_tokens=8, min_tokens=3, allowed_token_ids=[eos]))
        assert list(llm.llm_engine.requests) == ["theirs"] and len(steps) <= 3
    finally:
        llm.llm_engine.abort_request("theirs")
        monkeypatch.undo()
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()


def test_vllm_call_forms_a_tuple_of_params_and_chats_positional_arguments(llm):
    """A tuple of SamplingParams is one per prompt (it was taken as one SamplingParams: AttributeError);
    ``chat``'s first four parameters are vLLM's (its fourth was ``add_generation_prompt``: vLLM's positional
    ``lora_request=None`` dropped the assistant header), the rest keyword-only."""
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    got = llm.generate(("Hi", "Hi"), (GREEDY, short))
    assert [len(o.outputs[0].token_ids) for o in got] == [4, 2]
    talk = [{"role": "user", "content": "What is the capital of France?"}]
    assert (llm.chat(talk, GREEDY, False, None)[0].prompt_token_ids == llm.chat(talk, GREEDY)[0].prompt_token_ids)
    with pytest.raises(TypeError):
        llm.chat(talk, GREEDY, False, None, "{{ messages[0].content }}")


def test_structured_outputs_as_a_dict_of_its_fields():
    from engine.sampling_params import StructuredOutputsParams

    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match=r"structured_outputs: unknown field\(s\) \['choices'\]; the fields are"):
        SamplingParams(structured_outputs={"choices": ["yes"]})
    with pytest.raises(ValueError, match="structured_outputs: must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="yes|no")  # was an AttributeError once generate ran


def test_offline_completions_stop_at_the_context_as_vllm(llm):
    """vLLM's offline ``LLM``: prompt + max_tokens over max_model_len (256 here) generates up to the context and
    finishes with "length"; only a prompt that fills it is refused. The engine's own ``add_request`` (the server's
    path) still refuses the first, as design.md's 400."""
    from engine.errors import ContextLengthError

    near, full = [28] * 250, [28] * 256
    out = llm.generate([near, [28] * 8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in out] == [(6, "length"), (16, "length")]
    with pytest.raises(ContextLengthError, match=r"you requested 256 tokens in the prompt\. Please reduce the "
                                                  r"length of the prompt\.$"):  # max_tokens would not help
        llm.generate([full], GREEDY)
    with pytest.raises(ContextLengthError, match="250 in the prompt"):
        llm.engine.add_request("x", near, SamplingParams(max_tokens=16))
    assert not llm.engine.has_unfinished_requests()


def test_detokenize_false_gives_token_ids_only(llm):
    """vLLM's ``detokenize=False``: the same tokens, no text, no decoded tokens in the logprobs; stop strings,
    which are found in the text, are refused then. ``clone`` copies."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = llm.generate(["The capital of France is"], params)[0].outputs[0]
    bare = params.clone()
    bare.detokenize = False
    got = llm.generate(["The capital of France is"], bare)[0].outputs[0]
    assert got.token_ids == want.token_ids and want.text and got.text == ""
    assert all(lp.decoded_token is None for e in got.logprobs for lp in e.values())
    assert params.detokenize and bare.logprobs == 1
    with pytest.raises(ValueError, match="stop: needs detokenize=True"):
        SamplingParams(detokenize=False, stop=["."])
    late = SamplingParams(max_tokens=4, stop=["."])
    late.detokenize = False  # set after the constructor checked it: the engine checks again
    with pytest.raises(ValueError, match="stop: needs detokenize=True"):
        llm.generate(["The capital of France is"], late)

def test_offline_api_imports_without_the_server_stack():
    """``engine.LLM`` (and the GPU bench that builds on it) must import where pydantic / FastAPI are absent: the
    GPU machine has neither, and an offline script should not need the server's models."""
    import subprocess
    import sys

    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('pydantic', 'fastapi', 'starlette', 'uvicorn'):\n"
               "            raise ImportError('blocked ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from engine import LLM, SamplingParams\n"
               "import engine.llm, engine.llm_engine\n"
               "print(sorted(m for m in sys.modules if m.startswith('engine.server')))\n")
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

"""Structured outputs (vLLM's StructuredOutputsParams, OpenAI's response_format) on the demo model, CPU path: the
output follows the JSON schema, is JSON, matches the regex, is one of the choices or is in the grammar's language,
with async scheduling as without, beside unconstrained rows that the mask leaves alone; a schema, regex or grammar
the compiler cannot follow is refused before anything is queued."""
from __future__ import annotations

import json

import pytest

from engine import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

YES_NO = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


def _llm(demo_model, **kw):
    from engine import LLM
    return LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def llm(demo_model):
    return _llm(demo_model)


def chat(llm, question: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}],
                                                   add_generation_prompt=True, tokenize=False)


def schema_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(json=YES_NO), **kw)


def test_outputs_follow_the_schema_beside_unconstrained_rows(llm):
    questions = [chat(llm, "Is Paris in France? Answer in JSON."), chat(llm, "Is the sea dry?")]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([questions[0]], plain)[0].outputs[0].token_ids
    outs = llm.generate(questions + [questions[0]], [schema_params(temperature=0),
                                                    schema_params(temperature=1.0, seed=3, n=3), plain])
    for out in outs[:2]:
        for choice in out.outputs:
            assert json.loads(choice.text) in ({"answer": "yes"}, {"answer": "no"}) and choice.finish_reason == "stop"
    assert outs[2].outputs[0].token_ids == alone  # the unconstrained row is not masked


def test_json_object_means_an_object(llm):
    """OpenAI's JSON mode (vLLM's json_object): an object, not any JSON value; the demo model's answer is one."""
    from engine.structured_output import GrammarCompiler
    tok = llm.get_tokenizer()
    grammars = GrammarCompiler(tok, llm.engine.runner.model.config["vocab_size"], sorted(llm.engine.eos_token_ids))
    first = lambda text: tok.encode(text, add_special_tokens=False)[0]
    assert not grammars.matcher(StructuredOutputsParams(json_object=True)).accept_token(first("["))
    assert grammars.matcher(StructuredOutputsParams(json_object=True)).accept_token(first("{"))
    out = llm.generate([chat(llm, "Return a JSON object with a name and an age.")],
                       SamplingParams(temperature=0, max_tokens=120,
                                      structured_outputs=StructuredOutputsParams(json_object=True)))[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)  # 18 tokens (greedy)


def test_logprobs_are_of_the_masked_distribution(llm):
    """As vLLM V1: the grammar's mask comes before the logprobs, so the first step's top 20 hold only tokens that
    can open a JSON object (whitespace, or a brace and what may follow it), their probabilities summing to at
    most 1; the raw distribution's top 20 would hold words."""
    import math
    tok = llm.get_tokenizer()
    entry = llm.generate([chat(llm, "Is Paris in France?")], schema_params(temperature=0, logprobs=20))[0] \
        .outputs[0].logprobs[0]
    finite = {t: lp for t, lp in entry.items() if lp > -math.inf}
    assert finite and all(tok.decode([t]).strip()[:1] in ("", "{") for t in finite)  # "{", '{"', ...
    assert sum(math.exp(lp) for lp in finite.values()) <= 1 + 1e-5


def test_without_xgrammar_a_structured_request_is_refused(llm, monkeypatch):
    import sys

    from engine.structured_output import GrammarCompiler, check
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(ValueError, match="need the xgrammar package"):
        GrammarCompiler(llm.get_tokenizer(), 49152, [2])
    assert check(StructuredOutputsParams(json={"type": "nonsense"})) is None  # the engine refuses instead


def test_async_scheduling_gives_the_same_outputs(demo_model, llm):
    prompts = [chat(llm, "Is Paris in France?"), chat(llm, "Is ice cold?")]
    params = [schema_params(temperature=0), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    sync = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    overlapped = _llm(demo_model, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)] == sync


def test_a_complete_output_stops_even_with_ignore_eos(llm):
    out = llm.generate([chat(llm, "Is Paris in France?")], schema_params(temperature=0, ignore_eos=True))[0]
    choice = out.outputs[0]
    assert choice.finish_reason == "stop" and len(choice.token_ids) < 40
    assert json.loads(choice.text.replace("<|im_end|>", "")) in ({"answer": "yes"}, {"answer": "no"})


def test_a_schema_the_grammar_cannot_follow_is_refused_before_queueing(llm):
    engine = llm.engine
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError, match="structured_outputs: .*nonsense"):
        engine.add_request("bad", "hi", bad)
    assert "bad" not in engine.requests and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_the_async_engine_compiles_the_grammar_off_the_engine_thread(llm):
    """AsyncLLMEngine (the server's) compiles a structured request's grammar on a worker thread and hands it to the
    engine thread with the request, which compiles nothing, so a long compile does not stall the running
    requests."""
    import asyncio
    import threading

    from engine.async_engine import AsyncLLMEngine
    from test_server_fakes import wait_for
    compiler = llm.engine.grammar_compiler()
    real, seen = compiler.compile, []

    def compile(spec):
        seen.append(threading.current_thread().name)
        return real(spec)

    hot_cold = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["hot", "cold"]}},
                "required": ["answer"], "additionalProperties": False}  # compiled by no other test
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=hot_cold))
    async_engine = AsyncLLMEngine(lambda: llm.engine, "demo")
    compiler.compile = compile
    try:
        async_engine.start()
        wait_for(lambda: async_engine.is_ready, what="engine ready")

        async def run():
            return [o async for o in async_engine.generate(chat(llm, "Is ice cold?"), params, "r1")][-1]
        out = asyncio.run(run()).outputs[0]
    finally:
        async_engine.shutdown()
        del compiler.compile
    assert json.loads(out.text) in ({"answer": "hot"}, {"answer": "cold"})
    assert len(seen) == 1 and seen[0] != "llm-engine"


def test_choice_regex_and_grammar_constrain_the_output(llm):
    """vLLM's other structured outputs: one of the choices exactly (quotes, a backslash and a newline kept), the
    whole output matching the regex, the output in the EBNF grammar's language; sampled, several seeds."""
    import re
    choices = ['yes', 'no "way"', "back\\slash", "two\nlines"]
    question = chat(llm, "Is Paris in France?")
    specs = [StructuredOutputsParams(choice=choices), StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5}-\d{2}"),
             StructuredOutputsParams(grammar='root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?')]
    outs = llm.generate([question] * 3, [SamplingParams(temperature=1.0, seed=s, n=4, max_tokens=40,
                                                        structured_outputs=spec) for s, spec in enumerate(specs)])
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(o.finish_reason == "stop" for out in outs for o in out.outputs), texts
    assert all(t in choices for t in texts[0]), texts[0]
    assert all(re.fullmatch(r"[A-Z][a-z]{2,5}-\d{2}", t) for t in texts[1]), texts[1]
    assert all(re.fullmatch(r"\([1-9][0-9]?(?:\+[1-9][0-9]?)?\)", t) for t in texts[2]), texts[2]
    grammars = llm.engine.grammar_compiler()  # every choice is reachable, escapes and all, and nothing else
    for text, ok in [(c, True) for c in choices] + [("no way", False), ("back\\\\slash", False), ("ye", False)]:
        matcher = grammars.matcher(specs[0])
        assert (matcher.accept_string(text) and matcher.is_completed()) is ok, text


@pytest.mark.parametrize("kw,message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "non-empty list"),
    ({"choice": "ab"}, "non-empty list"), ({"choice": ["a", 3]}, "non-empty list"), ({"regex": 3}, "regex must be"),
    ({"json_object": "yes"}, "true or false"), ({"json_object": 1}, "true or false"), ({"json": 5}, "JSON schema"),
    ({"json_object": True, "disable_any_whitespace": "no"}, "true or false")])
def test_structured_outputs_params_take_exactly_one_well_formed_constraint(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)


def test_a_regex_or_grammar_the_compiler_cannot_read_is_refused(llm):
    for spec, what in ((StructuredOutputsParams(regex="("), "regex"),
                       (StructuredOutputsParams(grammar='root ::= "a" |'), "grammar")):
        with pytest.raises(ValueError, match=f"structured_outputs: not a {what} this server can follow"):
            llm.engine.add_request("bad", "hi", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_disable_any_whitespace_gives_json_in_one_fixed_layout(llm):
    """vLLM's disable_any_whitespace (xgrammar's any_whitespace=False): the JSON's separators are fixed (", " and
    ": ", json.dumps's), no free whitespace; without it the model spaces it its own way."""
    question = chat(llm, "Is Paris in France? Answer in JSON.")

    def texts(**kw):
        params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(json=YES_NO, **kw))
        return [c.text for c in llm.generate([question], params)[0].outputs]

    fixed, loose = texts(disable_any_whitespace=True), texts()
    assert all(t in ('{"answer": "yes"}', '{"answer": "no"}') for t in fixed), fixed
    assert any(t.strip() != json.dumps(json.loads(t)) for t in loose), loose


def test_the_smollm2_check_records_the_top_two_allowed_logits_of_each_step(llm, monkeypatch):
    """bench/smollm2_parts.py's structured reference: at each step the two largest logits after the grammar's mask
    (their gap equals the masked logprobs' top-2 gap; the raw logits' would differ where the mask drops the raw
    top token), one entry per output token, and the runner's mask function put back afterwards."""
    from bench import smollm2_parts
    from engine import model_runner

    real = model_runner.apply_masks
    monkeypatch.setattr(smollm2_parts, "QUESTIONS", smollm2_parts.QUESTIONS[:1])
    got = smollm2_parts.structured_tokens(llm)
    assert model_runner.apply_masks is real
    tokens, tops = got["tokens"][0], got["top_logits"][0]
    assert got["texts"][0].startswith("{") and len(tops) == len(tokens) > 5
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=smollm2_parts.SCHEMA))
    out = llm.generate(got["prompts"], params)[0].outputs[0]
    assert out.token_ids == tokens
    gaps = [(a - b, sorted(entry.values(), reverse=True)) for (a, b), entry in zip(tops, out.logprobs)]
    assert all(lp[0] - lp[1] == pytest.approx(gap, abs=1e-4) for gap, lp in gaps if lp[1] > -1e9)

"""End to end: the official openai SDK against uvicorn serving the real LLMEngine on the demo model (CPU)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytest.importorskip("engine.llm_engine")

from test_server_fakes import demo_model_server, wait_for  # noqa: E402

MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live():
    """(base URL, model name, AsyncLLMEngine) of a server over the demo model, shared by this module."""
    with demo_model_server(max_model_len=MAX_MODEL_LEN, max_num_seqs=8) as (url, engine):
        yield url, engine.model_name, engine


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


def test_chat_answers_and_stream_equals_non_stream(live):
    url, model, _ = live
    client = sdk(url)
    kw = dict(model=model, messages=QUESTION, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == text
    assert "<|im_end|>" not in text and full.usage.completion_tokens <= 10


def test_completion_stream_equals_non_stream(live):
    url, model, _ = live
    client = sdk(url)
    kw = dict(model=model, prompt="In the beginning God created", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.choices[0].text and streamed.strip()


def test_usage_counts_match_tokenize(live):
    url, model, _ = live
    count = httpx.post(f"{url}/tokenize", json={"messages": QUESTION}).json()["count"]
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] == count
    assert all(json.loads(e)["usage"] is None for e in events[:-2])


def test_context_overflow_reports_the_exact_numbers(live):
    url, model, _ = live
    prompt = "one two three four five six seven eight nine ten"
    count = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()["count"]
    max_tokens = MAX_MODEL_LEN - count + 1
    with pytest.raises(openai.BadRequestError) as info:
        sdk(url).completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
    assert info.value.code == "context_length_exceeded"
    assert (f"maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {MAX_MODEL_LEN + 1} "
            f"tokens ({count} in the prompt, {max_tokens} in the completion)") in info.value.body["message"]


def test_concurrent_greedy_requests_match_the_single_ones(live):
    url, model, _ = live
    client = sdk(url)
    prompts = ["The sun is", "Water boils at", "The quick brown fox"]

    def ask(p: str) -> str:
        return client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0).choices[0].text

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def test_disconnect_frees_blocks_and_metrics_follow(live):
    url, model, engine = live
    aborts = f'vllm:request_success_total{{finished_reason="abort",model_name="{model}"}} '

    def aborted() -> float:
        return float(next(line for line in httpx.get(f"{url}/metrics").text.splitlines()
                          if line.startswith(aborts))[len(aborts):])
    aborted0 = aborted()  # the series is there from the start, at 0
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_for(lambda: engine.get_stats().num_running == 0, timeout=300, what="request aborted")
    kv = httpx.get(f"{url}/v1/kv").json()
    assert kv["used"] == 0 and kv["running"] == []
    metrics = httpx.get(f"{url}/metrics").text
    assert f'vllm:num_requests_running{{model_name="{model}"}} 0.0' in metrics
    wait_for(lambda: aborted() == aborted0 + 1, what="the abort counted")  # the listener runs after the snapshot
    assert f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0' in metrics


def test_echo_logprobs_score_a_continuation_like_lm_eval(live):
    """lm-eval-harness's loglikelihood request (``echo``, ``logprobs`` 1, the continuation's tokens read from the
    prompt's): the greedy next token's logprob, scored as the last prompt token, is what generating it gave."""
    url, model, _ = live
    client = sdk(url)
    context = "The capital of France is"
    gen = client.completions.create(model=model, prompt=context, max_tokens=1, temperature=0, logprobs=1).choices[0]
    token, logprob = gen.logprobs.tokens[0], gen.logprobs.token_logprobs[0]
    scored = client.completions.create(model=model, prompt=context + token, max_tokens=0, temperature=0,
                                       logprobs=1, echo=True).choices[0]
    lp = scored.logprobs
    assert scored.text == context + token and "".join(lp.tokens) == context + token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.tokens[-1] == token
    assert lp.token_logprobs[-1] == pytest.approx(logprob, abs=1e-4)
    assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]  # greedy: it is the top token
    assert all(v <= 0 for v in lp.token_logprobs[1:])


def test_response_format_json_schema_gives_json_that_follows_it(live):
    pytest.importorskip("xgrammar")
    url, model, _ = live
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    r = sdk(url).chat.completions.create(model=model, messages=QUESTION, max_tokens=30, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"capital"} and isinstance(answer["capital"], str)
    assert r.choices[0].finish_reason == "stop"


def test_vllm_structured_outputs_choice_through_the_sdk(live):
    """vLLM's ``extra_body={"structured_outputs": {"choice": [...]}}``: the answer is one of the choices, on both
    endpoints, as the model's own answer would not be."""
    pytest.importorskip("xgrammar")
    url, model, _ = live
    choices = ["Paris", "Lyon", "Marseille"]
    extra = {"structured_outputs": {"choice": choices}}
    chat = sdk(url).chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                                            extra_body=extra).choices[0]
    plain = sdk(url).completions.create(model=model, prompt="My favourite city:", max_tokens=10, temperature=0,
                                        extra_body=extra).choices[0]
    free = sdk(url).completions.create(model=model, prompt="My favourite city:", max_tokens=10,
                                       temperature=0).choices[0]
    assert chat.message.content in choices and chat.finish_reason == "stop"
    assert plain.text in choices and plain.finish_reason == "stop" and free.text not in choices


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 30}},
                                                           "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_through_the_sdk(live):
    """A named function and "required" (vLLM's way without a tool-call parser): the SDK gets tool_calls whose
    arguments are JSON that follows the function's parameters; a named call streamed adds up to the same."""
    pytest.importorskip("xgrammar")
    url, model, _ = live
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = dict(model=model, messages=ask, max_tokens=40, temperature=0, tools=[WEATHER, CLOCK],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = sdk(url).chat.completions.create(**named).choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    streamed = [c.choices[0].delta.tool_calls for c in sdk(url).chat.completions.create(stream=True, **named)
                if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(d[0].function.arguments for d in streamed) == call.function.arguments
    required = sdk(url).chat.completions.create(**{**named, "tool_choice": "required", "max_tokens": 80})
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls  # vLLM's, OpenAI's (a named call: "stop")
    assert sdk(url).chat.completions.create(**named).choices[0].finish_reason == "stop"
    last = [c.choices[0] for c in sdk(url).chat.completions.create(
        stream=True, **{**named, "tool_choice": "required", "max_tokens": 80}) if c.choices][-1]
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls
    for c in calls:
        args = json.loads(c.function.arguments)
        assert (c.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))

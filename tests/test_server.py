"""The HTTP server over the fake engine: the official openai SDK and raw httpx against real uvicorn."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.server.api_server import build_app
from test_server_fakes import REPLY, FakeEngine, FakeTokenizer, ServerThread, fake_completion, wait_for

MODEL = "fake-model"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPT_LEN = len(FakeTokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True))


def serve(fake: FakeEngine | None = None, gate: threading.Event | None = None, engine_kw: dict | None = None,
          **app_kw):
    """A started AsyncLLMEngine over ``fake`` (its load blocked until ``gate`` is set; ``engine_kw`` are its
    keyword arguments) behind a live server."""
    fake = fake or FakeEngine()

    def factory():
        if gate is not None:
            gate.wait(20)
        return fake

    engine = AsyncLLMEngine(factory, MODEL, **(engine_kw or {}))
    return engine, ServerThread(build_app(engine, **app_kw))


@pytest.fixture
def server():
    """(base URL, fake engine, async engine) of a ready server."""
    fake = FakeEngine()
    engine, srv = serve(fake)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        yield url, fake, engine
    engine.shutdown()


def sdk(url: str, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=20)


def sse_events(url: str, path: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=20) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_chat_completion(server):
    url, _, _ = server
    r = sdk(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == \
        fake_completion(CHAT_PROMPT_LEN, SamplingParams(max_tokens=10))
    assert r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (CHAT_PROMPT_LEN, 10, CHAT_PROMPT_LEN + 10)


def test_completion_until_eos(server):
    url, _, _ = server
    r = sdk(url).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=0)
    assert r.object == "text_completion"
    assert (r.choices[0].text, r.choices[0].finish_reason) == fake_completion(16, SamplingParams(max_tokens=200))
    assert r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens == 16


def test_chat_stream_concatenates_to_the_non_streamed_text(server):
    url, _, _ = server
    client = sdk(url)
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_completion_stream_with_stop_string_matches_non_streamed(server):
    url, _, _ = server
    client = sdk(url)
    kw = dict(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=["dolor s"])
    full = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert text == full.choices[0].text == fake_completion(3, SamplingParams(max_tokens=40, stop=["dolor s"]))[0]
    assert "dolor s" not in text and full.choices[0].finish_reason == "stop"


def test_stream_include_usage_adds_one_final_usage_chunk(server):
    url, _, _ = server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert "role" in chunks[0]["choices"][0]["delta"] and "role" not in chunks[1]["choices"][0]["delta"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": CHAT_PROMPT_LEN, "completion_tokens": 5, "total_tokens": CHAT_PROMPT_LEN + 5}
    plain = sse_events(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True})
    assert plain[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in plain[:-1])
    assert {json.loads(e)["object"] for e in plain[:-1]} == {"text_completion"}


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server):
    """vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage`` every chunk carries its prompt's
    tokens and its own choice's tokens so far (the role chunk 0); alone it changes nothing."""
    url, _, _ = server
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True, "stream_options": options}
    chunks = [json.loads(e) for e in sse_events(url, "/v1/chat/completions", body)[:-1]]
    assert chunks[0]["usage"] == {"prompt_tokens": CHAT_PROMPT_LEN, "completion_tokens": 0,
                                  "total_tokens": CHAT_PROMPT_LEN}
    counts = [c["usage"]["completion_tokens"] for c in chunks[1:-1]]
    assert counts == sorted(counts) and counts[-1] == 5  # outputs may coalesce into fewer chunks
    assert all(c["usage"]["prompt_tokens"] == CHAT_PROMPT_LEN for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5

    body = {"model": MODEL, "prompt": ["ab", "abcd"], "n": 2, "max_tokens": 3, "stream": True,
            "stream_options": options}
    chunks = [json.loads(e) for e in sse_events(url, "/v1/completions", body)[:-1]]
    last = {}  # choice index -> its last chunk's usage
    for c in chunks[:-1]:
        index = c["choices"][0]["index"]
        assert c["usage"]["prompt_tokens"] == (2 if index < 2 else 4)
        assert c["usage"]["completion_tokens"] >= last.get(index, {"completion_tokens": 0})["completion_tokens"]
        last[index] = c["usage"]
    assert {i: u["completion_tokens"] for i, u in last.items()} == {0: 3, 1: 3, 2: 3, 3: 3}
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}

    alone = {**body, "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in json.loads(e) for e in sse_events(url, "/v1/completions", alone)[:-1])


def test_n_and_batched_prompts_get_their_own_indices(server):
    url, _, _ = server
    r = sdk(url).completions.create(model=MODEL, prompt=["ab", "abcd"], n=2, max_tokens=6)
    params = SamplingParams(max_tokens=6)
    assert [(c.index, c.text) for c in r.choices] == [
        (0, fake_completion(2, params, 0)[0]), (1, fake_completion(2, params, 1)[0]),
        (2, fake_completion(4, params, 0)[0]), (3, fake_completion(4, params, 1)[0])]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 24


def test_echo_prefixes_the_prompt(server):
    url, _, _ = server
    r = sdk(url).completions.create(model=MODEL, prompt="Echo me ", max_tokens=4, echo=True)
    assert r.choices[0].text == "Echo me " + fake_completion(8, SamplingParams(max_tokens=4))[0]


def test_logprobs_in_chat_and_completions_streamed_and_not(server):
    url, _, _ = server
    client = sdk(url)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert "".join(t.token for t in content) == full.choices[0].message.content
    assert [t.logprob for t in content] == [-0.25] * 6
    assert [(x.token, x.logprob) for x in content[0].top_logprobs] == [(content[0].token, -0.25), ("#", -2.0)]
    streamed = [t.token for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(streamed) == full.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.token_logprobs == [-0.25] * 5
    assert lp.text_offset == [0, 1, 2, 3, 4] and lp.top_logprobs[0] == {lp.tokens[0]: -0.25}
    chunks = list(client.completions.create(model=MODEL, prompt="ab", max_tokens=5, logprobs=1, stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    top0 = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, logprobs=0).choices[0].logprobs
    assert top0.top_logprobs == [{t: -0.25} for t in top0.tokens]  # the sampled token is always there (k + 1)


def test_a_nan_logprob_comes_back_as_null_streamed_and_not():
    """NaN logits give a NaN logprob: JSON has no NaN, so it is null in a whole response as in the streamed chunks
    (a whole response failed with 500 while starlette's JSONResponse wrote it)."""
    engine, srv = serve(FakeEngine(logprob=float("nan")))
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=20)
        assert r.status_code == 200
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [t["logprob"] for t in content] == [None] * 3 and content[0]["top_logprobs"][0]["logprob"] is None
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2, "logprobs": 1},
                       timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"] == [None, None]
        events = sse_events(url, "/v1/chat/completions", {**chat, "stream": True})
        streamed = [t["logprob"] for e in events[:-1] for c in json.loads(e)["choices"]
                    if c.get("logprobs") for t in c["logprobs"]["content"]]
        assert streamed == [None] * 3 and events[-1] == "[DONE]"
    engine.shutdown()


def test_echo_with_logprobs_gives_the_prompts_logprobs_too(server):
    """vLLM: with echo the prompt tokens come first in ``logprobs`` (the first one null), offsets from 0; with
    ``max_tokens`` 0 the prompt alone comes back; streamed, the first chunk carries the prompt's."""
    url, fake, _ = server
    client = sdk(url)
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, logprobs=1, echo=True)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert fake.params[-1].prompt_logprobs == 1
    assert text == "ab" + fake_completion(2, SamplingParams(max_tokens=3))[0] and "".join(lp.tokens) == text
    assert lp.token_logprobs == [None, -1.5, -0.25, -0.25, -0.25] and lp.text_offset == [0, 1, 2, 3, 4]
    assert lp.top_logprobs[:3] == [None, {"#": -1.0, "b": -1.5}, {text[2]: -0.25}]
    streamed = list(client.completions.create(model=MODEL, prompt="ab", max_tokens=3, logprobs=1, echo=True,
                                              stream=True))
    first = streamed[0].choices[0]
    assert first.text.startswith("ab") and first.logprobs.tokens[:2] == ["a", "b"]
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    only = client.completions.create(model=MODEL, prompt="abc", max_tokens=0, logprobs=0, echo=True).choices[0]
    assert only.text == "abc" and only.logprobs.tokens == ["a", "b", "c"]
    assert only.logprobs.token_logprobs == [None, -1.5, -1.5] and only.logprobs.top_logprobs[1] == {"b": -1.5}
    plain = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, echo=True).choices[0]
    assert plain.logprobs is None and fake.params[-1].prompt_logprobs is None  # none asked: none computed
    bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def _lp(logprob: float, rank: int, token: str) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token}


def test_prompt_logprobs_extra_parameter(server):
    """vLLM's ``prompt_logprobs``: per prompt token {token id: logprob, rank, decoded token} for the token and the
    top k, the first null; per choice in completions (also for echo with logprobs, as vLLM), once per request in
    chat; left out when nobody asked; a 400 naming it out of [0, 20] or with streaming."""
    url, fake, _ = server
    client = sdk(url)
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, n=2, extra_body={"prompt_logprobs": 1})
    assert fake.params[-1].prompt_logprobs == 1 and r.choices[0].logprobs is None
    want = [None, {str(ord("b")): _lp(-1.5, 2, "b"), str(ord("#")): _lp(-1.0, 1, "#")}]  # the fake's rank 2
    assert [c.model_extra["prompt_logprobs"] for c in r.choices] == [want, want]
    two = client.completions.create(model=MODEL, prompt=["ab", "xyz"], max_tokens=1,
                                    extra_body={"prompt_logprobs": 2})
    assert [len(c.model_extra["prompt_logprobs"]) for c in two.choices] == [2, 3]
    assert two.choices[1].model_extra["prompt_logprobs"][2] == {str(ord("z")): _lp(-1.5, 2, "z"),
                                                                str(ord("#")): _lp(-1.0, 1, "#")}
    echoed = client.completions.create(model=MODEL, prompt="ab", max_tokens=1, logprobs=2, echo=True,
                                       extra_body={"prompt_logprobs": 0})
    assert fake.params[-1].prompt_logprobs == 2  # echo's logprobs need the top 2
    assert echoed.choices[0].logprobs.top_logprobs[1] == {"#": -1.0, "b": -1.5}
    assert echoed.choices[0].model_extra["prompt_logprobs"] == [None, {str(ord("b")): _lp(-1.5, 2, "b")}]  # k 0
    only_echo = client.completions.create(model=MODEL, prompt="ab", max_tokens=1, logprobs=1, echo=True)
    assert only_echo.choices[0].model_extra["prompt_logprobs"] == want  # echo's k, as vLLM
    plain = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0] and fake.params[-1].prompt_logprobs is None
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                                                         "prompt_logprobs": 0}).json()
    assert fake.params[-1].prompt_logprobs == 0 and len(chat["prompt_logprobs"]) == CHAT_PROMPT_LEN
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]
    assert "prompt_logprobs" not in httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for extra, why in (({"prompt_logprobs": 21}, "[0, 20]"), ({"prompt_logprobs": -1}, "[0, 20]"),
                           ({"prompt_logprobs": 1, "stream": True}, "stream")):
            bad = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **body, **extra})
            err = bad.json()["error"]
            assert bad.status_code == 400 and err["param"] == "prompt_logprobs" and why in err["message"], err
        streamed = sse_events(url, path, {"model": MODEL, "max_tokens": 1, **body, "prompt_logprobs": 0,
                                          "stream": True})  # vLLM accepts 0 with stream and sends none
        assert streamed[-1] == "[DONE]" and fake.params[-1].prompt_logprobs is None
        assert not any("prompt_logprobs" in e for e in streamed)


def test_prompt_logprobs_field_puts_the_prompt_token_first_with_its_own_rank():
    """The prompt token outside the top k comes first with its engine rank, then the top k ranked 1 .. k; inside
    the top k it keeps its place first with its top-k rank (k entries in all); -inf is clamped as vLLM does."""
    from engine.server.logprobs import prompt_logprobs
    a, b, c, d = (ord(ch) for ch in "abcd")
    entries = [None, {b: -5.0, c: -0.1, d: -1.0}, {c: -1.0, a: -0.5, b: -1.2}, {d: float("-inf"), a: -0.2, b: -0.3}]
    got = prompt_logprobs(FakeTokenizer(), [a, b, c, d], entries, [None, 9, 2, 50000], 2)
    assert got == [None,
                   {b: _lp(-5.0, 9, "b"), c: _lp(-0.1, 1, "c"), d: _lp(-1.0, 2, "d")},
                   {c: _lp(-1.0, 2, "c"), a: _lp(-0.5, 1, "a")},
                   {d: _lp(-9999.0, 50000, "d"), a: _lp(-0.2, 1, "a"), b: _lp(-0.3, 2, "b")}]
    assert [list(e) for e in got[1:]] == [[b, c, d], [c, a], [d, a, b]]  # the prompt token's key first
    assert prompt_logprobs(FakeTokenizer(), [a, b], entries[:2], [None, 9], 0) == [None, {b: _lp(-5.0, 9, "b")}]
    # the prompt token tied with the device's k-th (logits a = 2, b = c = 1, token c, k = 2: top-2 [a, b], c's rank
    # 3): b stays in, as vLLM's dict has it
    tie = prompt_logprobs(FakeTokenizer(), [a, c], [None, {c: -1.5, a: -0.5, b: -1.5}], [None, 3], 2)
    assert tie == [None, {c: _lp(-1.5, 3, "c"), a: _lp(-0.5, 1, "a"), b: _lp(-1.5, 2, "b")}]


def test_models_health_version_tokenize_kv(server):
    url, _, _ = server
    cards = sdk(url).models.list().data
    assert [(m.id, m.max_model_len) for m in cards] == [(MODEL, 256)]
    assert httpx.get(f"{url}/health").json()["status"] == "ready"
    from importlib.metadata import version
    assert httpx.get(f"{url}/version").json() == {"version": version("edge-appliance")}
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hey"}).json()
    assert tok == {"count": 3, "max_model_len": 256, "tokens": [104, 101, 121], "token_strs": None}
    chat_tok = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tok["count"] == CHAT_PROMPT_LEN
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hey"}
    kv = httpx.get(f"{url}/v1/kv").json()
    assert (kv["block_size"], kv["num_blocks"], kv["free"], kv["used"], kv["cached"]) == (4, 512, 512, 0, 0)
    assert kv["blocks"] == "." * 512 and kv["running"] == []


def _error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Assert the OpenAI error shape with ``status`` (and ``param``/``code`` when given); return the error."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("body,param", [
    ({"messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),  # it wins
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": MESSAGES, "stop": ["ok", ""]}, "stop"),
    ({"messages": MESSAGES, "stop": ""}, "stop"),
    ({"model": MODEL}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true (vLLM)
    ({"messages": MESSAGES, "n": 129}, "n"),  # OpenAI's bound: one request cannot hold the engine
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_fields_are_400_naming_the_field(server, body, param):
    url, _, _ = server
    _error(httpx.post(f"{url}/v1/chat/completions", json=body), 400, param=param)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),  # vLLM refuses insertion
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": False}},
     "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),  # OpenAI's default with tools, "auto": no tool-call parser here
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),  # xgrammar cannot follow it
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": "f"}],
                              "tool_choice": "none"}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": False}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": 5}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs"),  # a vLLM key this server does not follow
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a"},
                              "response_format": {"type": "json_object"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1114112": -100}}, "logit_bias"),  # outside the vocab
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias.abc.[key]"),
    ("/v1/completions", {"prompt": [104, -1], "echo": True}, "prompt"),  # checked before echo decodes it
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [104, -1]}, "tokens"),
    ("/detokenize", {"tokens": [0x110000]}, "tokens"),
])
def test_more_bad_fields_are_400_naming_the_field(server, path, body, param):
    """... with the validator's own message after the field, no pydantic prefix ("Value error, ")."""
    url, _, _ = server
    err = _error(httpx.post(f"{url}{path}", json=body), 400, param=param)
    assert "Value error" not in err["message"] and err["message"].startswith(f"{param}: ")
    assert not err["message"].startswith(f"{param}: {param}:")  # named once
    assert err["code"] in ("invalid_value", "invalid_type")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a \\ud800 b"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x \\udfff"}]}', "messages"),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\udc00"]}', "stop"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_is_400_naming_its_field_and_the_connection_serves_on(server, path, body, param):
    """JSON's unpaired "\\ud800" escapes decode to no text a tokenizer encodes (it raised TypeError: a 500, and
    uvicorn closed the kept-alive connection under the client); a well-formed pair is one character."""
    url, _, _ = server
    with httpx.Client() as client:
        r = client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
        assert "lone UTF-16 surrogate" in _error(r, 400, param=param)["message"]
        assert client.get(f"{url}/health").status_code == 200
    pair = httpx.post(f"{url}/tokenize", content='{"prompt": "\\ud83d\\ude00"}',
                      headers={"content-type": "application/json"})
    assert pair.status_code == 200 and (pair.json()["tokens"], pair.json()["count"]) == ([0x1F600], 1)


@pytest.mark.parametrize("path,template,param", [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "logit_bias": %s}', "logit_bias"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "x": %s}], "max_tokens": 1}', None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
                             '"chat_template_kwargs": {"x": %s}}', None),
])
def test_json_nested_hundreds_of_levels_deep_is_no_500_and_the_connection_serves_on(server, path, template, param):
    """The lone-surrogate check walked values by recursion: 321 levels of JSON nesting raised RecursionError, a
    500, and uvicorn closed the kept-alive connection (found by a robustness audit). Now the body answers as any
    other: a 400 naming the field where the type is wrong, else 200."""
    url, _, _ = server
    deep = "[" * 900 + "]" * 900
    with httpx.Client() as client:
        r = client.post(f"{url}{path}", content=template % deep, headers={"content-type": "application/json"})
        if param is None:
            assert r.status_code == 200, r.text
        else:
            _error(r, 400, param=param, code="invalid_type")
        assert client.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("what", ["grammar check", "chat template", "tokenize", "completion encode", "responses"])
def test_slow_request_preparation_runs_off_the_event_loop(server, monkeypatch, what):
    """A schema's grammar check and a prompt's tokenization can take seconds (a ``pattern`` with a repeat count in
    the thousands; megabytes of text): on the event loop they stalled every stream and /health for as long (a
    robustness audit: 29 s). Here each is held until /health has answered meanwhile."""
    url, fake, _ = server
    entered, gate = threading.Event(), threading.Event()

    def held(fn):
        def wrapper(*args, **kwargs):
            entered.set()
            gate.wait(20)
            return fn(*args, **kwargs)
        return wrapper

    body = {"max_tokens": 2}
    if what == "grammar check":
        from engine.server import protocol
        monkeypatch.setattr(protocol, "check", held(protocol.check))
        path, body = "/v1/chat/completions", {**body, "messages": MESSAGES, "response_format": JSON_SCHEMA}
    elif what == "completion encode":  # without special tokens: encoded on the event loop before
        monkeypatch.setattr(fake.tokenizer, "encode", held(fake.tokenizer.encode))
        path, body = "/v1/completions", {**body, "prompt": "hi", "add_special_tokens": False}
    else:
        monkeypatch.setattr(fake.tokenizer, "apply_chat_template", held(fake.tokenizer.apply_chat_template))
        path, body = {"chat template": ("/v1/chat/completions", {**body, "messages": MESSAGES}),
                      "tokenize": ("/tokenize", {"messages": MESSAGES}),
                      "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 2})}[what]
    result = {}
    client = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}{path}", json=body, timeout=30)))
    client.start()
    try:
        assert entered.wait(10)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the loop serves while it is held
    finally:
        gate.set()
        client.join(30)
    assert result["r"].status_code == 200, result["r"].text


def test_null_means_the_default(server):
    """OpenAI's spec makes these nullable; clients that send every field send ``null``: the default, never a 400."""
    url, _, _ = server
    nulls = {"n": None, "stream": None, "ignore_eos": None, "min_tokens": None, "skip_special_tokens": None,
             "include_stop_str_in_output": None, "stream_options": None, "temperature": None}
    chat = httpx.post(f"{url}/v1/chat/completions",
                      json={"messages": MESSAGES, "logprobs": None, "max_tokens": 5, **nulls}).json()
    assert [c["message"]["content"] for c in chat["choices"]] == [fake_completion(CHAT_PROMPT_LEN,
                                                                                  SamplingParams(max_tokens=5))[0]]
    assert chat["choices"][0]["logprobs"] is None
    done = httpx.post(f"{url}/v1/completions", json={"prompt": "hey", "echo": None, "logprobs": None,
                                                     "add_special_tokens": None, "max_tokens": 4, **nulls}).json()
    assert done["choices"][0]["text"] == fake_completion(3, SamplingParams(max_tokens=4))[0]
    empty = httpx.post(f"{url}/v1/completions", json={"prompt": "hey", "max_tokens": 1, "stream_options": {}})
    assert empty.status_code == 200, empty.text  # vLLM refuses only non-empty stream_options without stream
    events = sse_events(url, "/v1/completions", {"prompt": "hey", "max_tokens": 2, "stream": True,
                                                 "stream_options": {"include_usage": None}})
    assert events[-1] == "[DONE]" and all(json.loads(e).get("usage") is None for e in events[:-1])  # no usage
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "hey", "add_special_tokens": None}).json()
    assert tok["tokens"] == [104, 101, 121]


def test_unsupported_features_pass_when_they_ask_for_nothing(server):
    """tools with tool_choice "none" and an empty logit_bias are accepted (and a text response_format); the tools
    still reach the chat template, as in vLLM."""
    url, _, _ = server
    accepted = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
                "response_format": {"type": "text"}, "logit_bias": {}}
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, **accepted})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == CHAT_PROMPT_LEN + len("<tool f>")  # the template saw the tools
    counted = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, "tools": accepted["tools"]}).json()
    assert counted["count"] == r.json()["usage"]["prompt_tokens"]  # /tokenize renders them the same way


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_named_tool_choice_constrains_the_output_and_returns_a_tool_call(server):
    """vLLM without a tool-call parser: a named function is a JSON-schema constraint (its parameters), the output
    its call's arguments, content "", finish_reason the engine's; the SDK reads it, streamed (id, type and name in
    the first delta, then arguments) or not."""
    from engine.sampling_params import StructuredOutputsParams
    url, fake, _ = server
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, tools=[WEATHER_TOOL],
              tool_choice={"type": "function", "function": {"name": "weather"}})
    r = sdk(url).chat.completions.create(**kw)
    want = StructuredOutputsParams(json=WEATHER_TOOL["function"]["parameters"])
    assert fake.params[-1].structured_outputs == want
    choice = r.choices[0]
    text, reason = fake_completion(CHAT_PROMPT_LEN + len("<tool weather>"), fake.params[-1])
    assert choice.message.content == "" and choice.finish_reason == reason
    assert [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("function", "weather", text)]
    deltas = [c.choices[0].delta for c in sdk(url).chat.completions.create(stream=True, **kw) if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].id.startswith("chatcmpl-tool-") and calls[0].function.name == "weather"
    assert all(c.id is None and c.function.name is None and c.index == 0 for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == text
    assert not any(d.content for d in deltas)


def test_auto_tool_choice_reads_hermes_calls_out_of_the_text():
    """tools without tool_choice ("auto") on a model whose template writes <tool_call> blocks: the output is free
    (no constraint; special tokens kept, as vLLM's hermes parser asks), its blocks the message's tool_calls, the
    text before them the content, finish_reason "tool_calls"; streamed the same; a model without such a template,
    or the server's tool_call_parser "none", refuses it with a 400 naming tool_choice, and "hermes" forces it."""
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    reply = f'Checking.<tool_call>\n{call}\n</tool_call>\n<tool_call>{{"name": "time", "arguments": {{}}}}</tool_call>'

    fake = FakeEngine(max_model_len=512, reply=reply)
    fake.tokenizer.chat_template = "{% for t in tools %}{{ t }}{% endfor %} <tool_call> ... </tool_call>"
    engine, srv = serve(fake)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=300, tools=[WEATHER_TOOL])
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        r = sdk(url).chat.completions.create(**kw)
        assert fake.params[-1].structured_outputs is None and fake.params[-1].skip_special_tokens is False
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("function", "weather", {"city": "Paris"}), ("function", "time", {})]
        full = sdk(url).chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
        chunks = list(sdk(url).chat.completions.create(stream=True, n=2, logprobs=True, **kw))
        for index in (0, 1):  # each choice its own stream state
            mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
            assert "".join(m.delta.content or "" for m in mine) == "Checking."
            calls = [t for m in mine for t in m.delta.tool_calls or []]
            assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
                (0, "weather", {"city": "Paris"}), (1, "time", {})] and calls[0].id.startswith("chatcmpl-tool-")
            assert mine[-1].finish_reason == "tool_calls"
            streamed = [t for m in mine if m.logprobs for t in m.logprobs.content]
            assert [t.token for t in streamed] == [t.token for t in full] and len(full) == len(reply)
        plain = sdk(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300)  # no tools
        assert plain.choices[0].message.content == reply and plain.choices[0].finish_reason == "stop"
        one = sdk(url).chat.completions.create(parallel_tool_calls=False, **kw).choices[0]  # OpenAI: one call at most
        assert [c.function.name for c in one.message.tool_calls] == ["weather"] and one.finish_reason == "tool_calls"
        deltas = [c.choices[0] for c in sdk(url).chat.completions.create(stream=True, parallel_tool_calls=False, **kw)]
        assert [t.function.name for d in deltas for t in d.delta.tool_calls or []] == ["weather"]
    engine.shutdown()
    for parser, template in (("auto", None), ("none", fake.tokenizer.chat_template)):
        other = FakeEngine(max_model_len=512, reply=reply)
        other.tokenizer.chat_template = template
        engine, srv = serve(other, tool_call_parser=parser)
        with srv as url:
            wait_for(lambda: engine.is_ready, what="engine ready")
            bad = httpx.post(f"{url}/v1/chat/completions", json={**kw, "tools": [WEATHER_TOOL]}, timeout=20)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice", bad.text
            why = "tool_call_parser is none" if parser == "none" else "asks for no format this server reads"
            assert "tool-call parser" in bad.json()["error"]["message"] and why in bad.json()["error"]["message"]
        engine.shutdown()
    forced = FakeEngine(max_model_len=512, reply=reply)  # no template, tool_call_parser "hermes"
    engine, srv = serve(forced, tool_call_parser="hermes")
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        assert sdk(url).chat.completions.create(**kw).choices[0].message.tool_calls[0].function.name == "weather"
    engine.shutdown()
    with pytest.raises(ValueError, match="tool_call_parser"):
        serve(FakeEngine(), tool_call_parser="pythonic")


def test_auto_tool_choice_reads_a_llama3_json_call():
    """A Llama 3.1-style template (a "parameters" dictionary asked for): the whole output is the call, no content;
    streamed, nothing before the call."""
    fake = FakeEngine(reply='{"name": "weather", "parameters": {"city": "Paris"}}')
    fake.tokenizer.chat_template = 'Respond in the format {"name": function name, "parameters": dictionary of ...}'
    engine, srv = serve(fake)
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=100, tools=[WEATHER_TOOL])
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        choice = sdk(url).chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("weather", {"city": "Paris"})]
        deltas = [c.choices[0] for c in sdk(url).chat.completions.create(stream=True, **kw) if c.choices]
        assert not any(d.delta.content for d in deltas) and deltas[-1].finish_reason == "tool_calls"
        assert [t.function.name for d in deltas for t in d.delta.tool_calls or []] == ["weather"]
    engine.shutdown()


def test_required_tool_choice_asks_for_an_array_of_calls_and_keeps_text_that_is_not_one(server):
    """"required": the schema is a non-empty array of {name, parameters} (one per tool); the fake's output is not
    such JSON (as an output cut by max_tokens), so it comes back as the content, streamed whole at the end."""
    url, fake, _ = server
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=12, tools=[WEATHER_TOOL], tool_choice="required")
    r = sdk(url).chat.completions.create(**kw)
    schema = fake.params[-1].structured_outputs.json
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["weather"]
    text, _ = fake_completion(CHAT_PROMPT_LEN + len("<tool weather>"), fake.params[-1])
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    deltas = [c.choices[0].delta for c in sdk(url).chat.completions.create(stream=True, **kw) if c.choices]
    assert [d.content for d in deltas if d.content] == [text]  # nothing streamed before the array was complete


def test_response_format_reaches_the_engine_as_structured_outputs(server):
    """OpenAI's response_format on both endpoints (as vLLM): json_object, json_schema's schema, text (none)."""
    from engine.sampling_params import StructuredOutputsParams
    url, fake, _ = server
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        for fmt, want in (({"type": "json_object"}, StructuredOutputsParams(json_object=True)),
                          ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                           StructuredOutputsParams(json=schema)),
                          ({"type": "text"}, None)):
            before = len(fake.compiled)
            r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2, "response_format": fmt})
            assert r.status_code == 200, r.text
            assert fake.params[-1].structured_outputs == want
            compiled = fake.compiled[before:]  # once, on a worker thread, handed over with the request
            if want is None:
                assert compiled == [] and fake.grammars[-1] is None
            else:
                assert [g[:2] for g in compiled] == [("grammar", want)] and compiled[0][2] != "llm-engine"
                assert fake.grammars[-1] is compiled[0]


def test_vllm_structured_outputs_reach_the_engine(server):
    """vLLM's extra parameter ``structured_outputs`` on both endpoints; its unset keys (null, false) as vLLM's
    client may send them are left out."""
    from engine.sampling_params import StructuredOutputsParams
    url, fake, _ = server
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        for given, want in (({"choice": ["a", "b"], "json": None, "json_object": False},
                             StructuredOutputsParams(choice=["a", "b"])),
                            ({"regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
                            ({"grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
                            ({"json": {"type": "object"}}, StructuredOutputsParams(json={"type": "object"})),
                            ({"json_object": True, "disable_any_whitespace": True, "disable_fallback": True},
                             StructuredOutputsParams(json_object=True, disable_any_whitespace=True))):
            text = {"response_format": {"type": "text"}} if "choice" in given else {}  # with it and without
            r = httpx.post(f"{url}{path}", json={**body, **text, "max_tokens": 2, "structured_outputs": given})
            assert r.status_code == 200, r.text
            assert fake.params[-1].structured_outputs == want and fake.grammars[-1][1] == want


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


class UncompilableFake(FakeEngine):
    def compile(self, spec):
        raise ValueError("structured_outputs: not a JSON schema this server can follow (test)")


class SlowCompileFake(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.compiling = threading.Event(), threading.Event()

    def compile(self, spec):
        self.compiling.set()
        self.gate.wait(20)
        return super().compile(spec)


def test_a_grammar_that_fails_to_compile_is_a_400_and_nothing_is_kept():
    fake = UncompilableFake()
    engine, srv = serve(fake)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                           ("/v1/completions", {"prompt": ["a", "b", "c"]})):
            r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2, "response_format": JSON_SCHEMA})
            assert r.status_code == 400 and "(test)" in r.json()["error"]["message"], r.text
        assert engine.num_requests == 0 and fake.params == []
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    engine.shutdown()


def test_a_schema_no_grammar_can_follow_is_a_400_while_the_model_loads():
    """Not the 503 of a loading model, which the SDKs retry: this request can never succeed."""
    gate = threading.Event()
    engine, srv = serve(gate=gate)
    with srv as url:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "response_format": bad})
        _error(r, 400, param="response_format", code="invalid_value")
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}).status_code == 503
        gate.set()
    engine.shutdown()


def test_a_client_gone_while_its_grammar_compiles_leaves_nothing():
    fake = SlowCompileFake()
    engine, srv = serve(fake)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        body = {"messages": MESSAGES, "max_tokens": 2, "response_format": JSON_SCHEMA}
        outcome = {}

        def ask() -> None:
            try:
                outcome["answer"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
            except httpx.HTTPError as e:  # an assertion failing in this thread would not fail the test
                outcome["error"] = e
        client = threading.Thread(target=ask)
        client.start()
        assert fake.compiling.wait(10)
        assert engine.num_requests == 1  # registered (admission control) before it compiles
        client.join()
        assert type(outcome.get("error")) is httpx.ReadTimeout, outcome  # it gave up while the grammar compiled
        fake.gate.set()  # the server sees the disconnect once the request is in, and aborts it there
        wait_for(lambda: engine.num_requests == 0 and not fake.waiting and not fake.running, what="it released")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and engine.num_requests == 0
    engine.shutdown()


def test_bos_for_completions_and_tokenize_not_for_chat(server):
    """vLLM: string prompts of ``/v1/completions`` get the tokenizer's special tokens unless
    ``add_special_tokens: false``; chat prompts never (the template has them); ``/tokenize`` agrees with both."""
    url, fake, _ = server
    fake.tokenizer.bos_token_id = 1
    usage = lambda path, body: httpx.post(f"{url}{path}", json={"max_tokens": 1, **body}).json()["usage"]
    assert usage("/v1/completions", {"prompt": "hey"})["prompt_tokens"] == 4
    assert usage("/v1/completions", {"prompt": "hey", "add_special_tokens": False})["prompt_tokens"] == 3
    assert usage("/v1/completions", {"prompt": [104, 101, 121]})["prompt_tokens"] == 3  # ids as given
    assert usage("/v1/chat/completions", {"messages": MESSAGES})["prompt_tokens"] == CHAT_PROMPT_LEN
    assert httpx.post(f"{url}/tokenize", json={"prompt": "hey"}).json()["tokens"] == [1, 104, 101, 121]
    assert httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["count"] == CHAT_PROMPT_LEN
    with_bos = {"messages": MESSAGES, "add_special_tokens": True}  # vLLM: for messages only when asked
    assert httpx.post(f"{url}/tokenize", json=with_bos).json()["count"] == CHAT_PROMPT_LEN + 1
    unset = {"messages": MESSAGES, "add_special_tokens": None}
    assert httpx.post(f"{url}/tokenize", json=unset).json()["count"] == CHAT_PROMPT_LEN


def test_tokenize_renders_messages_as_the_chat_endpoint_does(server):
    url, _, _ = server
    body = {"messages": MESSAGES, "chat_template_kwargs": {"prefix": "<sys>"}}
    assert httpx.post(f"{url}/tokenize", json=body).json()["count"] == CHAT_PROMPT_LEN + 5
    chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == CHAT_PROMPT_LEN + 5


def test_continue_final_message_leaves_the_last_message_open(server):
    url, _, _ = server
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "The capital is"}],
            "add_generation_prompt": False, "continue_final_message": True}
    expected = FakeTokenizer().apply_chat_template(body["messages"], continue_final_message=True)
    assert expected.endswith("The capital is")
    tok = httpx.post(f"{url}/tokenize", json=body).json()
    assert tok["tokens"] == [ord(c) for c in expected]
    chat = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == len(expected)
    # vLLM's echo: the answer starts with the open message's text, streamed first after the role
    echo = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 3, "echo": True}).json()
    answer = chat["choices"][0]["message"]["content"]
    assert echo["choices"][0]["message"]["content"] == "The capital is" + answer
    chunks = [json.loads(e) for e in sse_events(url, "/v1/chat/completions",
                                               {**body, "max_tokens": 3, "echo": True, "stream": True})[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks]
    assert deltas[:2] == ["", "The capital is"] and "".join(d or "" for d in deltas) == "The capital is" + answer
    asked = {"messages": MESSAGES, "max_tokens": 3}  # the last message is the user's: nothing echoed
    plain = httpx.post(f"{url}/v1/chat/completions", json={**asked, "echo": True}).json()["choices"][0]["message"]
    assert plain["content"] == httpx.post(f"{url}/v1/chat/completions", json=asked).json()["choices"][0][
        "message"]["content"]


def test_list_content_is_its_text_parts_one_per_line_and_other_parts_are_refused(server):
    """vLLM joins a message's text parts with newlines; an image part is a 400 naming messages.content."""
    url, _, _ = server
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_list = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()
    as_text = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hello\nthere"}]}).json()
    assert as_list["tokens"] == as_text["tokens"]
    image = [*parts, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]})
    assert "only text parts are supported" in _error(r, 400, param="messages.content")["message"]


def test_malformed_json_and_unknown_routes(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi",', headers={"content-type": "application/json"})
    _error(r, 400, param="body", code="invalid_json")
    for body in (b'{"prompt": "\xff"}', b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"):  # not UTF-8; too deep
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "does not decode" in _error(r, 400, param="body", code="invalid_json")["message"]
    _error(httpx.get(f"{url}/v1/nothing-here"), 404)
    _error(httpx.post(f"{url}/v1/completions", json={"prompt": []}), 400, param="prompt")
    form = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi"}',  # curl -d without -H: a form
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert _error(form, 400, param="body")["message"] == (
        "body: send a JSON object with the header Content-Type: application/json (got "
        "application/x-www-form-urlencoded)")
    bare = _error(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi"}'), 400, param="body")
    assert bare["message"].endswith("(got no Content-Type)")
    listed = _error(httpx.post(f"{url}/v1/completions", json=["hi"]), 400, param="body")  # JSON, not an object
    assert "Content-Type" not in listed["message"]
    upper = httpx.post(f"{url}/v1/completions", content=b'["hi"]', headers={"content-type": "Application/JSON"})
    assert "Content-Type" not in _error(upper, 400, param="body")["message"]  # media types ignore case


def test_models_retrieve_gives_the_served_models_card_and_404_for_another(server):
    url, _, _ = server
    card = sdk(url).models.retrieve(MODEL)
    assert (card.id, card.object, card.max_model_len) == (MODEL, "model", 256)
    with pytest.raises(openai.NotFoundError) as info:
        sdk(url).models.retrieve("org/other-model")
    assert info.value.code == "model_not_found" and info.value.body["param"] == "model"


def test_request_ids_come_from_the_header_then_the_body_field_and_go_back_in_a_header(server, monkeypatch):
    url, fake, engine = server
    client = sdk(url)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                                          extra_headers={"X-Request-Id": "trace-7"})
    assert raw.parse().id == "chatcmpl-trace-7" and raw.headers["x-request-id"] == "trace-7"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2,
                                                      extra_body={"request_id": "mine"})
    assert raw.parse().id == "cmpl-mine" and len(raw.headers["x-request-id"]) == 32  # a fresh one for the header
    both = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"request_id": "body"},
                                     extra_headers={"X-Request-Id": "head"})
    assert both.id == "cmpl-head"  # vLLM's precedence: the header
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert raw.parse().id == f"chatcmpl-{raw.headers['x-request-id']}"  # no id given: one fresh id for both
    assert httpx.get(f"{url}/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
    # a client's id sent again while a request under it runs (a proxy's retry, say): both run, as in current vLLM,
    # whose engine ids are made unique: here the client's id with a random suffix
    fake.step_delay = 0.01
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": "dup"}, timeout=20) as r:
        lines = r.iter_lines()  # held: a generator over it, collected, would close the stream (an abort)
        next(line for line in lines if line.startswith("data: "))
        running = [r["request_id"] for r in httpx.get(f"{url}/v1/kv").json()["running"]]
        assert len(running) == 1 and running[0].startswith("cmpl-dup-")
        again = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 3},
                           headers={"X-Request-Id": "dup"})
        assert again.status_code == 200 and again.json()["id"] == "cmpl-dup"
    # a 500 (answered outside the id layer) carries it too
    wait_for(lambda: engine.num_requests == 0 and not fake.running, what="the stream aborted")
    monkeypatch.setattr(fake.tokenizer, "decode", lambda ids, **kw: 1 / 0)
    broken = httpx.post(f"{url}/detokenize", json={"tokens": [104]}, headers={"X-Request-Id": "r500"})
    assert broken.status_code == 500 and broken.headers["x-request-id"] == "r500"


def test_unknown_fields_are_ignored_with_a_warning_naming_them(server, caplog):
    url, _, _ = server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    with caplog.at_level("WARNING", logger="engine.server.protocol"):
        plain = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert plain.status_code == 200 and "ignored" not in caplog.text
        extra = httpx.post(f"{url}/v1/chat/completions", json={**body, "guided_json": {"type": "object"},
                                                               "guided_choice": ["a"]})
    assert extra.status_code == 200
    assert extra.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    assert ("The following fields were present in the request but ignored: ['guided_choice', 'guided_json']"
            in caplog.text)


def test_chat_fields_vllm_declares_reach_the_template_or_are_refused_without_a_warning(server, caplog):
    """``reasoning_effort`` and ``documents`` are template variables, over chat_template_kwargs, and the effort
    "none" sets ``enable_thinking`` false (unless chat_template_kwargs set it), as current vLLM gives them;
    ``parallel_tool_calls`` and ``include_reasoning`` are fields (tests in test_server_tools.py and
    test_server_reasoning.py), not unknown ones; a request's ``chat_template`` (chat or /tokenize) and an unknown
    effort are 400s."""
    url, fake, _ = server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}

    def prompt(**fields) -> str:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **fields})
        assert r.status_code == 200, r.text
        return "".join(map(chr, fake.prompts[-1]))

    plain, closed = prompt(), "<think>\n\n</think>\n\n"  # the fake's template with enable_thinking false
    with caplog.at_level("WARNING", logger="engine.server.protocol"):
        assert prompt(reasoning_effort="low") == "Reasoning: low\n" + plain
        assert prompt(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == (
            "Reasoning: low\n" + plain)
        assert prompt(reasoning_effort="none") == "Reasoning: none\n" + plain + closed
        assert prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == (
            "Reasoning: none\n" + plain)
        assert prompt(documents=[{"title": "Paris", "text": "..."}]) == "<doc Paris>" + plain
        assert prompt(parallel_tool_calls=False, include_reasoning=False) == plain
    assert "ignored" not in caplog.text
    for path, field, value, message in [
            ("/v1/chat/completions", "reasoning_effort", "extreme", "must be one of none, minimal, low, medium"),
            ("/v1/chat/completions", "chat_template", "{{ messages }}", "cannot replace the chat template"),
            ("/tokenize", "chat_template", "{{ messages }}", "cannot replace the chat template")]:
        r = httpx.post(f"{url}{path}", json={**body, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert message in r.json()["error"]["message"]


def test_chat_template_kwargs_set_the_template_call_as_vllm_and_its_call_arguments_are_dropped(server):
    """vLLM lays chat_template_kwargs over the request's add_generation_prompt / continue_final_message and drops
    what is not a template variable (tokenize, max_length, ...: here a TypeError's text in a 400 once)."""
    url, _, _ = server

    def tokens(**fields):
        r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, **fields})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    plain = tokens()
    assert tokens(chat_template_kwargs={"add_generation_prompt": False}) == tokens(add_generation_prompt=False)
    assert tokens(chat_template_kwargs={"add_generation_prompt": False}) != plain
    assert tokens(chat_template_kwargs={"tokenize": True, "max_length": 5, "padding": True}) == plain
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                       "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 200, r.text


def test_the_developer_role_is_the_system_role_unless_the_template_names_it(server):
    url, fake, _ = server

    def tokens(role):
        messages = [{"role": role, "content": "Be brief."}, *MESSAGES]
        return httpx.post(f"{url}/tokenize", json={"messages": messages})

    assert tokens("developer").json()["tokens"] == tokens("system").json()["tokens"]
    fake.tokenizer.chat_template = "{% if message.role == 'developer' %}...{% endif %}"  # a template that knows it
    err = _error(tokens("developer"), 400, param="messages")  # the fake's template then gets the role (and refuses)
    assert "unknown role 'developer'" in err["message"]


def test_unknown_model_is_404(server):
    url, _, _ = server
    with pytest.raises(openai.NotFoundError) as info:
        sdk(url).chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert info.value.code == "model_not_found" and info.value.type == "invalid_request_error"  # OpenAI's


def test_context_length_error_states_max_total_and_split(server):
    url, _, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        sdk(url).completions.create(model=MODEL, prompt="x" * 200, max_tokens=100)
    assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "prompt"
    assert info.value.body["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens (200 in the prompt, "
        "100 in the completion). Please reduce the length of the prompt or completion.")


def test_context_length_error_names_the_messages_for_chat(server):
    url, _, _ = server
    messages = [{"role": "user", "content": "y" * 150}]
    prompt_len = len(FakeTokenizer().apply_chat_template(messages, add_generation_prompt=True))
    err = _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 100}), 400,
                 param="messages", code="context_length_exceeded")
    assert err["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {prompt_len + 100} tokens "
        f"({prompt_len} in the messages, 100 in the completion). Please reduce the length of the messages or "
        f"completion.")


@pytest.mark.parametrize("path,body,where", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 300}]}, "messages"),
    ("/v1/completions", {"prompt": "z" * 256, "max_tokens": None}, "prompt"),
])
def test_prompt_alone_over_the_context_without_max_tokens(server, path, body, where):
    """No max_tokens: the completion gets what is left, so only the prompt's length is wrong (vLLM's wording)."""
    url, _, _ = server
    prompt_len = CHAT_PROMPT_LEN - len(MESSAGES[0]["content"]) + 300 if where == "messages" else 256
    err = _error(httpx.post(f"{url}{path}", json=body), 400, param=where, code="context_length_exceeded")
    assert err["message"] == (f"This model's maximum context length is 256 tokens. However, you requested "
                              f"{prompt_len} tokens in the {where}. Please reduce the length of the {where}.")


def test_api_key_guards_v1_only():
    engine, srv = serve(api_key="sekrit")
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        with pytest.raises(openai.AuthenticationError):
            sdk(url, api_key="wrong").models.list()
        refused = httpx.post(f"{url}/v1/chat/completions", content=b"{oops", headers={"X-Request-Id": "r401"})
        err = _error(refused, 401, code="invalid_api_key")
        assert err["type"] == "invalid_request_error"  # OpenAI's type for a wrong key
        assert refused.headers["x-request-id"] == "r401"  # the id layer is outside the key check
        assert sdk(url, api_key="sekrit").models.list().data[0].id == MODEL
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
    engine.shutdown()


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_lets_pages_of_this_machine_in_and_the_api_key_lets_preflights_through():
    """By default (as Ollama) a page served from this machine may call the API from a browser, another site's may
    not; with an API key the preflight (which never carries it) still passes, and a 401 names the page's origin so
    that its script can read the error."""
    engine, srv = serve(api_key="sekrit")
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        for origin in ("http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443"):
            r = _preflight(url, origin)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
        for origin in ("https://evil.example", "http://localhost.evil.example", "http://localhost:3000.evil"):
            r = _preflight(url, origin)
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, origin
        page = {"Origin": "http://localhost:5173"}
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, headers=page)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        r = httpx.get(f"{url}/v1/models", headers={**page, "Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert r.headers["access-control-expose-headers"].lower() == "x-request-id"  # the page may read it
        r = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    engine.shutdown()


@pytest.mark.parametrize("setting, allowed, refused", [
    ("*", ["https://evil.example", "http://localhost:3000"], []),
    ("", [], ["http://localhost:3000"]),
    ('["chrome-extension://*", "https://ui.example.com"]', ["chrome-extension://abcdef", "https://ui.example.com"],
     ["http://localhost:3000", "https://ui.example.com:444"]),
    ("http://localhost:3000, https://ui.example.com:*", ["http://localhost:3000", "https://ui.example.com:8443"],
     ["http://localhost:3001", "http://ui.example.com"]),
    ("https://*.example.com", ["https://a.example.com", "https://a-b.c.example.com"],
     ["https://evil.com#.example.com", "https://evil.com/.example.com", "https://a.example.com.evil"]),
])
def test_allowed_origins_setting(setting, allowed, refused):
    engine, srv = serve(allowed_origins=setting)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        for origin in allowed:
            r = _preflight(url, origin)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
        for origin in refused:
            r = httpx.get(f"{url}/v1/models", headers={"Origin": origin})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, origin
    engine.shutdown()
    with pytest.raises(ValueError, match="allowed_origins: not a JSON list"):
        build_app(engine, allowed_origins="[oops")
    import re

    from engine.server.cors import origin_regex
    pattern = origin_regex(setting)  # whole origins even for a plain re.match, not only Starlette's fullmatch
    assert pattern is None or all(not re.match(pattern, o) for o in refused)


def test_health_is_503_while_loading_then_200():
    gate = threading.Event()
    engine, srv = serve(gate=gate)
    with srv as url:
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.get(f"{url}/v1/models")
        _error(r, 503, code="model_loading")
        assert r.headers["retry-after"] == "5"
        gate.set()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, what="health 200")
    engine.shutdown()


def test_health_says_a_sleeping_engine_sleeps_and_stays_200():
    from appliance.installer import SLEEPING, server_health

    fake = FakeEngine()
    engine, srv = serve(fake)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        awake = (httpx.get(f"{url}/health").json(), server_health(url))
        fake.asleep = True  # as EngineProcess.asleep after sleep_after_idle_s
        asleep = (httpx.get(f"{url}/health"), server_health(url))
    engine.shutdown()
    assert awake[0] == {"status": "ready", "model": "fake-model"} and (awake[1].state, awake[1].detail) == (
        "ready", "ready")
    assert asleep[0].status_code == 200 and asleep[0].json() == {"status": "ready", "model": "fake-model",
                                                                   "asleep": True}
    assert (asleep[1].state, asleep[1].detail) == ("ready", SLEEPING)


def test_dead_engine_gives_503_not_500():
    engine, srv = serve(FakeEngine(fail_at_step=0))
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=20)
        _error(r, 503, code="engine_dead")
        assert httpx.get(f"{url}/health").status_code == 503
        _error(httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}), 503, code="engine_dead")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": True})
        _error(r, 503, code="engine_dead")  # refused before the stream starts


def test_engine_death_mid_stream_ends_the_stream_with_an_error_event():
    engine, srv = serve(FakeEngine(fail_at_step=3))
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        events = sse_events(url, "/v1/completions", {"prompt": "hi", "max_tokens": 10, "stream": True})
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2]) == REPLY[2:5]
    engine.shutdown()


def test_metrics_names_and_values(server):
    url, _, _ = server
    fresh = set(httpx.get(f"{url}/metrics").text.splitlines())
    for reason in ("stop", "length", "abort"):  # at 0 before any request finishes, as vLLM
        assert f'vllm:request_success_total{{finished_reason="{reason}",model_name="fake-model"}} 0.0' in fresh
    sdk(url).completions.create(model=MODEL, prompt="12345", max_tokens=7)
    text = httpx.get(f"{url}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:cache_config_info"]:
        assert f"\n{name}" in text, name
    lines = set(text.splitlines())
    assert 'vllm:prompt_tokens_total{model_name="fake-model"} 5.0' in lines
    assert 'vllm:generation_tokens_total{model_name="fake-model"} 7.0' in lines
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in lines
    assert 'vllm:time_to_first_token_seconds_count{model_name="fake-model"} 1.0' in lines
    assert 'vllm:inter_token_latency_seconds_count{model_name="fake-model"} 6.0' in lines
    assert 'vllm:num_requests_running{model_name="fake-model"} 0.0' in lines
    # the per-request series vLLM's Grafana dashboard also reads
    assert 'vllm:request_prompt_tokens_sum{model_name="fake-model"} 5.0' in lines
    assert 'vllm:request_generation_tokens_sum{model_name="fake-model"} 7.0' in lines
    assert 'vllm:request_max_num_generation_tokens_sum{model_name="fake-model"} 7.0' in lines
    assert 'vllm:request_params_n_sum{model_name="fake-model"} 1.0' in lines
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert f'vllm:{name}_count{{model_name="fake-model"}} 1.0' in lines, name
    assert "_created" not in text


def test_stream_disconnect_aborts_and_frees_blocks(server):
    url, fake, engine = server
    fake.step_delay = 0.01
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_for(lambda: engine.get_stats().num_running == 1, what="request running")
    request_id = json.loads(first[len("data: "):])["id"]
    wait_for(lambda: request_id in fake.aborted, what="abort after disconnect")
    wait_for(lambda: 'vllm:num_requests_running{model_name="fake-model"} 0.0' in httpx.get(f"{url}/metrics").text,
             what="running gauge back to 0")
    assert engine.get_stats().kv_cache_usage == 0
    lines = set(httpx.get(f"{url}/metrics").text.splitlines())
    # as vLLM V1: its first token counted in TTFT though it was aborted; no e2e latency for it
    assert 'vllm:time_to_first_token_seconds_count{model_name="fake-model"} 1.0' in lines
    assert 'vllm:e2e_request_latency_seconds_count{model_name="fake-model"} 0.0' in lines
    assert 'vllm:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in lines


def test_metrics_count_each_of_n_completions(server):
    """request_success and the latencies per completion (vLLM V1 runs each of n as a request; the engine's token
    counters count each completion's prompt too)."""
    url, _, _ = server
    sdk(url).completions.create(model=MODEL, prompt="12345", max_tokens=7, n=3)
    lines = set(httpx.get(f"{url}/metrics").text.splitlines())
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-model"} 3.0' in lines
    for name, count in (("time_to_first_token_seconds", 3), ("e2e_request_latency_seconds", 3),
                        ("request_queue_time_seconds", 3), ("inter_token_latency_seconds", 3 * 6),
                        ("request_generation_tokens", 3), ("request_decode_time_seconds", 3),
                        ("request_params_n", 1), ("request_max_num_generation_tokens", 1)):
        assert f'vllm:{name}_count{{model_name="fake-model"}} {count:.1f}' in lines, name
    assert 'vllm:request_params_n_sum{model_name="fake-model"} 3.0' in lines


def test_non_streaming_disconnect_aborts(server):
    url, fake, engine = server
    fake.step_delay = 0.02
    body = {"model": MODEL, "prompt": "slow", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(20, read=0.3))
    wait_for(lambda: len(fake.aborted) == 1, what="abort after disconnect")
    wait_for(lambda: engine.get_stats().num_running == 0, what="engine idle")


def test_overload_is_503_with_retry_after_and_keeps_nothing():
    """max_num_seqs 1 + max_waiting 2: three requests in the engine, the fourth is refused before anything is
    queued; a batched completion that does not fit is refused whole; freed room is usable at once."""
    fake = FakeEngine(max_num_seqs=1, step_delay=0.01)
    engine, srv = serve(fake, engine_kw={"config": EngineConfig(model=MODEL, max_num_seqs=1), "max_waiting": 2})
    long = {"prompt": "hold", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with srv as url, httpx.Client(base_url=url, timeout=20) as client:
        wait_for(lambda: engine.is_ready, what="engine ready")
        assert engine.max_requests == 3
        held = [client.stream("POST", "/v1/completions", json=long) for _ in range(3)]
        for h in held:
            assert h.__enter__().status_code == 200  # headers come once the engine took the request

        def overloaded(r: httpx.Response) -> None:
            err = _error(r, 503, code="server_overloaded")
            assert err["type"] == "service_unavailable_error" and r.headers["retry-after"] == "1"
            assert err["message"] == ("The server is overloaded: 3 requests are already running or waiting "
                                      "(max_waiting=2); retry later.")

        overloaded(client.post("/v1/chat/completions", json={"messages": MESSAGES}))
        overloaded(client.post("/v1/completions", json={**long, "max_tokens": 3}))
        assert engine.num_requests == 3 and len(fake.waiting) + len(fake.running) == 3
        held.pop().__exit__(None, None, None)  # one client leaves: its request is aborted
        wait_for(lambda: engine.num_requests == 2 and len(fake.waiting) + len(fake.running) == 2,
                 what="room for one")
        overloaded(client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}))
        wait_for(lambda: len(fake.waiting) + len(fake.running) == 2, what="the half-admitted batch aborted")
        assert engine.num_requests == 2
        too_big = client.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 3})
        assert "at most 3 at once" in _error(too_big, 400, param="prompt", code="invalid_value")["message"]
        assert engine.num_requests == 2  # a batch that can never fit is a 400, not a 503 to retry forever
        r = client.post("/v1/completions", json={"prompt": "fits", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == fake_completion(
            4, SamplingParams(max_tokens=3))[0]
        for h in held:
            h.__exit__(None, None, None)
        wait_for(lambda: engine.num_requests == 0 and not fake.waiting and not fake.running, what="engine empty")
    engine.shutdown()


def test_polls_stay_out_of_the_access_log():
    """GETs of /metrics, /v1/kv and /health (Prometheus, ``appliance top`` once a second, health checks) that
    succeed or get 503 while the model loads are left out of uvicorn's access log; other requests, and polls that
    fail otherwise, are logged. The filter survives uvicorn's own logging set-up, as ``run_server`` adds it before
    that runs."""
    import logging

    import uvicorn

    from engine.server.api_server import QuietPolls

    access = logging.getLogger("uvicorn.access")
    quiet = QuietPolls()
    access.addFilter(quiet)
    gate = threading.Event()
    engine, srv = serve(gate=gate)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    try:
        srv.server = uvicorn.Server(uvicorn.Config(srv.server.config.app, log_level="info"))  # logs access
        srv.thread = threading.Thread(target=srv.server.run, kwargs={"sockets": [srv.sock]}, daemon=True)
        assert quiet in access.filters
        access.addHandler(handler)
        with srv as url:
            assert httpx.get(f"{url}/health").status_code == 503  # loading: quiet
            gate.set()
            wait_for(lambda: engine.is_ready, what="engine ready")
            for path in ("/health", "/metrics", "/v1/kv", "/metrics?x=1", "/v1/models", "/v1/nothing"):
                httpx.get(f"{url}{path}")
    finally:
        gate.set()
        access.removeHandler(handler)
        access.removeFilter(quiet)
        engine.shutdown()
    assert [(r.args[2], r.args[4]) for r in records] == [("/v1/models", 200), ("/v1/nothing", 404)]


def test_the_models_generation_config_fills_what_a_request_leaves_out(server):
    """vLLM's --generation-config auto: the model's temperature / top_p / ... apply where the request has none; the
    request's own values win; the model's max_new_tokens caps max_tokens."""
    url, fake, _ = server
    fake.default_sampling = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    seen = []
    add = fake.add_request
    fake.add_request = lambda rid, prompt, params, **kw: seen.append(params) or add(rid, prompt, params, **kw)
    httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES}).raise_for_status()
    httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "max_tokens": 3,
                                                   "top_k": 4}).raise_for_status()
    httpx.post(f"{url}/v1/completions", json={"prompt": "hey", "max_tokens": 50}).raise_for_status()
    assert [(p.temperature, p.top_p, p.top_k, p.max_tokens) for p in seen] == [
        (0.6, 0.9, -1, 5), (0.0, 0.9, 4, 3), (0.6, 0.9, -1, 5)]


def test_streamed_echo_sends_each_choices_prompt_logprobs_once():
    """Two choices where the second's first output has no token yet (it was not scheduled): its prompt logprobs
    come once, with its first chunk, and its tokens' offsets continue after the prompt's."""
    import asyncio
    from types import SimpleNamespace

    from engine.outputs import CompletionOutput, RequestOutput
    from engine.server.protocol import CompletionRequest
    from engine.server.serving_completion import _chunks

    prompt, entries = [ord("a"), ord("b")], [None, {ord("b"): -1.5}]

    def output(first: str, second: str, done: bool) -> RequestOutput:
        choices = [CompletionOutput(i, t, [ord(c) for c in t], "length" if done else None, None,
                                    [{ord(c): -0.25} for c in t]) for i, t in enumerate((first, second))]
        return RequestOutput("r", "ab", prompt, choices, done, None, prompt_logprobs=entries)

    class Stream:
        def abort(self) -> None:
            pass

        def __aiter__(self):
            async def outputs():
                for o in (output("x", "", False), output("xy", "z", False), output("xy", "zw", True)):
                    yield o
            return outputs()

    req = CompletionRequest(model=MODEL, prompt="ab", n=2, max_tokens=2, logprobs=1, echo=True, stream=True)

    async def collect():
        return [c for chunk in [ch async for ch in _chunks(SimpleNamespace(model_name=MODEL), FakeTokenizer(), req,
                                                             [Stream()], "r", 0, ["ab"], False)]
                for c in json.loads(chunk)["choices"]]

    got = asyncio.run(collect())
    by_choice = {i: [(c["text"], c["logprobs"]["tokens"], c["logprobs"]["text_offset"]) for c in got
                     if c["index"] == i and c["logprobs"]["tokens"]] for i in (0, 1)}
    assert by_choice[0] == [("abx", ["a", "b", "x"], [0, 1, 2]), ("y", ["y"], [3])]
    assert by_choice[1] == [("ab", ["a", "b"], [0, 1]), ("z", ["z"], [2]), ("w", ["w"], [3])]


def test_add_request_cancelled_while_its_grammar_compiles_keeps_nothing():
    import asyncio

    from engine.sampling_params import StructuredOutputsParams
    fake = SlowCompileFake()
    engine = AsyncLLMEngine(lambda: fake, MODEL)
    engine.start()
    wait_for(lambda: engine.is_ready, what="engine ready")
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))

    async def cancelled() -> None:
        task = asyncio.create_task(engine.add_request("r1", "hi", params))
        while not fake.compiling.is_set():
            await asyncio.sleep(0.01)
        assert engine.num_requests == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    fake.gate.set()
    assert engine.num_requests == 0
    wait_for(lambda: fake.compiled, what="the abandoned compile to end")
    time.sleep(0.1)  # a step of the engine thread: the request must not reach it
    assert fake.params == []
    engine.shutdown()


def test_a_lagging_reader_of_one_stream_gets_the_newest_output_only():
    """``serving.merge`` reads a single request's stream directly, so outputs that piled up while the reader was
    busy come as one (the newest, cumulative) and the client gets one chunk for them, as vLLM sends under load. With
    several streams a task per stream forwards each output to one queue as it comes, so every one is read."""
    import asyncio
    from types import SimpleNamespace

    from engine.async_engine import RequestStream
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.server.serving import merge

    def output(rid, k):
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "a" * k, [7] * k, "length" if k == 3 else None)],
                             k == 3)

    async def read(rids):
        """The reader takes the first output, then is busy while outputs 2 and 3 arrive (the loop runs between)."""
        engine = SimpleNamespace(_abort_stream=lambda stream: None)
        streams = [RequestStream(engine, rid) for rid in rids]
        outputs = merge(streams)
        first = asyncio.ensure_future(outputs.__anext__())
        for k in (1, 2, 3):
            for stream in streams:
                stream._queue.put_nowait(output(stream.request_id, k))
            for _ in range(5):
                await asyncio.sleep(0)
        got = [await first] + [item async for item in outputs]
        return [(i, len(out.outputs[0].token_ids)) for i, out in got]

    assert asyncio.run(read(["r"])) == [(0, 1), (0, 3)]
    assert sorted(asyncio.run(read(["r", "s"]))) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]

    async def leave_early():
        """A reader that stops after the first output (a client gone): the request is aborted."""
        aborted = []
        stream = RequestStream(SimpleNamespace(_abort_stream=aborted.append), "r")
        stream._queue.put_nowait(output("r", 1))
        outputs = merge([stream])
        await outputs.__anext__()
        await outputs.aclose()
        return aborted == [stream]

    assert asyncio.run(leave_early())


def test_a_chunk_that_does_not_serialize_is_a_500_event_not_the_clients_fault(caplog):
    """pydantic's serialization error is a ValueError; mid-stream it is still reported as a server bug (500,
    logged), after the chunks sent before it."""
    import asyncio

    from engine.server.protocol import CompletionChoice, CompletionResponse
    from engine.server.serving import sse_response

    def chunk(logprobs) -> str:
        return CompletionResponse(id="c", created=0, model=MODEL,
                                  choices=[CompletionChoice(index=0, text="a", logprobs=logprobs)]).model_dump_json()

    async def chunks():
        yield chunk(None)
        yield chunk(object())

    async def read() -> list[str]:
        return [e["data"] async for e in sse_response(chunks()).body_iterator]

    events = asyncio.run(read())
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[1])["error"]
    assert error["type"] == "server_error" and error["message"].startswith("Internal server error")
    assert events[2] == "[DONE]"
    assert "error while streaming (a bug)" in caplog.text

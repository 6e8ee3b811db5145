"""``POST /v1/responses`` against the fake engine, read through the OpenAI SDK where it parses it: the answer the
chat endpoint gives for the same messages, incomplete at ``max_output_tokens``, the stream's events (their order,
numbers, and what the SDK's stream helper rebuilds from them), reasoning as its own item, structured output, and
400s naming what is not served."""
from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest

from engine.server.api_server import build_app
from test_server_fakes import FakeEngine, ServerThread, started_engine


@contextmanager
def server(fake: FakeEngine | None = None, **app_kw):
    fake = fake or FakeEngine(max_model_len=256)
    with started_engine(fake) as engine, ServerThread(build_app(engine, **app_kw)) as url:
        yield url, fake, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def chat(url: str, messages: list[dict], **options) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", "messages": messages, **options})
    assert r.status_code == 200, r.text
    return r.json()


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    """The stream's (event name, data) pairs."""
    out, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json={"model": "fake-model", "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                out.append((name, json.loads(line[5:])))
    return out


def test_a_response_answers_as_the_chat_endpoint_does():
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", input="Hello", instructions="Be brief.", temperature=0)
        want = chat(url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                    temperature=0)
    assert resp.output_text == want["choices"][0]["message"]["content"] and resp.status == "completed"
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "fake-model"
    assert [item.type for item in resp.output] == ["message"] and resp.output[0].id.startswith("msg_")
    assert resp.output[0].status == "completed" and resp.incomplete_details is None
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (want["usage"]["prompt_tokens"],
                                                                   want["usage"]["completion_tokens"])
    assert resp.usage.total_tokens == want["usage"]["total_tokens"] and resp.temperature == 0.0
    assert resp.instructions == "Be brief." and resp.store is False and resp.tools == []


def test_input_messages_take_text_parts_and_developer_is_system():
    messages = [{"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                {"type": "input_text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
                {"role": "user", "content": "d"}]
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", input=messages, max_output_tokens=30)
        want = chat(url, [{"role": "system", "content": "Rules."}, {"role": "user", "content": "a\nb"},
                          {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}], max_tokens=30)
    assert resp.output_text == want["choices"][0]["message"]["content"]


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", input="Hello", max_output_tokens=5)
    assert (resp.status, resp.incomplete_details.reason, resp.output[0].status) == ("incomplete",
                                                                                    "max_output_tokens", "incomplete")
    assert len(resp.output_text) == 5 and resp.usage.output_tokens == 5 and resp.max_output_tokens == 5


def test_the_stream_is_openai_s_events_and_adds_up_to_the_response():
    with server() as (url, fake, client):
        whole = client.responses.create(model="fake-model", input="Hello", max_output_tokens=12)
        got = events(url, {"input": "Hello", "max_output_tokens": 12})
        with client.responses.stream(model="fake-model", input="Hello", max_output_tokens=12) as stream:
            for _ in stream:
                pass
            rebuilt = stream.get_final_response()
    names = [name for name, _ in got]
    assert all(name == data["type"] for name, data in got)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    deltas = [data for name, data in got if name == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and len(deltas) >= 1
    assert names[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert "".join(d["delta"] for d in deltas) == whole.output_text == rebuilt.output_text
    final = got[-1][1]["response"]
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 12
    assert got[0][1]["response"]["status"] == "in_progress" and got[0][1]["response"]["id"] == final["id"]
    item = final["output"][0]
    assert item["id"] == deltas[0]["item_id"] == got[-2][1]["item"]["id"] and item["content"][0]["text"] == \
        whole.output_text
    assert rebuilt.status == "incomplete"


def test_reasoning_is_an_item_of_its_own_streamed_or_not():
    fake = FakeEngine(max_model_len=256, reply="<think>why not</think>the answer")
    with server(fake, reasoning_parser="deepseek_r1") as (url, _, client):
        resp = client.responses.create(model="fake-model", input="q")
        got = events(url, {"input": "q"})
        with client.responses.stream(model="fake-model", input="q") as stream:
            for _ in stream:
                pass
            rebuilt = stream.get_final_response()
    for r in (resp, rebuilt):
        assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == "the answer"
        assert r.output[0].content[0].text == "why not" and r.output[0].id.startswith("rs_")
    thought = "".join(d["delta"] for n, d in got if n == "response.reasoning_text.delta")
    said = "".join(d["delta"] for n, d in got if n == "response.output_text.delta")
    assert (thought, said) == ("why not", "the answer")
    indices = [d["output_index"] for n, d in got if n == "response.output_item.done"]
    assert indices == [0, 1] and got[-1][0] == "response.completed"


def test_a_json_schema_format_constrains_the_answer():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", input="q", max_output_tokens=4,
                                       text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
    assert fake.params[-1].structured_outputs.json == schema
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param, words", [
    ({"input": "q", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "chat/completions"),
    ({"input": "q", "conversation": "conv_1"}, "conversation", "keeps no conversations"),
    ({"input": "q", "background": True}, "background", "not supported"),
    ({"input": "q", "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"input": "q", "include": ["message.output_text.bogus"]}, "include.0", "message.output_text.logprobs"),
    ({"input": "q", "truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "q", "reasoning": {"effort": "extreme"}}, "reasoning", "effort must be one of"),
    ({"input": "q", "metadata": {"a": 1}}, "metadata.a", "valid string"),
    ({"input": "q", "tool_choice": "required"}, "tool_choice", "no tools are served"),
    ({"input": "q", "request_id": ""}, "request_id", "at least 1 character"),
    ({"input": "q", "n": 2}, "n", "one answer"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "only text parts"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input", "only message items"),
    ({"input": []}, "input", "at least one message"),
    ({"input": "q", "text": {"format": {"type": "xml"}}}, "text", "format.type must be"),
    ({"input": "q", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x" * 300}, "input", "maximum context length"),
    ({"input": "q", "response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "at least one message"),
])
def test_what_is_not_served_is_a_400_naming_it(body, param, words):
    with server() as (url, fake, client):
        r = httpx.post(url + "/v1/responses", json={"model": "fake-model", **body})
        missing = httpx.post(url + "/v1/responses", json={"model": "other", "input": "q"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    assert missing.status_code == 404 and fake.generation_tokens_total == 0


def test_an_engine_failing_mid_stream_ends_it_with_an_error_event():
    with server(FakeEngine(max_model_len=256, fail_at_step=3)) as (url, fake, client):
        got = events(url, {"input": "q", "max_output_tokens": 20})
    assert got[-1][0] == "error" and got[-1][1]["code"] == "engine_dead"
    assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
    assert "response.completed" not in [name for name, _ in got]


def test_strict_sdk_models_parse_the_response_and_every_event():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    with server() as (url, fake, client):
        body = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": "Hello"}).json()
        got = events(url, {"input": "Hello", "stream_options": {"include_obfuscation": False}})
    Response.model_validate(body, strict=True)
    adapter = TypeAdapter(ResponseStreamEvent)
    for _, data in got:
        adapter.validate_python(data, strict=True)
    assert got[-1][0] == "response.completed"


def test_reasoning_sent_back_is_left_out_and_empty_instructions_add_nothing():
    fake = FakeEngine(max_model_len=256, reply="<think>hm</think>yes")
    with server(fake, reasoning_parser="deepseek_r1") as (url, _, client):
        first = client.responses.create(model="fake-model", input="q")
        again = client.responses.create(model="fake-model", instructions="",
                                        input=[{"role": "user", "content": "q"}, *[i.model_dump() for i in
                                                                                   first.output],
                                               {"role": "user", "content": "more"}])
        want = chat(url, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "yes"},
                          {"role": "user", "content": "more"}])
    assert [i.type for i in first.output] == ["reasoning", "message"]
    assert again.usage.input_tokens == want["usage"]["prompt_tokens"]


def test_a_max_output_tokens_past_the_context_is_cut_to_what_it_holds():
    with server(FakeEngine(max_model_len=80, reply="x" * 200)) as (url, fake, client):
        resp = client.responses.create(model="fake-model", input="Hello", max_output_tokens=1000)
    assert resp.status == "incomplete" and resp.usage.total_tokens == 80
    assert resp.max_output_tokens == resp.usage.output_tokens  # the length the answer had room for (vLLM's echo)


@pytest.mark.parametrize("reply, limit, kinds, statuses, text", [
    ("<think>why not</think>yes", 10, ["reasoning"], ["incomplete"], ""),  # cut inside the reasoning
    ("", None, ["message"], ["completed"], ""),  # nothing said: an empty message
])
def test_edge_answers_stream_as_they_answer(reply, limit, kinds, statuses, text):
    fake = FakeEngine(max_model_len=256, reply=reply)
    with server(fake, reasoning_parser="deepseek_r1") as (url, _, client):
        resp = client.responses.create(model="fake-model", input="q", max_output_tokens=limit)
        got = events(url, {"input": "q", "max_output_tokens": limit})
    streamed = got[-1][1]["response"]["output"]
    for output in (resp.model_dump()["output"], streamed):
        assert [i["type"] for i in output] == kinds and [i["status"] for i in output] == statuses
    assert resp.output_text == text


def test_previous_response_id_is_not_found_as_nothing_is_stored():
    with server() as (url, fake, client):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model="fake-model", input="hi", previous_response_id="resp_x")
    assert info.value.status_code == 404 and info.value.code == "response_not_found"
    assert info.value.message.endswith("Response with id 'resp_x' not found.") and fake.params == []


def test_logprobs_come_where_include_asks_for_them_streamed_or_not():
    body = {"input": "Hello", "max_output_tokens": 6, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", **body)
        want = chat(url, [{"role": "user", "content": "Hello"}], max_tokens=6, logprobs=True,
                    top_logprobs=2)["choices"][0]["logprobs"]["content"]
        streamed = events(url, body)
        alone = client.responses.create(model="fake-model", input="Hello", max_output_tokens=6, top_logprobs=2)
    got = [lp.model_dump() for lp in resp.output[0].content[0].logprobs]
    assert got == want and len(got) == 6 and all(len(e["top_logprobs"]) == 2 for e in got)
    deltas = [lp for name, e in streamed if name == "response.output_text.delta" for lp in e["logprobs"]]
    done = next(e for name, e in streamed if name == "response.output_text.done")["logprobs"]
    final = next(e for name, e in streamed if name == "response.completed")["response"]
    assert deltas == done == final["output"][0]["content"][0]["logprobs"] == want
    assert alone.output[0].content[0].logprobs == [] and (resp.top_logprobs, alone.top_logprobs) == (2, 2)


def test_a_nan_logprob_is_null_in_valid_json():
    with server(FakeEngine(max_model_len=256, logprob=float("nan"))) as (url, fake, client):
        r = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": "Hello", "max_output_tokens": 2,
                                                    "include": ["message.output_text.logprobs"]})
    assert r.status_code == 200, r.text
    assert [e["logprob"] for e in r.json()["output"][0]["content"][0]["logprobs"]] == [None, None]


def tokens(url: str, messages: list[dict]) -> int:
    r = httpx.post(url + "/tokenize", json={"model": "fake-model", "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_truncation_auto_drops_the_oldest_messages_until_the_input_fits():
    system = {"role": "system", "content": "S"}
    turns = [{"role": role, "content": f"{role} {i} " + "x" * 20} for i in range(4) for role in ("user", "assistant")]
    turns.append({"role": "user", "content": "last"})
    with server(FakeEngine(max_model_len=256)) as (url, fake, client):
        refused = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": [system, *turns]})
        resp = client.responses.create(model="fake-model", input=[system, *turns], truncation="auto")
        # what fits: the system message and the last turns from a user message on, one token left for the answer
        fitting = [k for k in range(len(turns), 0, -1) if turns[-k]["role"] == "user"
                   and tokens(url, [system, *turns[-k:]]) < 256]
        too_long = httpx.post(url + "/v1/responses", json={"model": "fake-model", "truncation": "auto",
                                                           "input": [system, {"role": "user", "content": "y" * 300}]})
        kept = tokens(url, [system, *turns[-fitting[0]:]])  # with the assistant's header (add_generation_prompt)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert 1 < fitting[0] < len(turns) and resp.truncation == "auto"
    assert resp.usage.total_tokens == 256  # the answer takes the room left (the fake's reply is longer)
    assert resp.usage.input_tokens == kept
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_an_unfinished_assistant_message_last_is_continued():
    start = {"role": "user", "content": "Count"}
    unfinished = {"type": "message", "role": "assistant", "status": "incomplete",
                  "content": [{"type": "output_text", "text": "1, 2,"}]}
    with server() as (url, fake, client):
        resp = client.responses.create(model="fake-model", input=[start, unfinished], max_output_tokens=5)
        answered = client.responses.create(model="fake-model", max_output_tokens=5,
                                           input=[start, unfinished | {"status": "completed"}])
        want = chat(url, [start, {"role": "assistant", "content": "1, 2,"}], max_tokens=5,
                    continue_final_message=True, add_generation_prompt=False)
    assert resp.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert resp.output_text == want["choices"][0]["message"]["content"]
    assert answered.usage.input_tokens == resp.usage.input_tokens + len("<|im_end|>\n<|im_start|>assistant\n")


def test_the_response_echoes_the_request_s_settings_and_takes_its_id():
    body = {"input": "q", "max_output_tokens": 3, "tool_choice": "none", "parallel_tool_calls": False,
            "reasoning": {"effort": "high"}, "truncation": "auto", "service_tier": "default",
            "request_id": "resp_mine", "stream_options": {"include_obfuscation": False}, "metadata": {"k": "v"}}
    with server() as (url, fake, client):
        r = httpx.post(url + "/v1/responses", json={"model": "fake-model", **body}).json()
        plain = httpx.post(url + "/v1/responses", json={"model": "fake-model", "input": "q"}).json()
        effort = chat(url, [{"role": "user", "content": "q"}], max_tokens=3, reasoning_effort="high")
    assert {k: r[k] for k in ("id", "tool_choice", "parallel_tool_calls", "reasoning", "truncation", "service_tier",
                              "metadata", "max_output_tokens", "background", "top_logprobs")} == {
        "id": "resp_mine", "tool_choice": "none", "parallel_tool_calls": False, "reasoning": {"effort": "high"},
        "truncation": "auto", "service_tier": "default", "metadata": {"k": "v"}, "max_output_tokens": 3,
        "background": False, "top_logprobs": 0}
    assert r["usage"]["input_tokens"] == effort["usage"]["prompt_tokens"] > plain["usage"]["input_tokens"]
    assert plain["max_output_tokens"] == 256 - plain["usage"]["input_tokens"] and plain["id"].startswith("resp_")


class EosFake(FakeEngine):
    """Reports the EOS that ends a choice as the engine does: a token of its own (with its logprobs), in a step of
    its own, writing no text."""

    def _advance(self, r, now: float) -> None:
        before = list(r.done)
        super()._advance(r, now)
        for c, toks in enumerate(r.gen):
            if r.done[c] == "stop" and before[c] is None:
                toks.append(self.tokenizer.eos_token_id)
                if r.params.logprobs is not None:
                    r.logprobs[c].append({self.tokenizer.eos_token_id: self.logprob})
                self.generation_tokens_total += 1


@pytest.mark.parametrize("reply, parser", [(None, "none"), ("<think>why not</think>the answer", "deepseek_r1")])
def test_streamed_logprobs_are_the_answer_s_as_not_streamed(reply, parser):
    """Every output token's logprobs in both: the EOS's, which writes no text (so it is in the .done event only,
    not in a text delta), and a thinking model's reasoning tokens (in the first text delta when streamed)."""
    body = {"input": "Hello", "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    with server(EosFake(max_model_len=256, reply=reply), reasoning_parser=parser) as (url, fake, client):
        whole = httpx.post(url + "/v1/responses", json={"model": "fake-model", **body}).json()
        streamed = events(url, body)
    final = next(e for name, e in streamed if name == "response.completed")["response"]
    deltas = [lp for name, e in streamed if name == "response.output_text.delta" for lp in e["logprobs"]]
    assert whole["output"][-1]["content"][0]["logprobs"] == final["output"][-1]["content"][0]["logprobs"]
    assert len(final["output"][-1]["content"][0]["logprobs"]) == final["usage"]["output_tokens"]
    lps = final["output"][-1]["content"][0]["logprobs"]
    assert deltas == lps[:-1] and len(lps) == len(deltas) + 1  # the EOS's in .done only
    assert whole["status"] == final["status"] == "completed"

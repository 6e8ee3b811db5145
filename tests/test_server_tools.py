"""Tool calls without a tool-call parser (engine/server/tools.py), as vLLM: a named function or "required" is a
JSON-schema constraint, its output the response's tool_calls; "auto" refused."""
import json

import pytest

from engine.server import tools

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: any object, vLLM's default


@pytest.mark.parametrize("given", [[{"type": "function"}], ["weather"], [{"type": "retrieval", "function": {
    "name": "x"}}], [{"type": "function", "function": {"name": "x", "parameters": []}}]])
def test_check_tools_refuses_what_is_not_a_function(given):
    with pytest.raises(ValueError, match="each tool must be"):
        tools.check_tools(given)


@pytest.mark.parametrize("given,choice,message", [
    ([WEATHER], None, "needs a tool-call parser"),  # OpenAI's default with tools: auto
    ([WEATHER], "auto", "needs a tool-call parser"),
    (None, "required", "needs tools"), (None, "auto", "needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], {"type": "function"}, "must be"),
    ([WEATHER], {"type": "function", "function": "weather"}, "must be"),  # a common slip: no 500
    ([WEATHER], ["weather"], "must be"),
    ([WEATHER], "sometimes", "must be")])
def test_check_choice_refuses_what_cannot_be_served(given, choice, message):
    with pytest.raises(ValueError, match=message):
        tools.check_choice(given, choice)


@pytest.mark.parametrize("given,choice", [(None, None), (None, "none"), ([WEATHER], "none"),
                                          ([WEATHER, TIME], "required"),
                                          ([WEATHER, TIME], {"type": "function", "function": {"name": "time"}})])
def test_check_choice_takes_what_can_be_served(given, choice):
    assert tools.check_tools(given) is None and tools.check_choice(given, choice) is None


def test_required_moves_the_tools_defs_to_the_root_so_refs_resolve():
    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "$defs": defs}}}
    loc = {"Loc": {"type": "string"}}
    got = tools.schema([tool("a", loc), tool("b", loc)], "required")
    assert got["$defs"] == loc and all("$defs" not in c["properties"]["parameters"] for c in got["items"]["anyOf"])
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output import check
    check(StructuredOutputsParams(json=got))  # xgrammar resolves the refs
    with pytest.raises(ValueError, match="define \\$defs 'Loc' differently"):
        tools.schema([tool("a", loc), tool("b", {"Loc": {"type": "integer"}})], "required")


def test_schema_of_a_named_function_and_of_required():
    named = tools.schema([WEATHER, TIME], {"type": "function", "function": {"name": "weather"}})
    assert named == WEATHER["function"]["parameters"]
    assert tools.schema([TIME], {"type": "function", "function": {"name": "time"}}) == {"type": "object",
                                                                                        "properties": {}}
    required = tools.schema([WEATHER, TIME], "required")
    assert required["type"] == "array" and required["minItems"] == 1
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["weather"], ["time"]]
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert tools.schema([WEATHER], "none") is None and tools.schema(None, None) is None


def test_tool_calls_from_the_constrained_output():
    named = tools.tool_calls('{"city": "Paris"}', {"type": "function", "function": {"name": "weather"}})
    assert [c["function"] for c in named] == [{"name": "weather", "arguments": '{"city": "Paris"}'}]
    assert named[0]["type"] == "function" and named[0]["id"].startswith("chatcmpl-tool-")
    required = tools.tool_calls('[{"name": "weather", "parameters": {"city": "Zürich"}}, {"name": "time", '
                                '"parameters": {}}]', "required")
    assert [c["function"]["name"] for c in required] == ["weather", "time"]
    assert json.loads(required[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert "Zürich" in required[0]["function"]["arguments"]  # not \\u-escaped, as vLLM
    assert len({c["id"] for c in required}) == 2
    assert tools.tool_calls('[{"name": "weather", "parame', "required") is None  # cut by max_tokens
    assert tools.tool_calls("hello", "none") is None


def test_a_required_array_streams_as_its_calls_once_complete():
    from types import SimpleNamespace

    from engine.server.protocol import ChatCompletionRequest
    from engine.server.serving_chat import _delta
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
                                tool_choice="required")
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]'
    step = SimpleNamespace(text=text[:10], first=True, finish_reason=None, choice=SimpleNamespace(text=text[:10]))
    assert _delta(req, step).content is None and _delta(req, step).tool_calls is None
    last = SimpleNamespace(text=text[10:], first=False, finish_reason="stop", choice=SimpleNamespace(text=text))
    calls = _delta(req, last).tool_calls
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "weather", {"city": "Oslo"}), (1, "time", {})]


def test_tool_calls_in_the_history_reach_the_template_with_object_arguments():
    from engine.server.serving_chat import _for_template
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    got = _for_template({"role": "assistant", "content": None, "tool_calls": [call]}, "")
    assert got["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and got["content"] == ""
    assert call["function"]["arguments"] == '{"city": "Oslo"}'  # the request's own message is left as it was
    odd = {**call, "function": {"name": "weather", "arguments": "not json"}}
    assert _for_template({"role": "assistant", "tool_calls": [odd]}, "")["tool_calls"][0] == odd
    assert "tool_calls" not in _for_template({"role": "user", "content": "hi"}, "hi")

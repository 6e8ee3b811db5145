"""Tool calls without a tool-call parser (engine/server/tools.py), as vLLM: a named function or "required" is a
JSON-schema constraint, its output the response's tool_calls; "auto" refused."""
import json

import pytest

from engine.server import tools

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: any object, vLLM's default


@pytest.mark.parametrize("given,choice,message", [
    ([WEATHER], None, "needs a tool-call parser"),  # OpenAI's default with tools: auto
    ([WEATHER], "auto", "needs a tool-call parser"),
    (None, "required", "needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([{"type": "function"}], "none", "each tool must be"),
    (["weather"], "none", "each tool must be"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "none", "each tool must be"),
    ([{"type": "function", "function": {"name": "x", "parameters": []}}], "none", "each tool must be")])
def test_check_refuses_what_cannot_be_served(given, choice, message):
    with pytest.raises(ValueError, match=message):
        tools.check(given, choice)


@pytest.mark.parametrize("given,choice", [(None, None), ([WEATHER], "none"), ([WEATHER, TIME], "required"),
                                          ([WEATHER, TIME], {"type": "function", "function": {"name": "time"}})])
def test_check_takes_what_can_be_served(given, choice):
    assert tools.check(given, choice) is None


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

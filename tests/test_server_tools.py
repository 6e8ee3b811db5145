"""Tool calls (engine/server/tools.py, tool_parsers.py), as vLLM: a named function or "required" is a JSON-schema
constraint, its output the response's tool_calls; "auto" reads <tool_call> blocks out of free text (hermes)."""
import json

import pytest

from engine.server import tool_parsers, tools

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: any object, vLLM's default


@pytest.mark.parametrize("given", [[{"type": "function"}], ["weather"], [{"type": "retrieval", "function": {
    "name": "x"}}], [{"type": "function", "function": {"name": "x", "parameters": []}}]])
def test_check_tools_refuses_what_is_not_a_function(given):
    with pytest.raises(ValueError, match="each tool must be"):
        tools.check_tools(given)


@pytest.mark.parametrize("given,choice,message", [
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
                                          ([WEATHER], None), ([WEATHER], "auto"),  # the server checks the parser
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
    assert "maxItems" not in required and tools.schema([WEATHER, TIME], "required", parallel=False) == {
        **required, "maxItems": 1}  # OpenAI's parallel_tool_calls false
    assert tools.schema([WEATHER], {"type": "function", "function": {"name": "weather"}}, parallel=False) == named


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
    assert _delta(req, step, None).content is None and _delta(req, step, None).tool_calls is None
    last = SimpleNamespace(text=text[10:], first=False, finish_reason="stop", choice=SimpleNamespace(text=text))
    calls = _delta(req, last, None).tool_calls
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


LLAMA31_TEMPLATE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                    'its value}. Do not use variables.')  # as Llama 3.1's and 3.2's templates ask
HERMES_TEMPLATE = "{% for tool in tools %}...{% endfor %}<tool_call>\n{...}\n</tool_call>"  # as Qwen2.5's has


def _call(c: dict) -> tuple[str, dict]:
    return c["function"]["name"], json.loads(c["function"]["arguments"])


def test_the_parser_follows_the_setting_and_the_template():
    assert tool_parsers.resolve("auto", HERMES_TEMPLATE) == "hermes"
    assert tool_parsers.resolve("auto", {"default": "x", "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert tool_parsers.resolve("auto", "{{ messages }}") is None and tool_parsers.resolve("auto", None) is None
    assert tool_parsers.resolve("hermes", None) == "hermes" and tool_parsers.resolve("none", HERMES_TEMPLATE) is None
    assert tool_parsers.resolve("auto", LLAMA31_TEMPLATE) == "llama3_json"
    assert tool_parsers.resolve("auto", "... {{- '<|python_tag|>' + call }} ...") == "llama3_json"
    assert tool_parsers.resolve("llama3_json", None) == "llama3_json"
    assert tool_parsers.resolve("auto", MISTRAL_TEMPLATE) == "mistral" == tool_parsers.resolve("mistral", None)
    with pytest.raises(ValueError, match="auto, hermes, mistral, llama3_json, none"):
        tool_parsers.resolve("pythonic", None)


def test_hermes_blocks_become_calls_and_the_text_before_them_the_content():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": "{}"}\n</tool_call>')
    content, calls = tool_parsers.parse(text)
    assert content == "Let me check.\n" and [_call(c) for c in calls] == [("weather", {"city": "Zürich"}),
                                                                          ("time", {})]
    assert "Zürich" in calls[0]["function"]["arguments"] and len({c["id"] for c in calls}) == 2
    assert tool_parsers.parse('<tool_call>{"name": "time", "arguments": {}}')[0] is None  # unclosed: a stop token
    assert tool_parsers.parse("no calls here") == ("no calls here", [])
    for bad in ('<tool_call>{"name": "time", "argum</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>["time"]</tool_call>', 'x<tool_call>{"name": "t", "arguments": 3}</tool_call>'):
        assert tool_parsers.parse(bad) == (bad, [])  # vLLM: the whole output stays content


def _stream(text: str, cuts: list[int], parser: str = "hermes") -> tuple[str, list[tuple[str, dict]], list]:
    """(content, calls, per-update calls) of ``text`` streamed in pieces ending at ``cuts`` (then the rest)."""
    state, content, calls, per_update = tool_parsers.StreamState(parser), "", [], []
    ends = [*cuts, len(text)]
    for n, end in enumerate(ends):
        piece, new = state.delta(text[:end], n == len(ends) - 1)
        content += piece or ""
        calls += [_call(c) for c in new]
        per_update.append([_call(c) for c in new])
    return content, calls, per_update


GOOD = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
STREAMED = ["Sure." + GOOD + "\n" + '<tool_call>{"name": "time", "arguments": {}}</tool_call>',
            "a < b and <tool is not a call", "plain text", "", GOOD, GOOD + "\n trailing words",
            'x<tool_call>{"name": oops}</tool_call> then ' + GOOD,  # a bad block before a good one
            "Sure." + GOOD + '\n<tool_call>{"name": "weather", "argu',  # a good one, then one cut by max_tokens
            '<tool_call>{"name": "time", "arguments": {}}', "<<tool_call>x"]


def test_llama3_json_calls_are_the_whole_output():
    """llama3_json (vLLM's llama_tool_parser): the output is one call or several joined by "; ", maybe after
    <|python_tag|>, "parameters" (or "arguments") its arguments; no content then; anything else stays content."""
    content, calls = tool_parsers.parse('{"name": "weather", "parameters": {"city": "Zürich"}}', "llama3_json")
    assert content is None and [_call(c) for c in calls] == [("weather", {"city": "Zürich"})]
    two = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "time", "arguments": {}}'
    assert [_call(c) for c in tool_parsers.parse(two, "llama3_json")[1]] == [("weather", {"city": "Oslo"}),
                                                                              ("time", {})]
    for text in ("The weather is fine.", '{"name": "weather", "parameters": {"city": "Os', '{"city": "Oslo"}',
                 '{"name": "time", "parameters": {}} and more words', ""):
        assert tool_parsers.parse(text, "llama3_json") == (text, []), text


MISTRAL_TEMPLATE = "{{- '[AVAILABLE_TOOLS] [' }}{{ tools }}{{- '][/AVAILABLE_TOOLS]' }} ... [TOOL_CALLS] ..."


def test_mistral_calls_follow_the_tag():
    """mistral (vLLM's mistral_tool_parser): [TOOL_CALLS] and a JSON array of calls, or name[ARGS]{...} per call
    (Mistral's newer tokenizers); the text before it is the content; ids of nine letters and digits (Mistral's
    templates refuse others in the history); anything that does not parse stays content."""
    content, calls = tool_parsers.parse(
        'Checking. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Zürich"}}, {"name": "time", '
        '"arguments": {}}]', "mistral")
    assert content == "Checking. " and [_call(c) for c in calls] == [("weather", {"city": "Zürich"}), ("time", {})]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]
    content, calls = tool_parsers.parse('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]time[ARGS]{}',
                                        "mistral")
    assert content is None and [_call(c) for c in calls] == [("weather", {"city": "Oslo"}), ("time", {})]
    one = tool_parsers.parse('[TOOL_CALLS] {"name": "time", "arguments": {}}', "mistral")[1]
    assert [_call(c) for c in one] == [("time", {})]
    for text in ("No calls.", "[TOOL_CALLS]", '[TOOL_CALLS] [{"name": "weather", "argu',
                 '[TOOL_CALLS] [{"name": "time", "arguments": {}}] and words', '[TOOL_CALLS]weather[ARGS]{"ci',
                 '[TOOL_CALLS] [{"arguments": {}}]'):
        assert tool_parsers.parse(text, "mistral") == (text, []), text


def test_a_stream_is_the_response_whatever_the_cut_points():
    """Streamed in any pieces, an output gives the content and calls ``parse`` gives it whole (so a bad block after
    a good one leaves both as content, as vLLM answers without streaming); text before a block goes out at once."""
    import random
    rng = random.Random(0)
    cases = ([(t, "hermes") for t in STREAMED] + [(t, "llama3_json") for t in LLAMA3_STREAMED]
             + [(t, "mistral") for t in MISTRAL_STREAMED])
    for text, parser in cases:
        whole = tool_parsers.parse(text, parser)
        want = (whole[0] or "", [_call(c) for c in whole[1]])
        cut_sets = [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1)))
                                                   for k in (1, 2, 3, 5, 8) for _ in range(40) if len(text) > 1]
        for cuts in cut_sets:
            assert _stream(text, cuts, parser)[:2] == want, (text, cuts)
    assert _stream("Sunny today.", [3], "llama3_json")[2] == [[], []]
    state = tool_parsers.StreamState("llama3_json")
    assert state.delta("Sun", False) == ("Sun", []) and state.delta("Sunny", False) == ("ny", [])
    for start in ("<|py", "  {", '{"na'):  # a call may have started: nothing goes out yet
        assert tool_parsers.StreamState("llama3_json").delta(start, False) == (None, [])
    content, calls, per_update = _stream(STREAMED[0], [3, 7, 40])
    assert per_update[0] == [] and calls == [("weather", {"city": "Oslo"}), ("time", {})]
    assert per_update[-1] == calls and content == "Sure."
    state = tool_parsers.StreamState()
    assert state.delta("Sur", False) == ("Sur", []) and state.delta("Sure.<to", False) == ("e.", [])


LLAMA3_STREAMED = ['{"name": "weather", "parameters": {"city": "Oslo"}}', "Sunny today, 21 degrees.",
                   '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "parameters": {}}',
                   '{"name": "weather", "parameters": {"ci', "{not json at all}", "\n" + '{"name": "t"}',
                   "<|python_tag|> is what I would write"]


MISTRAL_STREAMED = ['Sure. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]', "[1, 2] is a list",
                    '[TOOL_CALLS]time[ARGS]{}', '[TOOL_CALLS] [{"name": "weather", "arguments": {"ci', "[TOOL_ not"]


def test_a_block_without_arguments_is_a_call_with_none():
    """Unlike vLLM (which needs "arguments"), a block naming a function alone calls it with {}."""
    _, calls = tool_parsers.parse('<tool_call>{"name": "time"}</tool_call>')
    assert [_call(c) for c in calls] == [("time", {})]

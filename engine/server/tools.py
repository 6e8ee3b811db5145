"""Tool calls without a tool-call parser, as vLLM serves them: ``tool_choice`` naming a function, or "required",
turns the request into a structured output (a JSON schema over the tools' ``parameters``) and the generated JSON
into the response's ``tool_calls``; "none" leaves the tools to the chat template only. "auto" (OpenAI's default
when tools are given) leaves the output free and reads tool calls out of it with a model-specific parser
(``tool_parsers``); the server refuses it where it has none, as vLLM does without ``--enable-auto-tool-choice``.

Source: OpenAI chat completions API (``tools``, ``tool_choice``, ``message.tool_calls``, ``delta.tool_calls``);
vLLM's serving_chat (a named function's arguments are the output text; "required" is a JSON array of
``{"name", "parameters"}`` objects, one schema per tool; finish_reason stays the engine's).
"""
from __future__ import annotations

import json
import uuid
from typing import Any

AUTO_REFUSED = ('"auto" tool choice needs a tool-call parser, and this server has none for its model ({why}): use '
                'tool_choice "required", {{"type": "function", "function": {{"name": ...}}}} or "none"')


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Raise ValueError (the message without a field name) for tools that are not ``{"type": "function",
    "function": {"name": ..., "parameters": {...}}}`` objects."""
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or not isinstance(
                fn.get("name"), str) or not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ValueError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')


def check_choice(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> None:
    """Raise ValueError (the message without a field name) for a tool_choice other than "none", "auto" (the default
    when tools are given; whether the model has a parser for it the server checks), "required" or a named function
    among ``tools`` (checked by :func:`check_tools`), and one that needs tools without them."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return
    if not tools:
        raise ValueError("needs tools: when using `tool_choice`, `tools` must be set")
    if tool_choice in ("auto", "required"):
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if name not in [t["function"]["name"] for t in tools]:
        raise ValueError(f"names {name!r}, which is not among the tools")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def schema(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
           parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output must follow (None when the tools only inform the template): the named function's
    parameters, or for "required" a non-empty array of ``{"name": one of the tools, "parameters": its schema}``
    (of one element without ``parallel``: OpenAI's ``parallel_tool_calls`` false), the tools' ``$defs`` moved to
    the array's root so their ``$ref``s still resolve. Assumes
    :func:`check_choice` passed; raises ValueError when two tools define one ``$defs`` name differently."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _parameters(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        params = dict(_parameters(tool))
        for key, value in params.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"two tools define $defs {key!r} differently")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    array = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}
    return {**array, "$defs": defs} if defs else array


def new_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    """One ``tool_calls`` entry with ``call_id``, or a fresh id (vLLM's ``chatcmpl-tool-`` ids)."""
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def is_auto(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> bool:
    """Whether the request leaves the calls to the model: tools given and tool_choice "auto" or unset."""
    return bool(tools) and tool_choice in (None, "auto")


def tool_calls(text: str, tool_choice: str | dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The response's ``tool_calls`` for an output ``text`` made under :func:`schema`: a named function's call with
    ``text`` as its arguments, or one call per element of the "required" array (arguments re-serialized, as vLLM);
    None for another tool_choice, or a "required" output that is not the complete array (cut by max_tokens): the
    text is then the message's content."""
    if isinstance(tool_choice, dict):
        return [new_call(tool_choice["function"]["name"], text)]
    if tool_choice != "required":
        return None
    try:
        calls = json.loads(text)
        return [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return None

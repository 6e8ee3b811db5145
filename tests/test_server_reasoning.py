"""Reasoning split off chat answers (engine/server/reasoning.py): the split itself, streamed and not, and the
server's ``reasoning`` / ``reasoning_content`` fields, with tool calls read from the content."""
from __future__ import annotations

import json

import httpx
import pytest

from engine.server import reasoning
from engine.server.reasoning import StreamSplit, split, starts_open
from test_server import MESSAGES, MODEL, serve
from test_server_fakes import FakeEngine, wait_for

THINK_TEMPLATE = "{% if enable_thinking %}<think>{% endif %}"  # "auto" reads reasoning when a template has <think>


@pytest.mark.parametrize("text, open_, want", [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "Paris.")),
    ("Let me see.</think>Paris.", True, ("Let me see.", "Paris.")),
    ("Let me see, the capital", True, ("Let me see, the capital", None)),  # stopped inside its reasoning
    ("<think>Let me", False, ("Let me", None)),
    ("Paris.", False, (None, "Paris.")),
    ("Paris. </think> x", False, (None, "Paris. </think> x")),  # no block opened: all content
    ("</think>\n\n", True, ("", None)),  # nothing after the block: content null, as vLLM
    ("<think>Hm.</think>Paris.", True, ("Hm.", "Paris.")),  # the model opens the block the prompt opened
])
def test_split(text, open_, want):
    assert split(text, open_) == want


def test_starts_open():
    assert starts_open("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1's template opens the block
    assert not starts_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 with enable_thinking false
    assert not starts_open("<|im_start|>assistant\n")
    assert not starts_open("Explain <think> tags.<|im_end|>\n<|im_start|>assistant\n")  # the user's words


@pytest.mark.parametrize("text, open_", [
    ("<think>\nLet me see: </thin or </think> not yet.\n</think>\n\nParis. </think> stays.", False),
    ("a</think>\n\n\nb", True), ("<thi", False), ("<think", False), ("no <think> here", False),
    ("thinking to the end </thi", True),
])
def test_streamed_deltas_add_up_to_the_split(text, open_):
    """Fed one character at a time (then the end), the deltas add up to the split of the whole text, and no
    partial tag goes out as reasoning or content."""
    stream, thought, said = StreamSplit(open_), "", ""
    for n in range(len(text) + 1):
        r, c = stream.delta(text[:n], n == len(text))
        thought, said = thought + (r or ""), said + (c or "")
        if n < len(text):  # a tag's beginning held back
            assert not thought.endswith(("<", "</", "</thi")) and not said.startswith("<thi")
    want = split(text, open_)
    assert (thought, said) == (want[0] or "", want[1] or "")


def test_settings():
    assert reasoning.resolve("auto", "... <think> ...") and not reasoning.resolve("auto", "plain")
    assert reasoning.resolve("auto", {"default": "x", "tool_use": "<think>"}) and not reasoning.resolve("auto", None)
    assert reasoning.resolve("qwen3", None) and reasoning.resolve("deepseek_r1", None)
    assert not reasoning.resolve("none", "<think>")
    with pytest.raises(ValueError, match="reasoning_parser: must be one of auto, deepseek_r1, qwen3, none"):
        reasoning.resolve("granite", None)


def _chat(url: str, stream: bool = False, **kw) -> dict:
    """The response (stream: the choice's deltas joined per field, and its last finish_reason) of one chat."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, **kw}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    joined: dict = {"message": {}, "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if "role" in choice["delta"]:  # the first delta: the role, content ""
                continue
            for key, value in choice["delta"].items():
                if key == "tool_calls":
                    joined["message"].setdefault(key, []).extend(value)
                elif value is not None:  # a field that said something, "" too
                    joined["message"][key] = joined["message"].get(key, "") + value
            joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
    return joined


def test_server_splits_reasoning_streamed_and_not():
    """A template that writes <think> ("auto"): the block's text is the message's reasoning (and
    reasoning_content), the rest its content; where the template opens the block itself the answer starts inside
    it; where it closes an empty one (Qwen3's enable_thinking false) all is content; an answer cut inside its
    reasoning has content null; a JSON response_format is not split; streamed, the deltas add up the same."""
    fake = FakeEngine(max_model_len=512, reply="<think>\nThe capital.\n</think>\n\nParis.")
    fake.tokenizer.chat_template = THINK_TEMPLATE
    engine, srv = serve(fake)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        for stream in (False, True):
            got = _chat(url, stream)
            assert got["message"]["reasoning"] == got["message"]["reasoning_content"] == "\nThe capital.\n"
            assert got["message"]["content"] == "Paris." and got["finish_reason"] == "stop"
            cut = _chat(url, stream, max_tokens=13)  # "<think>" and 6 characters
            assert cut["finish_reason"] == "length" and cut["message"]["reasoning"] == "\nThe c"
            assert cut["message"].get("content") is None
            hidden = _chat(url, stream, include_reasoning=False)  # vLLM's: the reasoning left out, content kept
            assert hidden["message"]["content"] == "Paris." and hidden["message"].get("reasoning") is None
            assert hidden["message"].get("reasoning_content") is None
            constrained = _chat(url, stream, response_format={"type": "json_object"})
            assert constrained["message"]["content"] == fake.reply and "reasoning" not in constrained["message"]
        fake.reply = "The capital.</think>Paris."
        for stream in (False, True):
            opened = _chat(url, stream, chat_template_kwargs={"suffix": "<think>\n"})
            assert (opened["message"]["reasoning"], opened["message"]["content"]) == ("The capital.", "Paris.")
            closed = _chat(url, stream, chat_template_kwargs={"suffix": "<think>\n\n</think>\n\n"})
            assert closed["message"]["content"] == fake.reply and "reasoning" not in closed["message"]
    engine.shutdown()


def test_tool_calls_are_read_from_the_content():
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    fake = FakeEngine(max_model_len=512, reply=f"<think>I should look it up.</think>\n<tool_call>{call}</tool_call>")
    fake.tokenizer.chat_template = THINK_TEMPLATE + " <tool_call> </tool_call>"
    engine, srv = serve(fake)
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        for stream in (False, True):
            got = _chat(url, stream, tools=[tool])
            assert got["finish_reason"] == "tool_calls" and got["message"]["reasoning"] == "I should look it up."
            assert [c["function"]["name"] for c in got["message"]["tool_calls"]] == ["weather"]
            assert not got["message"].get("content")
    engine.shutdown()


@pytest.mark.parametrize("setting, template, splits", [
    ("none", THINK_TEMPLATE, False), ("auto", "plain {{ messages }}", False), ("qwen3", None, True)])
def test_the_setting_decides(setting, template, splits):
    fake = FakeEngine(max_model_len=512, reply="<think>Hm.</think>Paris.")
    fake.tokenizer.chat_template = template
    engine, srv = serve(fake, reasoning_parser=setting)
    with srv as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        got = _chat(url)["message"]
        assert (got.get("reasoning"), got["content"]) == (("Hm.", "Paris.") if splits else (None, fake.reply))
    engine.shutdown()
    with pytest.raises(ValueError, match="reasoning_parser"):
        serve(FakeEngine(), reasoning_parser="granite")

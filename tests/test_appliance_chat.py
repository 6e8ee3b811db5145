"""``appliance chat`` against the fake engine's server: one answer and exit, piped input, the REPL's turns and
commands, a stopped answer, errors, a thinking model's reasoning apart from its answer."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from appliance.chat import (SET_HELP, SHOW_HELP, AnswerWriter, Block, ChatError, ChatSession, input_history,
                            read_turn, repl)
from appliance.cli import app
from engine.server.api_server import build_app
from test_server_fakes import FakeEngine, FakeTokenizer, ServerThread, fake_reply, started_engine, wait_for

runner = CliRunner()


@contextmanager
def fake_server(fake: FakeEngine | None = None, **app_kw):
    fake = fake or FakeEngine(max_model_len=256)
    with started_engine(fake) as engine, ServerThread(build_app(engine, **app_kw)) as url:
        yield url, fake


def answer_of(url: str, messages: list[dict], **options) -> str:
    """The server's answer to ``messages``, not streamed: what the chat must have written."""
    body = {"model": "fake-model", "messages": messages, **options}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_a_prompt_gets_one_answer_and_the_command_exits():
    with fake_server() as (url, _):
        result = runner.invoke(app, ["chat", "--url", url, "--max-tokens", "12", "Hello"])
        assert result.exit_code == 0, result.output
        expected = answer_of(url, [user("Hello")], max_tokens=12)
        pasted = runner.invoke(app, ["chat", "--url", f"{url}/v1/", "--max-tokens", "12", "Hello"])  # the base
    assert result.output == expected + "\n" and len(expected) == 12  # URL the installer prints, as SDKs take it
    assert pasted.output == result.output


def test_piped_input_follows_the_prompt():
    with fake_server() as (url, _):
        result = runner.invoke(app, ["chat", "--url", url, "--temperature", "0", "Summarize:"],
                               input="  some text\n")
        expected = answer_of(url, [user("Summarize:\n\nsome text")], temperature=0)
        alone = runner.invoke(app, ["chat", "--url", url], input="just this\n")
        expected_alone = answer_of(url, [user("just this")])
    assert (result.exit_code, result.output) == (0, expected + "\n")
    assert (alone.exit_code, alone.output) == (0, expected_alone + "\n")


def test_a_session_sends_the_whole_conversation_and_keeps_completed_answers():
    with fake_server() as (url, _):
        session = ChatSession(url, "fake-model", system="Be brief.", options={"max_tokens": 9})
        pieces = []
        first = session.ask("one", lambda kind, text: pieces.append((kind, text)))
        second = session.ask("two", lambda kind, text: None)
        system = {"role": "system", "content": "Be brief."}
        assert first == answer_of(url, [system, user("one")], max_tokens=9)
        assert second == answer_of(url, [system, user("one"), {"role": "assistant", "content": first}, user("two")],
                                   max_tokens=9)
    assert "".join(text for _, text in pieces) == first and {kind for kind, _ in pieces} == {"content"}
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.body() == {"model": "fake-model", "messages": session.messages, "stream": True, "max_tokens": 9}
    session.clear()
    assert session.messages == [system]


def test_read_turn_takes_a_line_or_a_triple_quoted_block():
    def reader(*lines):
        it = iter(lines)
        return lambda prompt: next(it)

    assert read_turn(reader("  hi  ")) == "  hi  " and not isinstance(read_turn(reader("/bye")), Block)
    block = read_turn(reader('"""first', "", 'second """'))
    assert block == "first\n\nsecond " and isinstance(block, Block)
    assert read_turn(reader('"""one line"""')) == "one line"

    def eof(prompt):
        raise EOFError

    assert read_turn(eof) is None


def test_the_repl_answers_turns_and_obeys_its_commands():
    lines = iter(["hello", '"""a', 'b"""', "/clear", "/help", "/model x", "", '"""/bye is a word"""', "/bye",
                  "never read"])
    written, said = [], []
    with fake_server() as (url, _):
        session = ChatSession(url, "fake-model", options={"max_tokens": 5})
        repl(session, lambda prompt: next(lines), lambda text, dim: written.append(text), said.append)
        after = answer_of(url, [user("/bye is a word")], max_tokens=5)
    assert next(lines) == "never read"
    assert session.messages == [user("/bye is a word"), {"role": "assistant", "content": after}]
    assert said[0].startswith("Chatting with fake-model at " + url) and "Cleared the conversation." in said
    assert any(line.startswith("/bye ends the chat") for line in said[1:])
    assert "Unknown command '/model'. Type /? for help." in said
    assert "".join(written).count("\n") == 3  # three answers, each ended by a newline


def test_a_stopped_answer_is_aborted_and_left_out():
    fake = FakeEngine(max_model_len=512, step_delay=0.02, reply="x" * 400)
    said = []
    lines = iter(["long one", "/bye"])

    def write(text, dim):
        raise KeyboardInterrupt  # Ctrl-C while the first piece is written

    with fake_server(fake) as (url, _):
        session = ChatSession(url, "fake-model", options={"max_tokens": 200})
        repl(session, lambda prompt: next(lines), write, said.append)
        wait_for(lambda: fake.aborted, what="the request aborted on the server")
    assert session.messages == [] and said[-1].startswith("\n(stopped")


def test_errors_are_one_line_and_the_repl_goes_on():
    with fake_server(FakeEngine(max_model_len=64), api_key="secret") as (url, _):
        refused = runner.invoke(app, ["chat", "--url", url, "--api-key", "wrong", "hi"])
        session = ChatSession(url, "fake-model", api_key="secret", options={"max_tokens": 500})
        with pytest.raises(ChatError, match="context") as info:
            session.ask("hi", lambda kind, text: None)
        assert "/clear" in info.value.hint and session.messages == []
        session.options["temperature"] = -1.0
        with pytest.raises(ChatError, match="temperature") as info:
            session.ask("hi", lambda kind, text: None)
        assert info.value.hint == "check the options given (appliance chat -h; /show parameters in the chat)"
        del session.options["temperature"]
        said, lines = [], iter(["hi", "/bye"])
        repl(session, lambda prompt: next(lines), lambda text, dim: None, said.append)
    assert refused.exit_code == 1 and "error:" in refused.output and "--api-key" in refused.output
    assert "maximum context length" in said[-1] and session.messages == []
    gone = runner.invoke(app, ["chat", "--url", url, "hi"])
    assert gone.exit_code == 1 and "no server answers at " + url in gone.output


def test_an_engine_that_fails_mid_answer_is_an_error():
    with fake_server(FakeEngine(max_model_len=256, fail_at_step=3)) as (url, _):
        session = ChatSession(url, "fake-model", options={"max_tokens": 20})
        got = []
        with pytest.raises(ChatError, match="the answer failed"):
            session.ask("hi", lambda kind, text: got.append(text))
    n = len(FakeTokenizer().apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert session.messages == [] and "".join(got) == fake_reply(n)[:3]  # the three steps before the failure


def test_reasoning_is_written_apart_and_kept_out_of_the_conversation():
    fake = FakeEngine(max_model_len=256, reply="<think>why not</think>the answer")
    with fake_server(fake, reasoning_parser="deepseek_r1") as (url, _):
        session = ChatSession(url, "fake-model")
        pieces = []
        answer = session.ask("q", lambda kind, text: pieces.append((kind, text)))
        shown = runner.invoke(app, ["chat", "--url", url, "q"])
        hidden = runner.invoke(app, ["chat", "--url", url, "--hide-thinking", "q"])
    assert "".join(t for k, t in pieces if k == "reasoning") == "why not"
    assert answer == "".join(t for k, t in pieces if k == "content") == "the answer"
    assert session.messages[-1] == {"role": "assistant", "content": "the answer"}
    assert shown.output == "Thinking...\nwhy not\n...done thinking.\n\nthe answer\n"
    assert hidden.output == "the answer\n"


def test_the_writer_closes_a_reasoning_block_the_answer_never_followed():
    written = []
    writer = AnswerWriter(lambda text, dim: written.append((text, dim)))
    assert not writer.started
    writer("reasoning", "hm")
    writer.end()
    assert written == [("Thinking...\n", True), ("hm", True), ("\n...done thinking.", True), ("\n", False)]
    assert writer.started


def _stub_server(lines: list[bytes]):
    """An HTTP server that is ready (/health), lists model "m" and answers every POST with ``lines`` as an event
    stream."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"object": "list", "data": [{"id": "m"}]}' if self.path == "/v1/models" else b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(sum(map(len, lines))))
            self.end_headers()
            self.wfile.write(b"".join(lines))

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'


@pytest.mark.parametrize("lines, error", [
    ([CHUNK, b"data: not json\n\n"], "no chat chunk: 'not json'"),
    ([CHUNK, b"data: [1, 2]\n\n"], "no chat chunk"),
    ([CHUNK], "ended before the server said it was done"),
    ([CHUNK, b'data: {"error": {"message": "boom", "code": 500}}\n\n', b"data: [DONE]\n\n"], "failed: boom"),
])
def test_a_stream_that_is_not_a_finished_chat_is_an_error_and_the_repl_goes_on(lines, error):
    server = _stub_server(lines)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        session = ChatSession(url, "m")
        with pytest.raises(ChatError, match=error):
            session.ask("q", lambda kind, text: None)
        said, turns = [], iter(["q", "/bye"])
        repl(session, lambda prompt: next(turns), lambda text, dim: None, said.append)
        result = runner.invoke(app, ["chat", "--url", url, "--api-key", "k", "q"])
    finally:
        server.shutdown()
    assert session.messages == [] and error.split(":")[0] in said[-1]
    assert result.exit_code == 1 and result.output.startswith("hi\nerror: ")


def test_chat_waits_for_a_loading_model():
    import threading

    from engine.async_engine import AsyncLLMEngine

    gate, fake = threading.Event(), FakeEngine(max_model_len=256)
    engine = AsyncLLMEngine(lambda: (gate.wait(30), fake)[1], "fake-model")
    try:
        with ServerThread(build_app(engine)) as url:
            assert httpx.get(f"{url}/health").status_code == 503
            threading.Timer(1.0, gate.set).start()
            result = runner.invoke(app, ["chat", "--url", url, "--max-tokens", "4", "Hello"])
            assert (result.exit_code, result.stdout) == (0, answer_of(url, [user("Hello")], max_tokens=4) + "\n")
            # no terminal, so no spinner: a line on stderr says why it waits (stdout holds the answer alone)
            assert result.stderr == f"waiting for the server at {url} to load the model (at most 600 s) ...\n"
    finally:
        gate.set()
        engine.shutdown()


def test_set_and_show_change_and_show_what_the_next_turns_send():
    lines = iter(["/set parameter temperature 0", "/set parameter num_predict 7", "/set parameter seed 3",
                  "/set parameter stop END  STOP", "/set parameter repeat_penalty 1.1", "/set parameter num_ctx 4096",
                  "/set parameter bogus 1", "/set parameter top_k x", "/set parameter top_p 1 2",
                  "/set parameter temperature nan", "/set parameter num_predict 0", "/set system Be  terse.",
                  "/show parameters", "/show system", "/show info", "hello", "/set parameter num_predict -2",
                  "/set parameter stop", "/set format json", "/set verbose", "again", "/set noformat", "/set quiet",
                  "/set", "/show", "/? set", "/bye"])
    said = []
    with fake_server() as (url, fake):
        session = ChatSession(url, "fake-model", system="Be long.")
        repl(session, lambda prompt: next(lines), lambda text, dim: None, said.append)
        first, second = fake.params
        asked = httpx.post(f"{url}/tokenize", json={"messages": session.messages[:-1]}).json()["count"]
    assert said[1:8] == ["Set parameter 'temperature' to '0'.", "Set parameter 'num_predict' to '7'.",
                         "Set parameter 'seed' to '3'.", "Set parameter 'stop' to 'END STOP'.",
                         "Set parameter 'repeat_penalty' to '1.1'.",
                         "num_ctx is not a per-request setting here: the context length is the server's max_model_len "
                         "(appliance install --max-model-len N).",
                         "Unknown parameter 'bogus'. " + SET_HELP + "."]
    assert said[8:12] == ["Couldn't set parameter 'top_k': 'x' is not an integer.",
                          "Couldn't set parameter 'top_p': give one value, e.g. /set parameter top_p 1.0.",
                          "Couldn't set parameter 'temperature': 'nan' is not a finite number.",
                          "Couldn't set parameter 'num_predict': give at least 1 (or -1: the rest of the context)."]
    assert said[12:19] == ["Set system message.", "User defined parameters:", "temperature          0.0",
                           "num_predict          7", "seed                 3", 'stop                 ["END", "STOP"]',
                           "repeat_penalty       1.1"]
    assert said[19:23] == ["Be  terse.", "  model           fake-model", "  context length  256",
                           "  server          " + url]
    assert said[23:25] == ["Set parameter 'num_predict' to '-2' (the rest of the context).",
                           "Unset parameter 'stop' (the server's default)."]
    assert (first.temperature, first.max_tokens, first.seed, first.stop, first.repetition_penalty) == (
        0.0, 7, 3, ["END", "STOP"], 1.1)
    assert first.structured_outputs is None and second.structured_outputs.json_object is True
    assert second.max_tokens is None and second.stop == [] and (second.temperature, second.seed) == (0.0, 3)
    assert session.messages[0] == {"role": "system", "content": "Be  terse."} and len(session.messages) == 5
    verbose = said[said.index("Set 'verbose' mode.") + 1:]
    assert verbose[0] == "" and verbose[1].startswith("total duration:") and verbose[2].startswith("time to first")
    assert verbose[3] == f"prompt eval count:    {asked} token(s)"  # the second turn's whole conversation
    assert verbose[4].startswith("eval count:") and verbose[5].startswith("eval rate:")
    assert said[-5:] == ["Disabled format.", "Set 'quiet' mode.", f"Usage: {SET_HELP}.", f"Usage: {SHOW_HELP}.",
                         SET_HELP]
    assert "response_format" not in session.options and not session.verbose


def test_a_system_prompt_of_several_lines_and_its_removal():
    lines = iter(['/set system """You are', "  brief.", '"""', "/show system", "/set nosystem", "/show system",
                  '/set system """One line."""', "/show info", "/bye"])
    said = []
    with fake_server() as (url, fake):
        session = ChatSession(url, "fake-model")
        session.ask("hi", lambda kind, text: None)
    repl(session, lambda prompt: next(lines), lambda text, dim: None, said.append)  # the server is gone now
    assert said[1:6] == ["Set system message.", "You are\n  brief.", "Removed the system message.",
                         "No system message was specified.", "Set system message."]
    assert said[6].startswith(f"no answer from {url} (ConnectError") and session.system == "One line."
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]


def test_verbose_prints_the_answers_counts_on_stderr_and_model_picks_a_listed_model():
    with fake_server() as (url, _):
        result = runner.invoke(app, ["chat", "--url", url, "--max-tokens", "6", "--verbose", "Hello"])
        expected = answer_of(url, [user("Hello")], max_tokens=6)
        picked = runner.invoke(app, ["chat", "--url", url, "--model", "fake-model", "--max-tokens", "6", "Hello"])
        unknown = runner.invoke(app, ["chat", "--url", url, "--model", "other", "Hello"])
        nan = runner.invoke(app, ["chat", "--url", url, "--temperature", "nan", "Hello"])
    assert result.exit_code == 0 and result.stdout == expected + "\n"
    assert "eval count:           6 token(s)" in result.stderr and "total duration:" in result.stderr
    assert (picked.exit_code, picked.stdout) == (0, expected + "\n")
    assert unknown.exit_code == 1 and "does not serve 'other' (it lists fake-model)" in unknown.output
    assert nan.exit_code == 1 and "--temperature must be a finite number" in nan.output


def test_input_history_is_read_before_and_written_after(tmp_path, monkeypatch):
    readline = pytest.importorskip("readline")
    path = tmp_path / "sub" / "chat_history"
    readline.clear_history()
    with input_history(path):
        readline.add_history("first turn")
    assert path.read_text().splitlines()[-1] == "first turn"
    readline.clear_history()
    with input_history(path):
        assert readline.get_history_item(readline.get_current_history_length()) == "first turn"
        readline.add_history("second turn")
    assert path.read_text().splitlines()[-2:] == ["first turn", "second turn"]
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with input_history(blocked / "chat_history"):  # its folder cannot be made: the chat goes on without it
        readline.add_history("third")
    readline.clear_history()

    def torn(name):  # a write that stops halfway (a full disk): the history written before stays whole
        Path(name).write_text("half a li")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(readline, "write_history_file", torn)
    with input_history(path):
        readline.add_history("fourth")
    assert path.read_text().splitlines()[-2:] == ["first turn", "second turn"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["chat_history"]  # no temporary file left
    readline.clear_history()


def test_think_nothink_and_format_json_reach_the_request():
    lines = iter(["/set nothink", "one", "/set think", "two", "/bye"])
    said = []
    with fake_server() as (url, fake):
        session = ChatSession(url, "fake-model")
        repl(session, lambda prompt: next(lines), lambda text, dim: None, said.append)
        no_thinking = answer_of(url, [user("one")], chat_template_kwargs={"enable_thinking": False})
        default = answer_of(url, [user("one")])
        one_shot = runner.invoke(app, ["chat", "--url", url, "--nothink", "--format", "json", "--max-tokens", "5", "x"])
        bad = runner.invoke(app, ["chat", "--url", url, "--format", "yaml", "x"])
    assert said[1:] == ["Set 'nothink' mode.", "Set 'think' mode."] and no_thinking != default
    assert session.messages[1]["content"] == no_thinking
    assert session.options == {"chat_template_kwargs": {"enable_thinking": True}}
    assert one_shot.exit_code == 0 and fake.params[-1].structured_outputs.json_object is True
    assert bad.exit_code == 1 and "--format 'yaml' is not known" in bad.output
    session.set_thinking(None)
    assert session.options == {}

"""Issue 4's cases from public bug reports, one test each, against the real engine on the demo model (CPU, exact).

The server is uvicorn on loopback over ``AsyncLLMEngine`` + ``LLMEngine``; a listener records every engine step's
outputs (``StepLog``), which lets a test see what the engine produced step by step, whatever the HTTP client saw.
Case 9 (preemption) is tests/test_preemption.py.

| case | test |
|---|---|
| 1 stop string over token boundaries, streamed | test_case01_stop_string_spanning_tokens_streaming |
| 2 ``"stop": []`` | test_case02_empty_stop_list_still_stops_at_eos |
| 3 Chinese and emoji, streamed | test_case03_multibyte_characters_never_split_in_stream |
| 4 ``stream_options.include_usage`` | test_case04_include_usage_only_in_one_final_chunk |
| 5 context overflow numbers | test_case05_context_overflow_message_numbers |
| 6 malformed JSON and bad fields | test_case06_bad_requests_are_400_naming_the_field |
| 7 batch invariance (greedy) | test_case07_greedy_batch_invariance_with_15_others |
| 8 seed in a batch | test_case08_seeded_sample_same_alone_and_in_batch |
| 9 preemption | tests/test_preemption.py |
| 10 client disconnect | test_case10_disconnect_aborts_within_one_step_and_frees_blocks |

Also: ``min_tokens`` over HTTP (test_min_tokens_defers_stop_strings_stop_token_ids_and_eos; the sampler's exact
logits are tests/test_sampler.py) and the 64-client load test (tests/test_load.py).
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import httpx
import pytest

pytest.importorskip("engine.llm_engine")

from transformers import AutoTokenizer  # noqa: E402

from engine.outputs import RequestOutput  # noqa: E402
from test_server_fakes import demo_model_server, wait_for  # noqa: E402

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 16
TIMEOUT = 600
PROSE = "In the beginning God created the heaven and the earth. And the earth was"
#: Fifteen prompts of different lengths (3 to about 60 tokens) for the requests that share a batch (cases 7, 8).
OTHER_PROMPTS = [" ".join(["Once upon a time"] * (k + 1)) + f" there were {k} kings" for k in range(15)]


class StepLog:
    """Output listener: ``steps[i]`` lists ``(request_id, tokens so far, text, finish_reason)`` of choice 0 of
    every output of the engine's i-th step (called on the engine thread, before the HTTP side sees them)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, str, str | None]]] = []
        self.lock = threading.Lock()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        with self.lock:
            self.steps.append([(o.request_id, len(o.outputs[0].token_ids), o.outputs[0].text,
                                o.outputs[0].finish_reason) for o in outputs])

    def of(self, request_id: str) -> list[tuple[int, int, str, str | None]]:
        """``(step index, tokens, text, finish_reason)`` of every output of ``request_id``."""
        with self.lock:
            return [(i, n, text, reason) for i, step in enumerate(self.steps)
                    for rid, n, text, reason in step if rid == request_id]

    def last_tokens(self, request_id: str) -> int:
        found = self.of(request_id)
        return found[-1][1] if found else 0


@pytest.fixture(scope="module")
def live():
    """(client, model name, AsyncLLMEngine, StepLog, tokenizer) of a server over the demo model."""
    log = StepLog()
    with demo_model_server(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, cpu_kv_cache_gib=0.25) as (
            url, engine), httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        engine.add_output_listener(log)
        yield client, engine.model_name, engine, log, AutoTokenizer.from_pretrained(engine.config.model)


@pytest.fixture(autouse=True)
def nothing_left_behind(live):
    """After each test: no request in the engine and every KV block free or cached (none leaked)."""
    yield
    client, _, engine, _, _ = live
    wait_for(lambda: engine.num_requests == 0 and engine.get_stats().num_running == 0
             and engine.get_stats().num_waiting == 0, timeout=120, what="engine idle")
    kv = client.get("/v1/kv").json()
    assert (kv["used"], kv["running"], kv["free"] + kv["cached"]) == (0, [], kv["num_blocks"])


def post(client: httpx.Client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, path: str, body: dict) -> list[dict]:
    """The parsed chunks of a streamed response; asserts SSE framing and ``data: [DONE]`` last."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def post_and_stream(client: httpx.Client, path: str, bodies: list[dict]) -> list[tuple[dict, list[dict]]]:
    """``(post(body), stream(body))`` for each of ``bodies``, every request sent at once (a thread each), so that
    they share the engine's steps instead of taking turns; a greedy request's tokens do not depend on its batch on
    the CPU path (case 7), so what a test compares is unchanged."""
    with ThreadPoolExecutor(2 * len(bodies)) as pool:
        posts = [pool.submit(post, client, path, body) for body in bodies]
        streams = [pool.submit(stream, client, path, body) for body in bodies]
        return [(p.result(), s.result()) for p, s in zip(posts, streams)]


def chat_content(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def chat_prompt_len(tok, messages: list[dict]) -> int:
    """Tokens of ``messages`` through the chat template, counted here (not by the server)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def prompt_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---- case 1 ----------------------------------------------------------------------------------------------------
def visible(raw: str, stop: str, finished: bool) -> str:
    """What the client may have seen of ``raw`` (decoded output) with one stop string: up to the match; else
    all of it once finished; else without the longest tail that could still begin ``stop``."""
    hit = raw.find(stop)
    if hit != -1:
        return raw[:hit]
    if finished:
        return raw
    hold = max((n for n in range(1, len(stop)) if raw.endswith(stop[:n])), default=0)
    return raw[:len(raw) - hold]


PROSE_GREEDY = {"prompt": PROSE, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def prose(live) -> tuple[str, list[str], list[int], list[int], list[dict]]:
    """The greedy continuation of PROSE (24 tokens): its text, each token's text, where each token starts and
    ends in the text, and each position's top-2 logprobs."""
    client, model, _, _, _ = live
    full = post(client, "/v1/completions", {"model": model, **PROSE_GREEDY, "logprobs": 2})["choices"][0]
    text, tokens, starts = full["text"], full["logprobs"]["tokens"], full["logprobs"]["text_offset"]
    assert "".join(tokens) == text and len(tokens) == 24 and text.isascii()
    ends = [s + len(t) for s, t in zip(starts, tokens)]  # characters decoded after k + 1 tokens
    return text, tokens, starts, ends, full["logprobs"]["top_logprobs"]


def test_case01_stop_string_spanning_tokens_streaming(live, prose):
    """A stop string starting inside one token and ending inside the token two further on: nothing of it reaches
    the client; a partial match is held back exactly while it can still match and released when it cannot; text
    held back when generation ends is flushed; the stream concatenates to the non-streamed text."""
    client, model, _, log, _ = live
    text, tokens, starts, ends, _ = prose
    base = {"model": model, **PROSE_GREEDY, "logprobs": 0}
    i = next(i for i in range(8, 20) if len(tokens[i]) >= 2 and len(tokens[i + 2]) >= 2
             and text.find(text[starts[i] + 1:ends[i + 2] - 1]) == starts[i] + 1)
    spanning = text[starts[i] + 1:ends[i + 2] - 1]  # from inside token i to inside token i + 2
    never = spanning + "\u2603"  # starts to match there but never completes
    at_end = text[ends[-2] - 3:ends[-2]] + "\u2603"  # the last 3 characters before the last token: held, flushed
    expected = {spanning: (text[:starts[i] + 1], "stop"), never: (text, "length"), at_end: (text, "length")}

    replies = post_and_stream(client, "/v1/completions", [{**base, "stop": [stop]} for stop in expected])
    for (stop, (final_text, reason)), (full, chunks) in zip(expected.items(), replies):
        stop_reason = stop if reason == "stop" else None  # vLLM's extra field: what matched
        assert [(c["text"], c["finish_reason"], c["stop_reason"]) for c in full["choices"]] == \
            [(final_text, reason, stop_reason)]
        seen, num_tokens = "", 0
        for c in chunks:  # every chunk: exactly what may be shown after the tokens it brings
            choice = c["choices"][0]
            seen += choice["text"]
            num_tokens += len(choice["logprobs"]["tokens"])
            finished = choice["finish_reason"] is not None
            assert seen == visible(text[:ends[num_tokens - 1]], stop, finished), (stop, num_tokens)
        assert (seen, chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == \
            (final_text, reason, stop_reason)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        outputs = log.of(chunks[0]["id"])  # the engine's every step, none skipped
        assert [n for _, n, _, _ in outputs] == list(range(1, len(outputs) + 1))
        for _, n, shown, reason_now in outputs:
            assert shown == visible(text[:ends[n - 1]], stop, reason_now is not None), (stop, n)
        held = [n for _, n, shown, r in outputs if r is None and len(shown) < ends[n - 1]]
        assert held, f"nothing was ever held back for {stop!r}"


# ---- case 2 ----------------------------------------------------------------------------------------------------
def test_case02_empty_stop_list_still_stops_at_eos(live):
    """``"stop": []`` is no stop list: the chat template's end token (the EOS, <|im_end|>) still ends the answer
    and is never in the text, streamed or not, even with ``skip_special_tokens: false``."""
    client, model, _, _, tok = live
    assert tok.eos_token == "<|im_end|>"
    base = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 48, "temperature": 0}
    plain = post(client, "/v1/chat/completions", base)
    answer, used = plain["choices"][0]["message"]["content"], plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and used < 48  # ended by the EOS, not the length
    assert "Paris" in answer and "<|im_end|>" not in answer and "<|" not in answer
    extras = ({"stop": []}, {"stop": [], "skip_special_tokens": False}, {"stop": None})
    replies = post_and_stream(client, "/v1/chat/completions", [{**base, **extra} for extra in extras])
    for extra, (r, chunks) in zip(extras, replies):
        assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"],
                r["choices"][0]["stop_reason"], r["usage"]["completion_tokens"]) == (answer, "stop", None, used), extra
        assert chat_content(chunks) == answer
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["stop"]
    raw_prompt = tok.apply_chat_template(base["messages"], add_generation_prompt=True, tokenize=False)
    r = post(client, "/v1/completions", {"model": model, "prompt": raw_prompt, "max_tokens": 48, "temperature": 0,
                                          "stop": []})
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (answer, "stop")


# ---- case 3 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("question", ["请用中文介绍一下你自己。", "Reply only with emoji: happy cat"],
                         ids=["chinese", "emoji"])
def test_case03_multibyte_characters_never_split_in_stream(live, question):
    """Answers made of characters that span several tokens (more tokens than characters): no chunk carries
    U+FFFD and the stream concatenates to the non-streamed text."""
    client, model, _, _, _ = live
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24,
            "temperature": 0}
    [(full, chunks)] = post_and_stream(client, "/v1/chat/completions", [body])
    text = full["choices"][0]["message"]["content"]
    assert not text.isascii() and "\ufffd" not in text and full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 24 > len(text)  # no EOS, so some characters span tokens
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert [d for d in deltas if "\ufffd" in d] == []
    assert "".join(deltas) == text


# ---- case 4 ----------------------------------------------------------------------------------------------------
def test_case04_include_usage_only_in_one_final_chunk(live):
    """With ``include_usage`` every chunk but the last has ``usage: null`` and the last has ``choices: []`` and
    the exact counts; without it no chunk has a ``usage`` key. Both endpoints, n = 2."""
    client, model, _, _, tok = live
    messages = [{"role": "user", "content": "Name three colours."}]
    cases = [("/v1/chat/completions", {"messages": messages}, chat_prompt_len(tok, messages)),
             ("/v1/completions", {"prompt": PROSE}, len(prompt_ids(tok, PROSE)))]
    for path, prompt, prompt_len in cases:
        body = {"model": model, **prompt, "n": 2, "max_tokens": 5, "temperature": 0.8, "seed": 7,
                "ignore_eos": True}
        expected = {"prompt_tokens": prompt_len, "completion_tokens": 10, "total_tokens": prompt_len + 10}
        assert post(client, path, body)["usage"] == expected
        chunks = stream(client, path, {**body, "stream_options": {"include_usage": True}})
        assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected
        assert all(c["choices"] for c in chunks[:-1])
        finishes = sorted((ch["index"], ch["finish_reason"]) for c in chunks for ch in c["choices"]
                          if ch["finish_reason"])
        assert finishes == [(0, "length"), (1, "length")]
        for options in ({}, {"stream_options": {"include_usage": False}}):
            plain = stream(client, path, {**body, **options})
            assert [c for c in plain if "usage" in c] == [] and all(c["choices"] for c in plain)


# ---- case 5 ----------------------------------------------------------------------------------------------------
def test_case05_context_overflow_message_numbers(live):
    """Prompts of known length over ``max_model_len``: 400 ``context_length_exceeded`` with the maximum, the
    total, and the split into prompt (or messages) and completion tokens, all exact."""
    client, model, _, _, tok = live
    head = f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "

    def overflow(path: str, body: dict, where: str) -> str:
        r = client.post(path, json={"model": model, **body})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "context_length_exceeded", where)
        return err["message"]

    ids = (prompt_ids(tok, PROSE) * 20)[:240]  # a token-id prompt: its length is known without the server
    max_tokens = MAX_MODEL_LEN - len(ids) + 1
    assert overflow("/v1/completions", {"prompt": ids, "max_tokens": max_tokens}, "prompt") == (
        f"{head}{MAX_MODEL_LEN + 1} tokens ({len(ids)} in the prompt, {max_tokens} in the completion). "
        f"Please reduce the length of the prompt or completion.")
    messages = [{"role": "user", "content": PROSE}]
    chat_len = chat_prompt_len(tok, messages)
    assert overflow("/v1/chat/completions", {"messages": messages, "max_tokens": 250}, "messages") == (
        f"{head}{chat_len + 250} tokens ({chat_len} in the messages, 250 in the completion). "
        f"Please reduce the length of the messages or completion.")
    long_messages = [{"role": "user", "content": PROSE * 20}]  # no max_tokens: the prompt alone is too long
    long_len = chat_prompt_len(tok, long_messages)
    assert long_len > MAX_MODEL_LEN
    assert overflow("/v1/chat/completions", {"messages": long_messages}, "messages") == (
        f"{head}{long_len} tokens in the messages. Please reduce the length of the messages.")
    ok = post(client, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_tokens - 1,
                                          "temperature": 0, "ignore_eos": True})
    assert ok["usage"]["total_tokens"] == MAX_MODEL_LEN  # one token less fits exactly


# ---- case 6 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,good", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                                       ("/v1/completions", {"prompt": "Hi"})], ids=["chat", "completions"])
def test_case06_bad_requests_are_400_naming_the_field(live, path, good):
    """Malformed JSON, ``"max_tokens": "ten"``, a negative max_tokens and ``temperature: -1``: 400 in the OpenAI
    error shape with the offending field in ``param``."""
    client, model, _, _, _ = live
    cases = [
        (json.dumps({"model": model, **good})[:-1].encode(), "body", "invalid_json"),
        (json.dumps({"model": model, **good, "max_tokens": "ten"}).encode(), "max_tokens", "invalid_type"),
        (json.dumps({"model": model, **good, "max_tokens": -3}).encode(), "max_tokens", "invalid_value"),
        (json.dumps({"model": model, **good, "temperature": -1}).encode(), "temperature", "invalid_value"),
    ]
    for content, param, code in cases:
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        err = r.json()["error"]
        assert (set(err), err["type"], err["param"], err["code"]) == \
            ({"message", "type", "param", "code"}, "invalid_request_error", param, code), content
        assert param in err["message"] or param == "body"
    assert post(client, path, {"model": model, **good, "max_tokens": 1})["usage"]["completion_tokens"] == 1


# ---- cases 7 and 8: one request alone, then in a batch with 15 others ---------------------------------------
@contextmanager
def running_batch(live, bodies: list[dict]) -> Iterator[list[str]]:
    """Streams ``bodies`` (completions) and yields their request ids once all of them run; the clients leave
    (disconnect, so the engine aborts them) on exit. Every request is sent before any first chunk is read, so
    the engine can take them in together rather than one step each."""
    client, _, engine, _, _ = live
    with ExitStack() as stack:
        ids, readers = [], []  # readers stay referenced: a line iterator closed early closes its connection
        responses = [stack.enter_context(client.stream("POST", "/v1/completions", json={**body, "stream": True}))
                     for body in bodies]
        for r in responses:
            assert r.status_code == 200
            readers.append(r.iter_lines())
            first = next(line for line in readers[-1] if line.startswith("data: "))  # skip keep-alive pings
            ids.append(json.loads(first[len("data: "):])["id"])
        wait_for(lambda: engine.get_stats().num_running == len(bodies), timeout=120, what="the batch running")
        yield ids


def others(live, sampled: bool) -> list[dict]:
    """Fifteen long requests of different prompt lengths (greedy and sampled mixed, or all sampled unseeded)
    that cannot finish before the test ends them."""
    _, model, _, _, tok = live
    bodies = []
    for k, text in enumerate(OTHER_PROMPTS):
        ids = prompt_ids(tok, text)
        bodies.append({"model": model, "prompt": ids, "max_tokens": MAX_MODEL_LEN - len(ids), "ignore_eos": True,
                       "temperature": 1.0 if sampled or k % 2 else 0.0})
    assert len({len(b["prompt"]) for b in bodies}) == 15
    return bodies


def shared_steps(log: StepLog, request_id: str, batch: list[str]) -> list[int]:
    """How many of ``batch`` advanced in each step in which ``request_id`` decoded (its second token on)."""
    with log.lock:
        steps = [{rid for rid, *_ in step} for step in log.steps]
    return [len(steps[i] & set(batch)) for i, n, _, _ in log.of(request_id) if n >= 2]


def test_case07_greedy_batch_invariance_with_15_others(live):
    """A greedy request gives the same tokens and logprobs alone and decoding beside 15 running requests of
    other lengths (greedy and sampled): bit for bit on the CPU path."""
    client, model, _, log, _ = live
    body = {"model": model, "prompt": PROSE, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    alone = post(client, "/v1/completions", body)["choices"][0]
    with running_batch(live, others(live, sampled=False)) as batch:
        together = post(client, "/v1/completions", body)
        assert shared_steps(log, together["id"], batch) == [15] * 15  # every decode step beside all 15
    assert together["choices"][0]["text"] == alone["text"]
    assert together["choices"][0]["logprobs"] == alone["logprobs"]  # tokens, logprobs and top-2, exactly


def test_case08_seeded_sample_same_alone_and_in_batch(live):
    """A seeded sampling request gives the same text alone and next to 15 unseeded sampling requests in the same
    batch (its own generator); another seed gives another text, so the seed is what decides."""
    client, model, _, log, _ = live
    body = {"model": model, "prompt": PROSE, "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234,
            "ignore_eos": True}
    alone = post(client, "/v1/completions", body)["choices"][0]["text"]
    with running_batch(live, others(live, sampled=True)) as batch:
        together = post(client, "/v1/completions", body)
        assert shared_steps(log, together["id"], batch) == [15] * 15
    assert together["choices"][0]["text"] == alone
    assert post(client, "/v1/completions", {**body, "seed": 4321})["choices"][0]["text"] != alone


# ---- case 10 ---------------------------------------------------------------------------------------------------
def metric(client: httpx.Client, model: str, name: str, labels: str = "") -> str:
    """The value of one series in /metrics, as Prometheus writes it; ``labels``: those before model_name."""
    prefix = f'{name}{{{labels}model_name="{model}"}} '
    return next(line[len(prefix):] for line in client.get("/metrics").text.splitlines() if line.startswith(prefix))


def test_case10_disconnect_aborts_within_one_step_and_frees_blocks(live, monkeypatch):
    """A streaming client leaves after three chunks: the abort reaches the engine before its next step but one
    (at most the step already running adds a token), the request ends "abort", and the running gauge and the KV
    usage return to their values from before the request."""
    client, model, engine, log, _ = live
    running0 = metric(client, model, "vllm:num_requests_running")
    usage0 = metric(client, model, "vllm:kv_cache_usage_perc")
    assert running0 == "0.0"
    aborted0 = float(metric(client, model, "vllm:request_success_total", 'finished_reason="abort",'))
    aborts: list[tuple[str, int, int]] = []
    original = engine.abort

    def watched_abort(request_id: str) -> None:
        original(request_id)
        aborts.append((request_id, len(log.steps), log.last_tokens(request_id)))

    monkeypatch.setattr(engine, "abort", watched_abort)
    body = {"model": model, "prompt": PROSE, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        request_id = json.loads(next(lines)[len("data: "):])["id"]
        next(lines), next(lines)
        wait_for(lambda: metric(client, model, "vllm:num_requests_running") == "1.0", what="running gauge 1")
        assert float(metric(client, model, "vllm:kv_cache_usage_perc")) > float(usage0)
    wait_for(lambda: log.of(request_id)[-1][3] == "abort", timeout=60, what="abort output")
    [(aborted_id, steps_then, tokens_then)] = aborts
    outputs = log.of(request_id)
    last_step, last_tokens = outputs[-1][0], outputs[-1][1]
    assert aborted_id == request_id and 3 <= tokens_then < 200
    assert last_step <= steps_then + 1 and last_tokens <= tokens_then + 1
    wait_for(lambda: metric(client, model, "vllm:num_requests_running") == running0, what="running gauge back")
    assert metric(client, model, "vllm:kv_cache_usage_perc") == usage0
    wait_for(lambda: float(metric(client, model, "vllm:request_success_total", 'finished_reason="abort",'))
             == aborted0 + 1, what="the abort counted")


# ---- min_tokens (vLLM: no stop check of any kind before min_tokens output tokens) --------------------------
def test_min_tokens_defers_stop_strings_stop_token_ids_and_eos(live, prose):
    """A stop string whose first match ends with the ``min_tokens``-th token is passed over (vLLM V1 looks for stop
    strings only after ``min_tokens`` tokens) and the next match stops; a stop token id is masked, so the first
    token becomes the runner-up; the EOS that ends a chat answer is masked."""
    client, model, _, _, tok = live
    text, tokens, _, ends, top = prose
    stop = tokens[1]
    matches = [i for i in range(len(text)) if text.startswith(stop, i)]
    ended_by = [next(k for k, end in enumerate(ends, 1) if end >= i + len(stop)) for i in matches]
    assert len(matches) >= 2 and ended_by[0] < ended_by[-1]  # a match before min_tokens, another after
    min_tokens = ended_by[0]
    later = next(i for i, k in zip(matches, ended_by) if k > min_tokens)
    for extra, (cut, used) in [({}, (matches[0], ended_by[0])),
                               ({"min_tokens": min_tokens}, (later, ended_by[matches.index(later)]))]:
        r = post(client, "/v1/completions", {"model": model, **PROSE_GREEDY, "stop": [stop], **extra})
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == \
            (text[:cut], "stop", used), extra

    [first_id] = tok.encode(tokens[0], add_special_tokens=False)
    r = post(client, "/v1/completions", {"model": model, **PROSE_GREEDY, "stop_token_ids": [first_id]})
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"],
            r["usage"]["completion_tokens"]) == ("", "stop", first_id, 1)
    runner_up = sorted(top[0].items(), key=lambda kv: -kv[1])[1][0]
    r = post(client, "/v1/completions", {"model": model, **PROSE_GREEDY, "max_tokens": 1, "min_tokens": 1,
                                          "stop_token_ids": [first_id]})
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (runner_up, "length")

    question = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16, "temperature": 0}
    answer = post(client, "/v1/chat/completions", question)
    used = answer["usage"]["completion_tokens"]
    assert answer["choices"][0]["finish_reason"] == "stop" and used < 12
    longer = post(client, "/v1/chat/completions", {**question, "min_tokens": 12})
    content = longer["choices"][0]["message"]["content"]
    assert longer["usage"]["completion_tokens"] >= 12 and "<|im_end|>" not in content
    assert content.startswith(answer["choices"][0]["message"]["content"]) and len(content) > len(
        answer["choices"][0]["message"]["content"])


# ---- a request must never take the engine down --------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"min_tokens": 1, "stop_token_ids": [10**9]}, "stop_token_ids"),  # used to kill the engine (IndexError)
    ({"min_tokens": 1, "stop_token_ids": [-1]}, "stop_token_ids"),  # used to mask the last vocabulary entry
    ({"seed": 2**64}, "seed"),
    ({"min_tokens": 1, "temperature": float("inf")}, "temperature"),  # JSON ``Infinity``: NaN logits killed it
    ({"presence_penalty": float("nan")}, "presence_penalty"),
], ids=["stop-id-over-vocab", "negative-stop-id", "seed-over-64-bits", "infinite-temperature", "nan-penalty"])
def test_values_that_killed_the_engine_are_400_and_it_survives(live, fields, param):
    client, model, engine, _, _ = live
    body = {"model": model, "prompt": PROSE, "max_tokens": 3, "temperature": 0.5}
    r = client.post("/v1/completions", content=json.dumps({**body, **fields}),  # Python's json writes Infinity, NaN
                    headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    assert engine.is_ready and client.get("/health").status_code == 200
    assert post(client, "/v1/completions", body)["usage"]["completion_tokens"] == 3


def test_completion_strings_get_the_tokenizers_special_tokens(live, monkeypatch):
    """vLLM encodes ``/v1/completions`` string prompts with ``add_special_tokens=True`` (a Llama tokenizer's BOS)
    unless the request says ``add_special_tokens: false``; token-id prompts and chat prompts get nothing added
    (the template has its own). The demo tokenizer adds nothing, so here it adds a BOS (its id 1)."""
    client, model, engine, _, tok = live
    served, plain = engine.engine.tokenizer, engine.engine.tokenizer.encode

    def encode(text, add_special_tokens=True, **kw):
        return ([1] if add_special_tokens else []) + plain(text, add_special_tokens=False, **kw)

    monkeypatch.setattr(served, "encode", encode)
    ids = prompt_ids(tok, "Hello there")
    usage = lambda body: post(client, "/v1/completions", {"model": model, "max_tokens": 1, **body})["usage"]
    assert usage({"prompt": "Hello there"})["prompt_tokens"] == len(ids) + 1
    assert usage({"prompt": "Hello there", "add_special_tokens": False})["prompt_tokens"] == len(ids)
    assert usage({"prompt": ids})["prompt_tokens"] == len(ids)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = post(client, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == chat_prompt_len(tok, messages)
    tokenized = post(client, "/tokenize", {"prompt": "Hello there"})
    assert tokenized["tokens"] == [1, *ids] and tokenized["token_strs"] is None
    pieces = post(client, "/tokenize", {"prompt": "Hello there", "return_token_strs": True})["token_strs"]
    assert pieces == tok.convert_ids_to_tokens([1, *ids]) and pieces[1:] == ["Hello", "Ġthere"]


def test_logit_bias_bans_and_forces_tokens(live):
    """OpenAI's logit_bias on the real engine: -100 on the greedy first token makes the runner-up come first; +100
    on a token makes the greedy completion that token."""
    client, model, _, _, tok = live
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0,
            "logprobs": 2}
    first = post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    best, runner_up = sorted(first["top_logprobs"][0].items(), key=lambda kv: -kv[1])[:2]
    [best_id] = tok.encode(best[0], add_special_tokens=False)
    banned = post(client, "/v1/completions", {**body, "logit_bias": {str(best_id): -100}})
    assert banned["choices"][0]["text"] == runner_up[0]
    [forced_id] = tok.encode(" banana", add_special_tokens=False)
    forced = post(client, "/v1/completions", {**body, "max_tokens": 3, "logit_bias": {str(forced_id): 100}})
    assert forced["choices"][0]["text"] == " banana" * 3


def test_allowed_token_ids_truncate_prompt_tokens_and_the_fields_not_followed(live):
    """vLLM's allowed_token_ids (only those sampled) and truncate_prompt_tokens (the prompt's last k tokens) on the
    real engine; min_tokens over what the context leaves (no max_tokens) is a 400, as vLLM checks after defaulting;
    best_of, beam search and bad_words, which this server does not follow, are 400s naming them, not ignored."""
    client, model, _, _, tok = live
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" banana", " apple")]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.9,
            "seed": 1, "allowed_token_ids": allowed}
    out = post(client, "/v1/completions", body)["choices"][0]
    assert out["text"] and set(tok.encode(out["text"], add_special_tokens=False)) <= set(allowed)
    words = {"model": model, "prompt": "one two three four five six", "max_tokens": 1}
    full = post(client, "/v1/completions", words)
    cut = post(client, "/v1/completions", {**words, "truncate_prompt_tokens": 3})
    assert full["usage"]["prompt_tokens"] > 3 and cut["usage"]["prompt_tokens"] == 3
    chat = {"model": model, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2,
            "truncate_prompt_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream(client, "/v1/chat/completions", chat)  # the role chunk, sent before any token, counts 4 too
    assert [c["usage"]["prompt_tokens"] for c in chunks] == [4] * len(chunks)
    assert chunks[0]["usage"]["completion_tokens"] == 0 and chunks[-1]["usage"]["completion_tokens"] == 2
    for extra, param in (({"max_tokens": None, "min_tokens": 10**6}, "min_tokens"), ({"best_of": 3}, "best_of"),
                         ({"best_of": 2, "n": 2}, "best_of"), ({"best_of": 1, "n": 2}, "best_of"),
                         ({"use_beam_search": True}, "use_beam_search"), ({"bad_words": ["Paris"]}, "bad_words"),
                         ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")):
        r = client.post("/v1/completions", json={"model": model, "prompt": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

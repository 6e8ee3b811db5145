"""Test doubles for the server tests: a deterministic fake ``LLMEngine`` and a uvicorn server on a free port.

The fake follows docs/architecture.md's ``LLMEngine`` contract: char-level tokenizer (token id = code point),
one token per running request per ``step()``, stop strings held back until they cannot match, aborted requests
reported once with finish_reason "abort". Its "model" writes ``REPLY`` from an offset given by the prompt length.
"""
from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import uvicorn

from engine.async_engine import AsyncLLMEngine
from engine.errors import ContextLengthError
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

REPLY = "lorem ipsum dolor sit amet, consectetur adipiscing elit."  # the fake's EOS comes after this


class FakeTokenizer:
    """Char-level tokenizer with a ChatML-like template. ``encode`` adds a BOS (``bos_token_id``) only when a test
    sets one, as Llama-family tokenizers do; by default it adds nothing, like the demo model's."""

    eos_token_id = 0
    bos_token_id: int | None = None

    def __len__(self) -> int:
        return 0x110000  # every code point is a token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bos = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        return bos + [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != self.eos_token_id or not skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=False, continue_final_message=False,
                            tokenize=True, **kwargs) -> str:
        text = ""
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")  # like a template's raise_exception
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        text = kwargs.get("prefix", "") + text  # a chat_template_kwargs variable, as enable_thinking is for Qwen3
        if kwargs.get("reasoning_effort"):  # as gpt-oss's template writes it
            text = f"Reasoning: {kwargs['reasoning_effort']}\n" + text
        if kwargs.get("enable_thinking") is False and add_generation_prompt:  # Qwen3's: an empty block, closed
            kwargs["suffix"] = "<think>\n\n</think>\n\n" + kwargs.get("suffix", "")
        text = "".join(f"<tool {t['function']['name']}>" for t in kwargs.get("tools") or []) + text
        text = "".join(f"<doc {d.get('title', '')}>" for d in kwargs.get("documents") or []) + text
        if continue_final_message:  # transformers cuts the rendered text right after the last message's content
            text = text[:-len("<|im_end|>\n")]
        # "suffix": what a template writes after the assistant header (DeepSeek-R1's "<think>\n" opens a block)
        return text + ("<|im_start|>assistant\n" + kwargs.get("suffix", "") if add_generation_prompt else "")


def fake_reply(prompt_len: int, choice: int = 0) -> str:
    """The text the fake generates without limits (the EOS follows it)."""
    start = (prompt_len + 7 * choice) % len(REPLY)
    return REPLY[start:] + REPLY[:start]


def fake_completion(prompt_len: int, params: SamplingParams, choice: int = 0) -> tuple[str, str]:
    """(text, finish_reason) the fake produces for a prompt of ``prompt_len`` tokens."""
    reply, max_tokens = fake_reply(prompt_len, choice), params.max_tokens or 10**9
    text, reason = reply[:max_tokens], "length" if max_tokens <= len(reply) else "stop"
    for s in params.stop:
        if s in text:
            text, reason = text[:text.index(s)], "stop"
    return text, reason


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    metrics: RequestMetrics
    gen: list[list[int]] = field(default_factory=list)  # per choice
    done: list[str | None] = field(default_factory=list)  # per choice finish reason
    logprobs: list[list[dict[int, float]]] = field(default_factory=list)  # per choice, per token


def _prompt_entry(token: int, k: int) -> tuple[dict[int, float], int]:
    """A prompt token's entry and rank as LLMEngine makes them, from a fixed distribution: "#" the most likely
    (-1.0), then the token (-1.5), then "~" (-2.0)."""
    dist = {ord("#"): -1.0, token: -1.5, ord("~"): -2.0}
    top = sorted(dist.items(), key=lambda kv: -kv[1])[:k]
    return {token: dist[token], **dict(top)}, sum(v >= dist[token] for v in dist.values())


class FakeEngine:
    """Deterministic stand-in for ``LLMEngine``; ``step_delay`` slows steps, ``fail_at_step`` makes step N raise;
    ``reply``: the text every choice writes (then its EOS) instead of :func:`fake_reply`'s; ``logprob``: each
    sampled token's logprob (NaN: what NaN logits give)."""

    def __init__(self, max_model_len: int = 256, max_num_seqs: int = 4, block_size: int = 4, num_blocks: int = 512,
                 step_delay: float = 0.0, fail_at_step: int | None = None, reply: str | None = None,
                 logprob: float = -0.25) -> None:
        self.tokenizer = FakeTokenizer()
        self.reply = reply
        self.logprob = logprob
        self.default_sampling: dict = {}  # the model's generation_config.json values (LLMEngine.default_sampling)
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.block_size, self.num_blocks = block_size, num_blocks
        self.model_name = "fake-model"
        self.step_delay, self.fail_at_step = step_delay, fail_at_step
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.pending_aborts: list[_Request] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.idle_checks = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.params: list[SamplingParams] = []  # of every request added, in order
        self.compiled: list[tuple] = []  # every grammar compiled ahead (compile)
        self.grammars: list = []  # the grammar handed over with every request added, in order
        self.prompts: list = []  # the prompt (text or token ids) of every request added, in order

    def add_request(self, request_id, prompt, params, arrival_time=None, grammar=None) -> None:
        self.params.append(params)
        self.grammars.append(grammar)
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < len(self.tokenizer) for t in ids):  # as LLMEngine
            raise ValueError(f"prompt: token ids must be in [0, {len(self.tokenizer)})")
        if any(not 0 <= t < len(self.tokenizer) for t in params.logit_bias or {}):
            raise ValueError(f"logit_bias: token ids must be in [0, {len(self.tokenizer)})")
        if any(r.request_id == request_id for r in [*self.waiting, *self.running]):
            raise ValueError(f"request_id: duplicate {request_id!r}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max(max_tokens, 1) > self.max_model_len:  # as LLMEngine: max_tokens < 1 when none was given
            raise ContextLengthError(self.max_model_len, len(ids), max_tokens)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.waiting.append(_Request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                                     max_tokens, metrics, [[] for _ in range(params.n)], [None] * params.n,
                                     [[] for _ in range(params.n)]))

    def grammar_compiler(self) -> FakeEngine:
        """As ``LLMEngine.grammar_compiler``: the async engine compiles a structured request's grammar on a worker
        thread first (:meth:`compile`)."""
        return self

    def compile(self, spec) -> tuple:
        """A stand-in grammar: ("grammar", spec, the compiling thread's name), also kept in ``compiled``."""
        grammar = ("grammar", spec, threading.current_thread().name)
        self.compiled.append(grammar)
        return grammar

    def abort_request(self, request_id: str) -> None:
        for r in [*self.waiting, *self.running]:
            if r.request_id == request_id:
                (self.waiting if r in self.waiting else self.running).remove(r)
                r.done = ["abort"] * len(r.done)
                self.pending_aborts.append(r)
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self.idle_checks += 1
        return bool(self.waiting or self.running or self.pending_aborts)

    def step(self) -> list[RequestOutput]:
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("fake engine failure")
        self.steps += 1
        time.sleep(self.step_delay)
        now = time.monotonic()
        outputs = [self._output(r) for r in self.pending_aborts]
        self.pending_aborts.clear()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.popleft()
            r.metrics.first_scheduled_time = now
            self.prompt_tokens_total += len(r.prompt_ids)
            self.running.append(r)
        for r in list(self.running):
            self._advance(r, now)
            outputs.append(self._output(r))
            if all(r.done):
                r.metrics.finished_time = now
                self.running.remove(r)
        return outputs

    def _advance(self, r: _Request, now: float) -> None:
        for c, toks in enumerate(r.gen):
            if r.done[c]:
                continue
            reply = self.reply if self.reply is not None else fake_reply(len(r.prompt_ids), c)
            if len(toks) >= len(reply) and not r.params.ignore_eos:
                r.done[c] = "stop"
                continue
            toks.append(ord(reply[len(toks) % len(reply)]))
            if r.params.logprobs is not None:
                r.logprobs[c].append({toks[-1]: self.logprob, ord("#"): -2.0, ord("~"): -3.0})
            self.generation_tokens_total += 1
            r.metrics.first_token_time = r.metrics.first_token_time or now
            r.metrics.last_token_time = now
            text = self.tokenizer.decode(toks)
            if any(s in text for s in r.params.stop):
                r.done[c] = "stop"
            elif len(toks) >= r.max_tokens:
                r.done[c] = "length"

    def _output(self, r: _Request) -> RequestOutput:
        choices = []
        for c, toks in enumerate(r.gen):
            text = self.tokenizer.decode(toks)
            text = _cut_stop(text, r.params.stop, final=r.done[c] is not None)
            logprobs = list(r.logprobs[c]) if r.params.logprobs is not None else None
            choices.append(CompletionOutput(index=c, text=text, token_ids=list(toks), finish_reason=r.done[c],
                                            logprobs=logprobs))
        prompt_logprobs = ranks = None  # as LLMEngine: None for the first prompt token, then {token: logprob,
        # top k} and the token's rank
        if r.params.prompt_logprobs is not None:
            pairs = [_prompt_entry(t, r.params.prompt_logprobs) for t in r.prompt_ids[1:]]
            prompt_logprobs, ranks = [None] + [e for e, _ in pairs], [None] + [n for _, n in pairs]
        return RequestOutput(r.request_id, r.prompt, list(r.prompt_ids), choices, all(r.done), r.metrics,
                             prompt_logprobs=prompt_logprobs, prompt_logprob_ranks=ranks)

    def get_stats(self) -> EngineStats:
        held = [(r.request_id, math.ceil((len(r.prompt_ids) + len(r.gen[0])) / self.block_size))
                for r in self.running]
        used = sum(n for _, n in held)
        states = "#" * used + "." * (self.num_blocks - used)
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           block_size=self.block_size, num_blocks=self.num_blocks,
                           num_free_blocks=self.num_blocks - used, num_cached_blocks=0,
                           kv_cache_usage=used / self.num_blocks, prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=self.generation_tokens_total, running=held,
                           block_states=states)


def _cut_stop(text: str, stops: list[str], final: bool) -> str:
    """Remove a matched stop string and what follows; while running also hold back a partial match."""
    for s in stops:
        if s in text:
            return text[:text.index(s)]
    if final:
        return text
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a thread: ``with ServerThread(app) as url:``."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn start")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def run(coro, timeout: float = 20.0):
    """Run ``coro`` on a fresh event loop, failing after ``timeout`` seconds instead of hanging."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextmanager
def started_engine(fake) -> Iterator[AsyncLLMEngine]:
    """An ``AsyncLLMEngine`` over ``fake``, started and ready; shut down on exit."""
    eng = AsyncLLMEngine(lambda: fake, "fake-model")
    eng.start()
    wait_for(lambda: eng.is_ready, what="engine ready")
    try:
        yield eng
    finally:
        eng.shutdown()


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """Poll ``predicate`` until truthy (returned) or fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def demo_model_server(*, engine_process: bool = False, **config_kw) -> Iterator[tuple[str, object]]:
    """``(base URL, AsyncLLMEngine)`` of uvicorn serving the real engine over the demo model on the CPU, loaded;
    ``config_kw`` are ``EngineConfig`` fields; ``engine_process``: the engine in a process of its own. Skips the
    test when the demo model is not installed."""
    from appliance.demo_model import DemoModelMissing, demo_model_dir
    from engine.config import EngineConfig
    from engine.server.api_server import build_app

    try:
        model_dir = demo_model_dir()
    except DemoModelMissing as e:
        pytest.skip(str(e))
    engine = AsyncLLMEngine.from_config(EngineConfig(model=str(model_dir), device="cpu", **config_kw),
                                        engine_process=engine_process)
    try:
        with ServerThread(build_app(engine)) as url:
            wait_for(lambda: engine.is_ready or engine.is_dead, timeout=300, what="model load")
            assert engine.is_ready, engine.error
            yield url, engine
    finally:
        engine.shutdown()

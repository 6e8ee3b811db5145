"""The engine in a process of its own (engine/engine_process.py): outputs as deltas, and the demo model behind
``AsyncLLMEngine`` in a spawned child giving what the engine thread gives, refusing bad requests at once, aborting,
and dying cleanly."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import queue
import signal
import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import httpx
import pytest

from engine import engine_process as ep
from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.config import EngineConfig
from engine.errors import ContextLengthError, EngineWakeFailed, StepFailed
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from test_server_fakes import demo_model_server, run, wait_for


def _out(rid, choices, finished=False, prompt_lp=None, ranks=None, cached=0):
    return RequestOutput(rid, None, [1, 2, 3], choices, finished, RequestMetrics(arrival_time=1.5),
                         num_cached_tokens=cached, prompt_logprobs=prompt_lp, prompt_logprob_ranks=ranks)


def test_deltas_rebuild_every_cumulative_output_without_changing_earlier_ones():
    """Two choices; text that a stop string takes back ("ab." -> "a"); logprobs with their ranks and sum; prompt
    logprobs from the second output on; a second request interleaved; finish."""
    steps = [
        [_out("r", [CompletionOutput(0, "He", [7], logprobs=[{7: -0.5}], cumulative_logprob=-0.5, logprob_ranks=[1]),
                    CompletionOutput(1, "", [9])]),
         _out("s", [CompletionOutput(0, "x", [4])])],
        [_out("r", [CompletionOutput(0, "Hello", [7, 8], logprobs=[{7: -0.5}, {8: -1.0}], cumulative_logprob=-1.5,
                                     logprob_ranks=[1, 3]),
                    CompletionOutput(1, "ab.", [9, 10])], prompt_lp=[None, {2: -2.0}], ranks=[None, 1], cached=16)],
        [_out("r", [CompletionOutput(0, "Hello!", [7, 8, 3], "stop", None, [{7: -0.5}, {8: -1.0}, {3: -0.1}], -1.6,
                                     [1, 3, 2]),
                    CompletionOutput(1, "a", [9, 10, 11], "stop", ".")], True, [None, {2: -2.0}], [None, 1], 16),
         _out("s", [CompletionOutput(0, "xy", [4, 5], "length")], True)],
    ]
    encoder, decoder = ep._Encoder(), ep._Decoder()
    decoder.add("r", None, [1, 2, 3])
    decoder.add("s", None, [1, 2, 3])
    got = []
    for outputs in steps:
        expect = copy.deepcopy(outputs)
        got.append(decoder.decode(encoder.encode(outputs)))
        assert got[-1] == expect
    assert got[0][0].outputs[0].token_ids == [7] and got[1][0].outputs[1].text == "ab."  # untouched by later steps
    assert decoder.held == {} and encoder._sent == {} and encoder._prompt_lp_sent == set()
    second = encoder.encode([steps[1][0]])[0]
    assert second[1][0][1] == [7, 8] and second[5] is not None  # a forgotten request starts over: the whole output


def test_text_that_only_grows_is_sent_without_a_character_by_character_compare(monkeypatch):
    """The child encodes every output of every step: while the text only grows (no stop string took any back) the
    kept prefix is the text sent, found by one ``startswith``. ``os.path.commonprefix`` loops in Python over every
    character; as the only path it cost 19.6 ms a step at 256 outputs of 2,000 characters and halved the H200
    server's tok/s at 256 streams (bench/RESULTS.md, run 90)."""
    encoder = ep._Encoder()
    encoder.encode([_out("r", [CompletionOutput(0, "Hello", [7])])])
    monkeypatch.setattr(ep.os.path, "commonprefix", lambda m: pytest.fail("compared character by character"))
    delta = encoder.encode([_out("r", [CompletionOutput(0, "Hello world", [7, 8])])])
    assert delta[0][1][0][3:5] == (5, " world")


def test_a_delta_of_an_unknown_request_reaches_nobody():
    decoder = ep._Decoder()
    assert decoder.decode(ep._Encoder().encode([_out("gone", [CompletionOutput(0, "a", [1])])])) == []


def test_exceptions_cross_as_themselves_or_as_their_kind():
    assert isinstance(ep._portable(FileNotFoundError(2, "nope")), FileNotFoundError)
    ctx = ep._portable(ContextLengthError(10, 8, 4))  # its __init__ takes three arguments: it does not unpickle
    assert type(ctx) is ValueError and str(ctx).startswith("ContextLengthError: This model's maximum")


class _Refusing:
    def add_request(self, *a, **k):
        raise ValueError("grammar: cannot follow it")

    def get_stats(self):
        return "stats"


def test_an_add_the_child_refuses_fails_that_request_alone():
    parent, child = Pipe()
    assert ep._apply(_Refusing(), ("add", "r1", [1], SamplingParams(), 0.0), child, ep._Encoder())
    kind, ids, cause, request_error, deltas, stats = parent.recv()
    assert (kind, ids, str(cause), request_error, deltas, stats) == (
        "step_failed", ["r1"], "grammar: cannot follow it", True, [], "stats")
    assert ep._apply(_Refusing(), ("stop",), child, ep._Encoder()) is False


def test_wanted_on_cuda_only():
    assert ep.wanted(EngineConfig(model="m", device="cuda"))
    assert not ep.wanted(EngineConfig(model="m", device="cpu"))


def _engine(demo_model, own_process: bool) -> AsyncLLMEngine:
    eng = AsyncLLMEngine.from_config(EngineConfig(model=str(demo_model), device="cpu", max_model_len=256,
                                                  max_num_seqs=8), engine_process=own_process)
    eng.start()
    wait_for(lambda: eng.is_ready or eng.is_dead, timeout=300, what="model load")
    assert eng.is_ready, eng.error
    return eng


@pytest.fixture(scope="module")
def own_process(demo_model):
    eng = _engine(demo_model, True)
    yield eng
    eng.shutdown()


REQUESTS = [("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, logprobs=1, stop=["."])),
            ("1, 2, 3, 5, 8,", SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=1)),
            ("Hello", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8)),
            ([504, 3458, 282], SamplingParams(temperature=0, max_tokens=6, stop=[" the"], include_stop_str_in_output=True)),
            ("Is the sky blue? Answer:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
                StructuredOutputsParams(choice=["yes", "no", "maybe not"]))))]  # its grammar compiled in the child


async def _final(eng, prompt, params, rid):
    last = None
    async for out in eng.generate(prompt, params, rid):
        last = out
    return last


def _answers(eng):
    async def main():
        return await asyncio.gather(*(_final(eng, p, sp, f"q{i}") for i, (p, sp) in enumerate(REQUESTS)))
    outs = run(main(), timeout=300)
    for out in outs:
        out.metrics = None  # timestamps
    return outs


def test_a_process_of_its_own_answers_as_the_engine_thread(demo_model, own_process):
    here = _engine(demo_model, False)
    try:
        expect = _answers(here)
    finally:
        here.shutdown()
    got = _answers(own_process)
    assert got == expect
    assert got[0].prompt == "The quick brown fox" and got[3].prompt is None and len(got[2].outputs) == 2
    assert got[4].outputs[0].text in ("yes", "no", "maybe not")
    assert own_process.get_stats().generation_tokens_total >= sum(len(c.token_ids) for o in got for c in o.outputs)


def test_bad_requests_are_refused_at_once(own_process):
    with pytest.raises(ContextLengthError):
        run(own_process.add_request("long", "hi " * 300, SamplingParams(max_tokens=8)))
    with pytest.raises(ValueError, match="must not be empty"):
        run(own_process.add_request("empty", [], SamplingParams(max_tokens=8)))
    assert own_process.num_requests == 0 and own_process.is_ready


def test_an_abort_ends_the_request_and_its_id_serves_again(own_process):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        seen = 0
        async with contextlib.aclosing(own_process.generate("Once upon a time", params, "same")) as outs:
            async for _ in outs:
                seen += 1
                if seen == 2:
                    break  # closing the generator aborts the request
        return await _final(own_process, "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                            "same")

    out = run(main(), timeout=300)
    assert out.finished and len(out.outputs[0].token_ids) == 3
    wait_for(lambda: own_process.get_stats().num_running == 0, what="the abort reaching the child")


def test_a_folder_that_is_no_model_makes_the_engine_dead_with_its_error(tmp_path):
    eng = AsyncLLMEngine.from_config(EngineConfig(model=str(tmp_path), device="cpu"), engine_process=True)
    eng.start()
    wait_for(lambda: eng.is_dead, timeout=120, what="the load failing")
    assert isinstance(eng.error, FileNotFoundError) and "no config.json" in str(eng.error)


def test_a_killed_engine_process_fails_its_requests_and_the_engine_is_dead(demo_model):
    eng = _engine(demo_model, True)
    child = eng.engine._process
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = await eng.add_request("dies", "Once upon a time", params)
        await stream.__anext__()
        os.kill(child.pid, signal.SIGKILL)
        async for _ in stream:
            pass

    try:
        with pytest.raises(EngineDeadError):
            run(main(), timeout=120)
        wait_for(lambda: eng.is_dead, what="the engine dead")
        assert isinstance(eng.error, ep.EngineProcessDied) and "exited (exit code -9)" in str(eng.error)
    finally:
        eng.shutdown()


def test_shutdown_stops_the_engine_process(demo_model):
    eng = _engine(demo_model, True)
    child = eng.engine._process
    eng.shutdown()
    assert not child.is_alive() and child.exitcode == 0


def test_an_idle_engine_process_sleeps_and_the_next_request_wakes_it(demo_model, tmp_path, monkeypatch):
    """sleep_after_idle_s=1: once idle, the child exits (its memory freed) and the engine stays ready; a request
    loads it again and gets the same greedy answer; the token counters count on. A model folder gone by then
    fails the requests alone (EngineWakeFailed; three at once try one load) and the engine stays asleep; once the
    folder is back, the next request wakes it."""
    monkeypatch.setattr(ep, "WAKE_RETRY_S", 1.0)
    model = tmp_path / "model"
    model.mkdir()
    for f in demo_model.iterdir():
        (model / f.name).symlink_to(f)
    eng = AsyncLLMEngine.from_config(EngineConfig(model=str(model), device="cpu", max_model_len=256, max_num_seqs=8),
                                     engine_process=True, sleep_after_idle_s=1.0)
    eng.start()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        wait_for(lambda: eng.is_ready or eng.is_dead, timeout=300, what="model load")
        first = run(_final(eng, "The quick brown fox", params, "a"), timeout=120)
        child = eng.engine._process
        wait_for(lambda: eng.engine.asleep, timeout=30, what="the engine asleep")
        assert not child.is_alive() and child.exitcode == 0 and eng.engine.pid is None and eng.is_ready
        stats = eng.get_stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.generation_tokens_total == 8
        again = run(_final(eng, "The quick brown fox", params, "b"), timeout=300)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids and len(first.outputs[0].token_ids) == 8
        assert not eng.engine.asleep and eng.engine.pid not in (None, child.pid)
        assert eng.get_stats().generation_tokens_total == 16  # counters go on counting over the sleep
        steps = eng.get_stats().iteration_tokens  # each run: its prompt in one step, then 7 one-token steps
        assert (steps.sum, sum(steps.counts), steps.counts[0]) == (2 * (len(first.prompt_token_ids) + 7), 16, 14)
        wait_for(lambda: eng.engine.asleep, timeout=30, what="the engine asleep again")
        model.rename(tmp_path / "gone")
        starts, start = [], eng.engine._start
        eng.engine._start = lambda: (starts.append(1), start())[1]

        async def three():
            return await asyncio.gather(*(_final(eng, "The quick brown fox", params, f"c{i}") for i in range(3)),
                                        return_exceptions=True)
        failed = run(three(), timeout=300)
        assert all(isinstance(e, EngineWakeFailed) for e in failed) and len(starts) == 1  # one load tried
        assert sorted("not tried again yet" in str(e) for e in failed) == [False, True, True]
        assert all("loading the model again failed: FileNotFoundError" in str(e) for e in failed)
        assert eng.engine.asleep and eng.is_ready and not eng.waking and eng.get_stats().num_waiting == 0
        (tmp_path / "gone").rename(model)
        time.sleep(ep.WAKE_RETRY_S)  # 1 s here (monkeypatched above)
        third = run(_final(eng, "The quick brown fox", params, "d"), timeout=300)
        assert third.outputs[0].token_ids == first.outputs[0].token_ids and not eng.engine.asleep
        assert eng.get_stats().generation_tokens_total == 24
    finally:
        eng.shutdown()


def _never_loads(*args) -> None:
    """An engine process's main that never says ready (a CUDA start stuck, say)."""
    time.sleep(600)


def test_a_shutdown_during_a_wake_that_hangs_stops_it_and_wakes_nothing_more(demo_model):
    eng = AsyncLLMEngine.from_config(EngineConfig(model=str(demo_model), device="cpu", max_model_len=256,
                                                  max_num_seqs=8), engine_process=True, sleep_after_idle_s=0.0)
    eng.start()
    params, results = SamplingParams(temperature=0, max_tokens=4), []
    try:
        wait_for(lambda: eng.is_ready or eng.is_dead, timeout=300, what="model load")
        wait_for(lambda: eng.engine.asleep, timeout=30, what="the engine asleep")
        asleep_child = eng.engine._process
        eng.engine._child_main = _never_loads

        async def three():
            return await asyncio.gather(*(_final(eng, "Hi", params, f"r{i}") for i in range(3)),
                                        return_exceptions=True)
        asking = threading.Thread(target=lambda: results.extend(run(three(), timeout=120)))
        asking.start()
        wait_for(lambda: eng.engine._process is not asleep_child and eng.engine._process.is_alive(), timeout=60,
                 what="the wake's child started")
        waking = eng.engine._process
        # the wake is shown: /v1/kv's "waking", its request as waiting and the two queued behind it too (the
        # asleep snapshot showed 0, then the waking one only)
        assert eng.waking and eng.asleep
        wait_for(lambda: eng.get_stats().num_waiting == 3, timeout=10, what="three requests waiting")
        assert eng.engine.get_stats().num_waiting == 1  # the engine's own: the waking request
    finally:
        eng.shutdown(timeout=2.0)
    asking.join(60)
    assert not asking.is_alive() and not eng._thread.is_alive() and not waking.is_alive()
    assert eng.engine._process is waking  # no second wake was tried
    assert len(results) == 3 and all(isinstance(r, (EngineWakeFailed, EngineDeadError)) for r in results), results


def test_a_failed_wake_is_a_503_with_retry_after():
    from engine.server.errors import from_engine_exception

    err = from_engine_exception(EngineWakeFailed("loading the model again failed: OutOfMemoryError"), "prompt")
    assert (err.status, err.code, err.headers) == (503, "model_load_failed", {"Retry-After": "10"})
    assert err.message == ("The model was unloaded while idle (loading the model again failed: OutOfMemoryError); "
                           "retry later, or free the GPU's memory")


def test_the_server_streams_and_counts_through_the_engine_process():
    with demo_model_server(engine_process=True, max_model_len=256, max_num_seqs=4) as (url, engine):
        assert engine.engine.pid != os.getpid()
        body = {"model": engine.model_name, "prompt": "In the beginning God created", "max_tokens": 8,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 8
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        full = httpx.post(f"{url}/v1/completions", json={k: v for k, v in body.items() if k not in ("stream", "stream_options")}, timeout=300).json()
        assert text == full["choices"][0]["text"] and text.strip()
        metrics = httpx.get(f"{url}/metrics").text
        assert "vllm:generation_tokens_total" in metrics
        line = next(x for x in metrics.splitlines() if x.startswith("vllm:generation_tokens_total{"))
        assert float(line.split()[-1]) == 16.0


class _Chatty:
    """A stand-in ``LLMEngine`` for ``_serve``: each request finishes in one step with a large output, and each
    step's stats are large (as a GPU's ``block_states``, one character per KV block)."""

    idle_look_s = None
    model_name, max_model_len, vocab_size, eos_token_ids, default_sampling = "chatty", 64, 100, {0}, {}
    runner = type("R", (), {"model": type("M", (), {"config": {"vocab_size": 100}})()})()

    def __init__(self, config):
        self.pending: list[str] = []

    def add_request(self, request_id, ids, params, arrival_time=None, grammar=None):
        self.pending.append(request_id)

    def abort_request(self, request_id):
        pass

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        rid = self.pending.pop(0)
        return [_out(rid, [CompletionOutput(0, "x" * 20_000, [5], "length")], finished=True)]

    def get_stats(self):
        return "." * 20_000

    def idle(self):
        pass


class _Inbox(queue.SimpleQueue):
    """The child's command queue, letting a test wait until a command is in it."""

    def __init__(self):
        super().__init__()
        self.arrived = threading.Condition()
        self.count = 0

    def put(self, item, *a, **k):
        super().put(item, *a, **k)
        with self.arrived:
            self.count += 1
            self.arrived.notify_all()

    def wait_for(self, count):
        with self.arrived:
            assert self.arrived.wait_for(lambda: self.count >= count, timeout=30), "the command never arrived"


@contextlib.contextmanager
def _child(monkeypatch, engine_cls, collect: bool = True):
    """``_serve`` on a thread over two pipes, with ``engine_cls`` as its LLMEngine: yields (commands, the
    messages it sent so far (a list a thread fills; with ``collect`` False the outputs pipe itself), the engine)
    once it said "ready"."""
    import engine.llm_engine
    made, inbox = [], _Inbox()
    engine_cls.inbox = inbox
    monkeypatch.setattr(engine.llm_engine, "LLMEngine", lambda config: made.append(engine_cls(config)) or made[0])
    monkeypatch.setattr(ep.signal, "signal", lambda *a: None)  # _serve runs in a thread here, not a process
    monkeypatch.setattr(ep, "queue", SimpleNamespace(SimpleQueue=lambda: inbox, Empty=queue.Empty))
    commands_in, commands = Pipe(duplex=False)
    outputs, outputs_out = Pipe(duplex=False)
    child = threading.Thread(target=ep._serve, args=(EngineConfig(model="m"), commands_in, outputs_out, 30),
                             daemon=True)
    child.start()
    assert outputs.recv()[0] == "ready"
    got: list[tuple] = []

    def read_all():
        with contextlib.suppress(EOFError, OSError):
            while True:
                got.append(outputs.recv())
    if collect:
        threading.Thread(target=read_all, daemon=True).start()
    try:
        yield commands, got if collect else outputs, made[0]
    finally:
        commands.send(("stop",))
        child.join(10)
        assert not child.is_alive()


def test_a_parent_sending_while_the_child_sends_never_deadlocks(monkeypatch):
    """The parent sends 300 adds of 20 KB each before it reads anything, while the child's outputs fill the other
    pipe: both pipes fill. With one duplex pipe and no reader thread in the child, each side waited in ``send``
    for the other forever (seen on an H200 at 16 concurrent streams)."""
    with _child(monkeypatch, _Chatty, collect=False) as (commands, outputs, _):
        n = 300
        sender = threading.Thread(target=lambda: [commands.send(("add", f"r{i}", [1] * 5_000, SamplingParams(), 0.0))
                                                  for i in range(n)], daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "the parent's sends deadlocked against the child's"
        finished = []
        while len(finished) < n:
            assert outputs.poll(60), "no output from the child"
            msg = outputs.recv()
            assert msg[0] == "step" and len(msg[2]) == 20_000
            finished += [d[0] for d in msg[1] if d[2]]
        assert finished == [f"r{i}" for i in range(n)]


def test_an_engine_process_killed_while_the_server_waits_makes_the_engine_dead(demo_model):
    """No request runs: the engine thread's idle looks find the child gone, so /health says so before any client
    sends a request into a dead engine."""
    eng = _engine(demo_model, True)
    child = eng.engine._process
    try:
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: eng.is_dead, timeout=30, what="the engine dead")
        assert isinstance(eng.error, ep.EngineProcessDied) and "exit code -9" in str(eng.error)
    finally:
        eng.shutdown()


class _Scripted(_Chatty):
    """A stand-in ``LLMEngine`` whose running requests each get one token a step and never finish. With
    ``fail_next`` set, its next step sets ``failing``, waits until ``before_failing`` commands reached the inbox,
    then fails "x" the way ``LLMEngine`` does when a read-back raises: an output of "x" made before the failure is
    held and comes with the next step. ``grammar_compiler().compile`` returns "G" once ``compile_after`` steps
    ran; a spec whose regex is "bad" raises ValueError at once."""

    inbox: _Inbox

    def __init__(self, config):
        self.running, self.held, self.log, self.steps = {}, [], [], 0
        self.stepped = threading.Condition()
        self.fail_next, self.failing, self.before_failing, self.compile_after = False, threading.Event(), 0, 0

    def add_request(self, request_id, ids, params, arrival_time=None, grammar=None):
        self.log.append(("add", request_id, grammar))
        self.running[request_id] = 0

    def has_unfinished_requests(self):
        return bool(self.running or self.held)

    def step(self):
        with self.stepped:
            self.steps += 1
            self.stepped.notify_all()
        self.log.append(("step",))
        outputs, self.held = self.held, []
        for rid in self.running:
            self.running[rid] += 1
        now = [_out(rid, [CompletionOutput(0, "t" * n, [5] * n)]) for rid, n in self.running.items()]
        if self.fail_next:
            self.fail_next = False
            self.failing.set()
            self.inbox.wait_for(self.before_failing)
            del self.running["x"]
            self.held = outputs + now  # "x"'s output of this step among them
            self.log.append(("failed",))
            raise StepFailed(["x"], RuntimeError("device error at read-back"))
        return outputs + now

    def grammar_compiler(self):
        engine = self

        class Compiler:
            def compile(self, spec):
                if spec.regex == "bad":
                    raise ValueError("structured_outputs: not a regex this server can follow")
                with engine.stepped:
                    assert engine.stepped.wait_for(lambda: engine.steps >= engine.compile_after, timeout=30), \
                        "the engine did not step while the grammar compiled"
                return "G"
        return Compiler()


def test_a_failed_requests_held_output_never_reaches_a_new_request_of_its_id(monkeypatch):
    """A step fails "x" and holds an output of it; a new "x" reaches the child's inbox while that step runs. The
    child runs the next step before it applies the add, and drops the old "x"'s output there: the new "x" gets
    only its own (one token at its first step)."""
    with _child(monkeypatch, _Scripted) as (commands, got, engine):
        commands.send(("add", "x", [1], SamplingParams(), 0.0))
        commands.send(("add", "y", [1], SamplingParams(), 0.0))
        wait_for(lambda: set(engine.running) == {"x", "y"}, timeout=30, what="both running")
        engine.before_failing, engine.fail_next = 3, True
        assert engine.failing.wait(30)
        commands.send(("add", "x", [2], SamplingParams(), 0.0))
        wait_for(lambda: any(m[0] == "step_failed" for m in got) and len(got) > got.index(
            next(m for m in got if m[0] == "step_failed")) + 2, timeout=30, what="two steps after the failure")
    at = next(i for i, m in enumerate(got) if m[0] == "step_failed")
    assert got[at][1] == ["x"] and [d[0] for d in got[at + 1][1]] == ["y", "y"]  # held y, then this step's
    decoder = ep._Decoder()
    decoder.add("x", None, [2])
    new = got[at + 2]
    assert [d[0] for d in new[1]] == ["y", "x"]
    assert [o.outputs[0].token_ids for o in decoder.decode(new[1])] == [[5]]
    failed = engine.log.index(("failed",))
    assert engine.log[failed + 1:failed + 3] == [("step",), ("add", "x", None)]


def test_the_child_compiles_a_grammar_while_its_requests_step(monkeypatch):
    """The compile returns only once the engine stepped three times more: compiled on the child's main loop it
    would wait for steps that never come. The add then carries the compiled grammar; a failed compile fails that
    request alone (a 400: request_error)."""
    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="bad"))
    with _child(monkeypatch, _Scripted) as (commands, got, engine):
        commands.send(("add", "y", [1], SamplingParams(), 0.0))
        wait_for(lambda: engine.steps >= 1, timeout=30, what="a step")
        engine.compile_after = engine.steps + 3
        commands.send(("add", "s", [1], regex, 0.0))
        commands.send(("add", "b", [1], bad, 0.0))
        wait_for(lambda: any(m[0] == "step_failed" for m in got), timeout=30, what="the bad grammar refused")
        wait_for(lambda: ("add", "s", "G") in engine.log, timeout=30, what="the structured request added")
    refused = [(m[1], m[3], str(m[2])) for m in got if m[0] == "step_failed"]
    assert refused == [(["b"], True, "structured_outputs: not a regex this server can follow")]


def test_requests_sent_to_the_child_wait_until_its_snapshot_has_them(demo_model):
    """The child's snapshot is its last step's: requests sent since count as waiting (they were in no count until
    the child's next step), and once it stepped its own count has them, not twice."""
    engine = ep.EngineProcess(EngineConfig(model=str(demo_model), device="cpu", max_model_len=256, max_num_seqs=2))
    try:
        assert engine.get_stats().num_waiting == 0
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"r{i}", "Hello", params)
        stats = engine.get_stats()
        assert (stats.num_running, stats.num_waiting) == (0, 3)  # none in the child's snapshot yet
        engine.step()  # the child's first step: it may have begun before the last adds reached it
        stats = engine.get_stats()
        assert stats.num_running in (1, 2) and stats.num_running + stats.num_waiting == 3  # each counted once
        while engine.has_unfinished_requests():
            engine.step()
        assert (engine.get_stats().num_running, engine.get_stats().num_waiting) == (0, 0)
    finally:
        engine.close()

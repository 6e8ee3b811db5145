"""AsyncLLMEngine against the deterministic fake engine: delivery, concurrency, abort, errors, idling."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.errors import ContextLengthError
from engine.sampling_params import SamplingParams
from test_server_fakes import FakeEngine, fake_completion, run, started_engine, wait_for


@pytest.fixture
def fake():
    return FakeEngine(max_model_len=128, max_num_seqs=2)


@pytest.fixture
def engine(fake):
    with started_engine(fake) as eng:
        yield eng


async def _collect(eng, prompt, params, request_id):
    return [out async for out in eng.generate(prompt, params, request_id)]


def test_generate_yields_cumulative_outputs_until_finished(engine):
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = run(_collect(engine, "hello", params, "r1"))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert (outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason) == fake_completion(5, params)


def test_concurrent_requests_beyond_max_num_seqs_all_complete(engine):
    params = SamplingParams(temperature=0, max_tokens=9)
    prompts = ["a" * k for k in range(1, 7)]

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))

    results = run(main())
    got = [(outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason) for outs in results]
    assert got == [fake_completion(len(p), params) for p in prompts]


def test_cancelling_the_consumer_aborts_the_request(fake, engine):
    fake.step_delay = 0.01
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("prompt", params, "victim"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    wait_for(lambda: "victim" in fake.aborted, what="abort reaching the engine")
    wait_for(lambda: engine.get_stats().num_running == 0 and not fake.pending_aborts, what="engine idle")
    assert not fake.running and not fake.waiting and fake.aborted == ["victim"] and engine.num_requests == 0


def test_rejections_reach_the_caller(engine):
    with pytest.raises(ContextLengthError) as info:
        run(_collect(engine, "x" * 100, SamplingParams(max_tokens=50), "long"))
    assert (info.value.max_model_len, info.value.prompt_tokens, info.value.completion_tokens) == (128, 100, 50)
    with pytest.raises(ValueError, match="prompt"):
        run(_collect(engine, "", SamplingParams(max_tokens=5), "empty"))


def test_step_failure_makes_engine_dead_and_fails_requests(fake, engine):
    fake.fail_at_step = 0
    with pytest.raises(EngineDeadError):
        run(_collect(engine, "hello", SamplingParams(max_tokens=5), "doomed"))
    assert engine.is_dead and isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        run(_collect(engine, "hello", SamplingParams(max_tokens=5), "after"))


def test_death_listeners_hear_a_serving_engine_die_once(fake, engine):
    """After its requests have the error; the exception that killed it is what the listeners get."""
    heard, failed = [], []
    engine.add_death_listener(lambda error: (heard.append(error), failed.append(engine.is_dead)))
    engine.add_death_listener(lambda error: 1 / 0)  # a failing listener is logged; the others still hear it
    engine.add_death_listener(lambda error: heard.append(error))
    fake.fail_at_step = 0
    with pytest.raises(EngineDeadError):
        run(_collect(engine, "hello", SamplingParams(max_tokens=5), "doomed"))
    wait_for(lambda: len(heard) == 2, what="both listeners")
    assert heard[0] is heard[1] is engine.error and isinstance(engine.error, RuntimeError) and failed == [True]
    time.sleep(0.05)
    assert len(heard) == 2


def test_death_listeners_do_not_hear_a_failed_load_or_a_shutdown(fake):
    heard = []
    broken = AsyncLLMEngine(lambda: (_ for _ in ()).throw(OSError("weights missing")), "broken")
    broken.add_death_listener(heard.append)
    broken.start()
    wait_for(lambda: broken.is_dead, what="dead engine")
    with started_engine(fake) as eng:
        eng.add_death_listener(heard.append)
        outs = run(_collect(eng, "hi", SamplingParams(max_tokens=3), "r"))
        assert outs[-1].finished
    assert eng.is_dead and eng.error is None
    broken._thread.join(5)
    assert heard == [] and isinstance(broken.error, OSError)


class _Stuck(FakeEngine):
    """A fake whose first step waits until released, then raises: ``kill`` releases it (as killing an engine
    process ends the engine thread's wait with end-of-file)."""

    def __init__(self) -> None:
        super().__init__(max_model_len=128)
        self.entered, self.released, self.killed = threading.Event(), threading.Event(), False

    def step(self):
        self.entered.set()
        self.released.wait(30)
        raise RuntimeError("the step's device went away")

    def kill(self) -> None:
        self.killed = True
        self.released.set()


def test_a_death_during_shutdown_is_not_heard_and_a_stuck_engine_is_killed():
    stuck, heard = _Stuck(), []
    eng = AsyncLLMEngine(lambda: stuck, "stuck")
    eng.add_death_listener(heard.append)
    eng.start()
    wait_for(lambda: eng.is_ready, what="engine ready")

    async def submit():
        return await eng.add_request("r", "hi", SamplingParams(max_tokens=3))

    run(submit())
    assert stuck.entered.wait(10)
    started = time.monotonic()
    eng.shutdown(timeout=0.2)  # the step does not end by itself: its engine is killed
    assert stuck.killed and not eng._thread.is_alive() and time.monotonic() - started < 5
    assert eng.is_dead and isinstance(eng.error, RuntimeError) and heard == []  # a stop, not a death


def test_load_failure_is_reported_as_dead():
    def factory():
        raise OSError("weights missing")

    eng = AsyncLLMEngine(factory, "broken")
    eng.start()
    wait_for(lambda: eng.is_dead, what="dead engine")
    assert isinstance(eng.error, OSError)


def test_requests_wait_for_loading_then_run():
    gate, fake = threading.Event(), FakeEngine()
    eng = AsyncLLMEngine(lambda: (gate.wait(20), fake)[1], "fake-model")
    eng.start()
    assert eng.state == "loading" and eng.get_stats() is None

    async def main():
        task = asyncio.create_task(_collect(eng, "hi", SamplingParams(max_tokens=3), "early"))
        await asyncio.sleep(0.05)
        assert not task.done()
        gate.set()
        return await task

    outs = run(main())
    assert outs[-1].outputs[0].text == fake_completion(2, SamplingParams(max_tokens=3))[0]
    eng.shutdown()


class Gated(FakeEngine):
    """A step waits for ``gate``, then runs, or with ``dies`` raises (the engine dies)."""

    def __init__(self, dies: bool, **kw) -> None:
        super().__init__(**kw)
        self.gate, self.dies = threading.Event(), dies

    def step(self):
        self.gate.wait(20)
        if self.dies:
            raise RuntimeError("the GPU fell off the bus")
        return super().step()


@pytest.mark.parametrize("dies", [False, True], ids=["serves", "dies"])
def test_requests_sent_during_a_step_count_as_waiting(dies):
    """The waiting count (/metrics, ``appliance top``) has the requests sent while the engine thread is in a step
    (or a wake), queued in front of the engine, and those it took since its last step: it was the last step's
    snapshot, 0 here until the step ended (a wake showed 1 for any number of requests). Once the engine died, its
    requests failed with it: none runs or waits (the last snapshot said r0 waited, the queue two more)."""
    fake = Gated(dies, max_num_seqs=1)
    with started_engine(fake) as eng:
        async def main():
            params = SamplingParams(max_tokens=2)
            tasks = [asyncio.create_task(_collect(eng, "hi", params, "r0"))]
            await asyncio.to_thread(wait_for, lambda: len(fake.waiting) == 1, 5, "r0 in the engine")
            # taken since the last step (which waits for the gate): it waits in the engine
            await asyncio.to_thread(wait_for, lambda: eng.get_stats().num_waiting == 1, 5, "r0 waiting")
            tasks += [asyncio.create_task(_collect(eng, "hi", params, f"r{i}")) for i in (1, 2)]
            await asyncio.to_thread(wait_for, lambda: eng.get_stats().num_waiting == 3, 5, "two more in front")
            assert len(fake.waiting) == 1  # the two are in front of the engine
            fake.gate.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = run(main())
        if dies:
            assert all(isinstance(r, EngineDeadError) for r in results)
            stats = eng.get_stats()
            assert eng.is_dead and (stats.num_running, stats.num_waiting, stats.running) == (0, 0, [])
        else:
            assert all(r[-1].finished for r in results)
            wait_for(lambda: eng.get_stats().num_waiting == 0, what="none waiting")


def test_idle_engine_thread_sleeps_instead_of_spinning(fake, engine):
    """Once out of work the engine thread stops looking: no step and no ``has_unfinished_requests`` for 0.3 s.
    The stats say idle one loop turn before the thread's last look (and a stream's clean-up may wake it once more),
    so the count is taken once it has held still for 0.1 s; a spinning thread never gets there."""
    run(_collect(engine, "hello", SamplingParams(max_tokens=4), "r"))
    wait_for(lambda: engine.get_stats().num_running == 0, what="idle")
    settled = []

    def still() -> bool:
        settled.append(fake.idle_checks)
        time.sleep(0.1)
        return fake.idle_checks == settled[-1]
    wait_for(still, timeout=5, what="the engine thread's last look")
    before = (fake.steps, fake.idle_checks)
    time.sleep(0.3)
    assert (fake.steps, fake.idle_checks) == before


def test_listeners_and_stats_see_every_step(fake, engine):
    seen = []
    engine.add_output_listener(lambda outs: seen.extend(o.request_id for o in outs))
    run(_collect(engine, "hello", SamplingParams(max_tokens=6), "watched"))
    # no waiting: the stats snapshot and the listeners are updated before the client gets each output
    assert engine.get_stats().generation_tokens_total == 6
    assert seen.count("watched") == 6


def test_duplicate_request_id_is_refused(fake, engine):
    fake.step_delay = 0.01

    async def main():
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        stream = await engine.add_request("same", "hello", params)
        with pytest.raises(ValueError, match="request_id"):
            await engine.add_request("same", "hello", params)
        stream.abort()

    run(main())


def test_a_waiting_engine_looks_at_the_cpu_load_every_interval():
    """LLMEngine.idle (the CPU thread count's idle looks) runs every ``idle_look_s`` while nothing is to do and once
    as a request wakes the loop, not between the request's steps; a failing look does not kill the engine."""

    class Idle(FakeEngine):
        idle_look_s = 0.02
        idles = 0

        def idle(self):
            self.idles += 1
            if self.idles == 2:
                raise RuntimeError("a look that fails")

    fake = Idle(step_delay=0.01)
    with started_engine(fake) as eng:
        wait_for(lambda: fake.idles >= 3, what="idle looks")
        before = fake.idles

        async def one():
            return [out async for out in await eng.add_request("r", "hello", SamplingParams(max_tokens=8))]
        outs = run(one())
        assert outs[-1].finished and eng.is_ready
        assert fake.idles - before <= 3  # the request's 8 steps ran without looks between them

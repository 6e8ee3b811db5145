"""AsyncLLMEngine request ids: a live id is refused, and an id reused right after an abort gets only its own outputs.

The race: ``abort("x")`` then ``add_request("x", ...)`` while the old "x" still has outputs on their way (the step
running now, and the "abort" output the engine reports one step later). None of them may reach the new stream or
end it. Checked on the deterministic fake engine (fast) and on the real ``LLMEngine`` over the demo model (CPU).
"""
from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.errors import StepFailed
from engine.sampling_params import SamplingParams
from test_server_fakes import FakeEngine, fake_completion, run, started_engine, wait_for

OLD_PROMPT, NEW_PROMPT = "the old request, long enough to differ", "new"
OLD_PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)  # still running when aborted
NEW_PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def fake():
    return FakeEngine(max_model_len=128, max_num_seqs=2, step_delay=0.01)  # slow steps: outputs are in flight


@pytest.fixture
def engine(fake):
    with started_engine(fake) as eng:
        yield eng


async def _outputs(eng: AsyncLLMEngine, prompt, params, request_id: str) -> list:
    return [out async for out in eng.generate(prompt, params, request_id)]


async def _abort_and_reuse(eng: AsyncLLMEngine, by_id: bool) -> list:
    """Start "x", read two of its outputs, abort it (through the stream or by id) and at once add "x" again with
    another prompt; returns the new stream's outputs. The old stream's late ``abort()`` (as ``generate`` does on
    exit) comes after the new "x" was added."""
    old = await eng.add_request("x", OLD_PROMPT, OLD_PARAMS)
    assert not (await old.__anext__()).finished and not (await old.__anext__()).finished
    if by_id:
        eng.abort("x")
    else:
        old.abort()
    new = await eng.add_request("x", NEW_PROMPT, NEW_PARAMS)
    old.abort()  # a no-op: must not touch the new "x"
    return [out async for out in new]


def _assert_only_its_own(outs: list, alone: list) -> None:
    """``outs`` (the reused id's) end exactly as the same prompt run alone, and hold nothing of the old request."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [o.request_id for o in outs] == ["x"] * len(outs)
    assert all(o.prompt_token_ids == alone[-1].prompt_token_ids for o in outs)  # the old prompt differs
    final, expected = outs[-1].outputs[0], alone[-1].outputs[0]
    assert (final.token_ids, final.text, final.finish_reason) == (expected.token_ids, expected.text,
                                                                   expected.finish_reason)
    assert all(final.token_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids for o in outs)


def test_a_live_id_is_refused_and_the_first_request_completes(fake, engine):
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        first = await engine.add_request("same", "hello", params)
        with pytest.raises(ValueError, match=r"request_id: 'same' is already running"):
            await engine.add_request("same", "another prompt", params)
        assert engine.num_requests == 1 and len(fake.waiting) + len(fake.running) <= 1  # nothing kept of it
        return [out async for out in first]

    outs = run(main())
    assert [o.request_id for o in outs] == ["same"] * len(outs) and outs[-1].finished
    assert (outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason) == fake_completion(5, params)
    assert all(o.prompt_token_ids == [ord(c) for c in "hello"] for o in outs)
    wait_for(lambda: engine.get_stats().num_running == 0, what="engine idle")
    assert engine.is_ready and engine.num_requests == 0 and not fake.aborted
    assert not fake.running and not fake.waiting and not fake.pending_aborts


def test_a_live_id_is_refused_before_the_engine_accepted_it(fake, engine):
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        return await asyncio.gather(_outputs(engine, "hello", params, "same"),
                                    _outputs(engine, "hello", params, "same"), return_exceptions=True)

    first, second = run(main())
    assert isinstance(second, ValueError) and "'same'" in str(second)
    assert first[-1].outputs[0].text == fake_completion(5, params)[0]


@pytest.mark.parametrize("by_id", [False, True], ids=["stream-abort", "engine-abort"])
def test_a_reused_id_gets_only_its_own_outputs(fake, engine, by_id):
    alone = run(_outputs(engine, NEW_PROMPT, NEW_PARAMS, "alone"))
    for _ in range(5):
        fake.aborted.clear()
        _assert_only_its_own(run(_abort_and_reuse(engine, by_id)), alone)
        assert fake.aborted == ["x"]  # the old "x" only
        wait_for(lambda: engine.get_stats().num_running == 0 and not fake.pending_aborts, what="engine idle")
        assert engine.num_requests == 0 and not fake.running and not fake.waiting


def test_a_reused_id_gets_only_its_own_outputs_on_the_real_engine(demo_model):
    config = EngineConfig(model=str(demo_model), device="cpu", max_model_len=128, max_num_seqs=4,
                          cpu_kv_cache_gib=0.25)
    eng = AsyncLLMEngine.from_config(config)
    eng.start()
    try:
        wait_for(lambda: eng.is_ready or eng.is_dead, timeout=300, what="model load")
        assert eng.is_ready, eng.error
        alone = run(_outputs(eng, NEW_PROMPT, NEW_PARAMS, "alone"), 60)
        assert len(alone[-1].outputs[0].token_ids) > 1
        for by_id in (False, True):
            _assert_only_its_own(run(_abort_and_reuse(eng, by_id), 60), alone)
        wait_for(lambda: eng.get_stats().num_running == 0 and eng.get_stats().num_waiting == 0, what="idle")
        assert eng.num_requests == 0 and not eng.engine.requests and eng.get_stats().kv_cache_usage == 0
    finally:
        eng.shutdown()


class _FailsHoldingAnOutput(FakeEngine):
    """Fails a step the way ``LLMEngine`` does when a launch raises: request "x" leaves the engine and its last
    output is held, delivered by the next step. The failing step first waits for ``ready()`` (the test's abort and
    re-add of "x" are queued), so the re-add is drained before the held output comes out."""

    ready = None
    in_failing_step = False  # True while the failing step waits for ``ready()``

    def step(self):
        if self.ready is not None and any(r.request_id == "x" for r in self.running):
            self.in_failing_step = True
            wait_for(self.ready, what="the abort and the re-add queued")
            self.ready = None
            old = next(r for r in self.running if r.request_id == "x")
            self.running.remove(old)
            old.done = ["abort"] * len(old.done)
            self.pending_aborts.append(old)  # the held output: out with the next step
            raise StepFailed(["x"], RuntimeError("device error"))
        return super().step()


def test_a_reused_id_waits_for_the_output_a_failed_step_held():
    fake = _FailsHoldingAnOutput(max_model_len=128, max_num_seqs=2, step_delay=0.01)
    with started_engine(fake) as eng:
        alone = run(_outputs(eng, NEW_PROMPT, NEW_PARAMS, "alone"))

        async def main():
            old = await eng.add_request("x", OLD_PROMPT, OLD_PARAMS)
            assert not (await old.__anext__()).finished
            fake.ready = lambda: eng._commands.qsize() >= 2
            while not fake.in_failing_step:  # the engine thread is in the step that will fail
                await asyncio.sleep(0.001)
            old.abort()
            new = await eng.add_request("x", NEW_PROMPT, NEW_PARAMS)  # accepted once the held output is out
            return [out async for out in new]

        _assert_only_its_own(run(main()), alone)
        wait_for(lambda: eng.get_stats().num_running == 0 and not fake.pending_aborts, what="engine idle")
        assert eng.num_requests == 0 and not eng._routes and not eng._parked


def test_abort_by_id_ends_the_stream_of_whoever_reads_it():
    """``abort(request_id)`` from outside ends a stream being read (no hang), and a request not yet accepted
    either raises CancelledError from ``add_request`` or yields nothing."""
    fake = FakeEngine(max_model_len=128, max_num_seqs=2, step_delay=0.05)
    with started_engine(fake) as eng:
        async def main():
            stream = await eng.add_request("y", OLD_PROMPT, OLD_PARAMS)
            first = await stream.__anext__()
            eng.abort("y")
            rest = [out async for out in stream]
            task = asyncio.create_task(eng.add_request("z", NEW_PROMPT, NEW_PARAMS))
            await asyncio.sleep(0)  # registered and sent: the engine thread is in its 50 ms step
            eng.abort("z")
            try:
                late = [out async for out in await task]
            except asyncio.CancelledError:
                late = None
            return first, rest, late

        first, rest, late = run(main())
        assert not first.finished and not any(out.finished for out in rest) and len(rest) <= 1
        assert late in (None, [])
        wait_for(lambda: eng.get_stats().num_running == 0 and not fake.pending_aborts, what="engine idle")
        assert eng.num_requests == 0 and "y" in fake.aborted

"""A forward pass that raises fails only the requests in it: their blocks come back and leave the prefix cache
(their K/V may be half written), other requests and later ones are served as before; only failures in a row
make the engine dead."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import MAX_FAILED_STEPS, AsyncLLMEngine, EngineDeadError
from engine.errors import StepFailed
from test_server_fakes import FakeEngine, fake_completion, wait_for

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_failed_step_drops_its_requests_and_poisons_no_cache(demo_model, monkeypatch):
    llm = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=256)
    engine = llm.engine
    prompt = list(range(100, 140))  # 40 tokens: two full blocks that prefix caching would register
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert engine.block_manager.num_cached_blocks == 2

    other = list(range(300, 340))  # same length, not cached: its prefill step is the one that fails
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request("victim", other, GREEDY)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["victim"] and isinstance(failed.value.__cause__, RuntimeError)
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 2  # free counts the evictable cached
    monkeypatch.setattr(engine.runner, "run", run)

    # the failed prompt's blocks are not found by a lookup: served again, it computes them and gets the tokens a
    # fresh engine gets; the cached prompt is still served from its blocks
    fresh = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
    outs = llm.generate([other, prompt], GREEDY)
    assert outs[0].outputs[0].token_ids == fresh.generate([other], GREEDY)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == want


class FlakyEngine(FakeEngine):
    """Fails the steps numbered in ``fail_steps`` (0-based) the way LLMEngine does: drops ``victim`` and raises."""

    def __init__(self, fail_steps: set[int], **kw):
        super().__init__(**kw)
        self.fail_steps, self.step_no = fail_steps, 0

    def step(self):
        self.step_no += 1
        if self.step_no - 1 in self.fail_steps:
            victims = [r.request_id for r in [*self.running, *self.waiting] if r.request_id.startswith("victim")]
            for request_id in victims:
                self.abort_request(request_id)
            self.pending_aborts.clear()
            raise StepFailed(victims, RuntimeError("boom"))
        return super().step()


def _serve(fake):
    eng = AsyncLLMEngine(lambda: fake, "fake-model")
    eng.start()
    wait_for(lambda: eng.is_ready, what="engine ready")
    return eng


async def _text(eng, prompt, request_id, params):
    outs = [o async for o in eng.generate(prompt, params, request_id)]
    return outs[-1].outputs[0].text, outs[-1].outputs[0].finish_reason


def test_async_engine_fails_the_step_requests_and_serves_the_rest():
    eng = _serve(FlakyEngine({2}, max_model_len=128, max_num_seqs=4, step_delay=0.01))
    params = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        return await asyncio.gather(_text(eng, "aaa", "victim", params), _text(eng, "bb", "ok", params),
                                    return_exceptions=True)

    try:
        victim, ok = asyncio.run(asyncio.wait_for(main(), 20))
        assert isinstance(victim, StepFailed) and victim.request_ids == ["victim"]
        assert ok == fake_completion(2, params)
        assert eng.is_ready and not eng.is_dead
        assert asyncio.run(asyncio.wait_for(_text(eng, "cccc", "later", params), 20)) == fake_completion(4, params)
    finally:
        eng.shutdown()


def test_failures_in_a_row_make_the_engine_dead():
    eng = _serve(FlakyEngine(set(range(100)), max_model_len=128, max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=8)
    try:
        for i in range(MAX_FAILED_STEPS - 1):
            with pytest.raises(StepFailed):
                asyncio.run(asyncio.wait_for(_text(eng, "aaa", f"victim{i}", params), 20))
            assert not eng.is_dead
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(_text(eng, "aaa", "victim-last", params), 20))
        wait_for(lambda: eng.is_dead, what="engine dead")
    finally:
        eng.shutdown()

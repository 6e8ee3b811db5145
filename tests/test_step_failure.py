"""A forward pass that raises fails only the requests in it: their blocks come back and leave the prefix cache
(their K/V may be half written), other requests and later ones are served as before; only failures in a row
make the engine dead."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import MAX_FAILED_STEPS, AsyncLLMEngine, EngineDeadError
from engine.errors import StepFailed
from engine.model_runner import LaunchedStep
from test_server_fakes import FakeEngine, fake_completion, wait_for

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_failed_step_drops_its_requests_and_poisons_no_cache(demo_model, monkeypatch):
    llm = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=256)
    engine = llm.engine
    prompt = list(range(100, 140))  # 40 tokens: two full blocks that prefix caching would register
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert engine.block_manager.num_cached_blocks == 2

    other = list(range(300, 340))  # same length, not cached: its prefill step is the one that fails
    launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request("victim", other, GREEDY)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["victim"] and isinstance(failed.value.__cause__, RuntimeError)
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 2  # free counts the evictable cached
    monkeypatch.setattr(engine.runner, "launch", launch)

    # the failed prompt's blocks are not found by a lookup: served again, it computes them and gets the tokens a
    # fresh engine gets; the cached prompt is still served from its blocks
    fresh = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=256, enable_prefix_caching=False)
    outs = llm.generate([other, prompt], GREEDY)
    assert outs[0].outputs[0].token_ids == fresh.generate([other], GREEDY)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == want


def test_failed_swap_copy_fails_its_victims_too(demo_model):
    """The swap-out copy raises (a GPU out of memory, say): the requests swapped out in that step are failed with
    the batch (their swap blocks were never written); every request that finishes has its no-pressure tokens."""
    from engine_fixtures import prompts

    small = dict(device="cpu", max_num_seqs=16, max_model_len=64, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    roomy = LLM(str(demo_model), **small)
    texts = prompts(roomy.get_tokenizer())
    want = {f"p{i}": o.outputs[0].token_ids for i, o in enumerate(roomy.generate(texts, params))}
    llm = LLM(str(demo_model), num_kv_blocks=10, swap_space=0.05, **small)
    engine, swap, state = llm.engine, llm.engine.runner.swap, {"failed": False}

    def flaky(out, into):
        if out and not state["failed"]:
            state["failed"] = True
            raise RuntimeError("out of memory during swap-out")
        return swap(out, into)

    engine.runner.swap = flaky
    for i, text in enumerate(texts):
        engine.add_request(f"p{i}", text, params)
    done, failed = {}, []
    while engine.has_unfinished_requests():
        try:
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        except StepFailed as e:
            failed += e.request_ids
    assert state["failed"] and failed and set(done) | set(failed) == set(want) and not set(done) & set(failed)
    assert all(done[r] == want[r] for r in done)
    engine.block_manager.check()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.swap_pool.num_free_blocks == engine.scheduler.swap_pool.num_blocks


def test_a_request_that_cannot_sample_fails_alone(demo_model):
    """repetition_penalty 1e-40 overflows the logits to inf: that request gets a ValueError (a 400 over HTTP), the
    request beside it in the same step gets its output and finishes as it would alone."""
    llm = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=128)
    engine = llm.engine
    prompt = list(range(100, 120))
    alone = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    engine.add_request("bad", list(range(200, 220)), SamplingParams(temperature=0.8, repetition_penalty=1e-40))
    engine.add_request("good", prompt, GREEDY)
    with pytest.raises(StepFailed) as failed:
        engine.step()
    e = failed.value
    assert e.request_ids == ["bad"] and e.request_error and isinstance(e.cause, ValueError)
    assert [o.request_id for o in e.outputs] == ["good"] and "bad" not in engine.requests
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and outs[-1].outputs[0].token_ids == alone


@pytest.mark.parametrize("deferred", [False, True])
def test_a_late_read_back_failure_names_only_unfinished_requests(demo_model, deferred):
    """Async scheduling: step 2 finishes "short" (its second token is a stop token: the scheduler cannot know that
    ahead, so its row is in step 3's batch too), then step 3's read-back raises (a device error that surfaced late).
    StepFailed names only "long"; "short" keeps its finished output. Not deferred (async scheduling turned off
    for step 3), step 3 is read back in the call that reads step 2: the outputs of step 2 are held for the next
    call. Deferred, they come with the call
    that launches step 3, and step 3 is read back (and raises) in the next one, by which time a new request took
    the id "short": it is not failed, and gets the tokens it gets alone."""
    class Failing(LaunchedStep):
        def read(self):
            raise RuntimeError("device error at read-back")

    llm = LLM(str(demo_model), device="cpu", max_num_seqs=8, max_model_len=128, async_scheduling=True)
    engine, launch, launches = llm.engine, llm.engine.runner.launch, []
    prompt = list(range(1000, 1010))
    alone = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    first_two = alone.outputs[0].token_ids
    assert first_two[0] != first_two[1]
    again = llm.generate([list(range(500, 510))], GREEDY)[0].outputs[0].token_ids

    def flaky(*args):
        launches.append(launch(*args))
        if len(launches) == 3:
            return Failing(launches[-1].host, launches[-1].event)
        return launches[-1]

    engine.runner.launch = flaky
    engine.add_request("short", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                       stop_token_ids=[first_two[1]]))
    engine.add_request("long", list(range(200, 210)), GREEDY)
    assert engine.step() == [] and len(engine.step()) == 2  # the prefill, then step 2 (reads the prefill back)
    if deferred:
        step2 = engine.step()  # launches step 3, reads step 2 back
        engine.add_request("short", list(range(500, 510)), GREEDY)  # the id is free: a new request takes it
    else:
        engine.async_scheduling = False  # step 3 is read back in the call that launches it
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["long"] and isinstance(failed.value.cause, RuntimeError)
    if not deferred:
        step2 = engine.step()  # delivers the held outputs
    assert [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in step2] == [("short", True, 2),
                                                                                        ("long", False, 2)]
    assert step2[0].outputs[0].token_ids == first_two
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    done = [(o.request_id, o.outputs[0].token_ids) for o in outs if o.finished]
    assert done == ([("short", again)] if deferred else [])
    engine.block_manager.check()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class FlakyEngine(FakeEngine):
    """Fails the steps numbered in ``fail_steps`` (0-based) the way LLMEngine does: drops ``victim`` and raises."""

    def __init__(self, fail_steps: set[int], request_error: bool = False, **kw):
        super().__init__(**kw)
        self.fail_steps, self.step_no, self.request_error = fail_steps, 0, request_error

    def step(self):
        self.step_no += 1
        if self.step_no - 1 in self.fail_steps:
            victims = [r.request_id for r in [*self.running, *self.waiting] if r.request_id.startswith("victim")]
            for request_id in victims:
                self.abort_request(request_id)
            self.pending_aborts.clear()
            cause = ValueError("sampling: no token") if self.request_error else RuntimeError("boom")
            raise StepFailed(victims, cause, request_error=self.request_error)
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
    """... and tells its failure listeners (the server's metrics forget those requests)."""
    eng = _serve(FlakyEngine({2}, max_model_len=128, max_num_seqs=4, step_delay=0.01))
    told: list[list[str]] = []
    eng.add_failure_listener(told.append)
    params = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        return await asyncio.gather(_text(eng, "aaa", "victim", params), _text(eng, "bb", "ok", params),
                                    return_exceptions=True)

    try:
        victim, ok = asyncio.run(asyncio.wait_for(main(), 20))
        assert isinstance(victim, StepFailed) and victim.request_ids == ["victim"] and told == [["victim"]]
        assert ok == fake_completion(2, params)
        assert eng.is_ready and not eng.is_dead
        assert asyncio.run(asyncio.wait_for(_text(eng, "cccc", "later", params), 20)) == fake_completion(4, params)
    finally:
        eng.shutdown()


def test_failures_in_a_row_make_the_engine_dead():
    """... and tell its death listeners, once (the server exits on it: api_server.run_server)."""
    eng = _serve(FlakyEngine(set(range(100)), max_model_len=128, max_num_seqs=4))
    heard = []
    eng.add_death_listener(heard.append)
    params = SamplingParams(temperature=0, max_tokens=8)
    try:
        for i in range(MAX_FAILED_STEPS - 1):
            with pytest.raises(StepFailed):
                asyncio.run(asyncio.wait_for(_text(eng, "aaa", f"victim{i}", params), 20))
            assert not eng.is_dead and heard == []
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(_text(eng, "aaa", "victim-last", params), 20))
        wait_for(lambda: eng.is_dead and heard, what="engine dead, its listener told")
        assert heard == [eng.error] and isinstance(eng.error, StepFailed)
    finally:
        eng.shutdown()


def test_requests_own_sampling_failures_never_make_the_engine_dead():
    eng = _serve(FlakyEngine(set(range(100)), request_error=True, max_model_len=128, max_num_seqs=4))
    params = SamplingParams(temperature=0, max_tokens=8)
    try:
        for i in range(MAX_FAILED_STEPS + 2):
            with pytest.raises(ValueError, match="sampling"):
                asyncio.run(asyncio.wait_for(_text(eng, "aaa", f"victim{i}", params), 20))
        assert not eng.is_dead and eng.is_ready
    finally:
        eng.shutdown()

"""``appliance bench``'s load generator against a live server over the fake engine (exact counts, no timing)."""
from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from appliance.loadgen import percentile, run_level, served_model
from engine.async_engine import AsyncLLMEngine
from engine.server.api_server import build_app
from test_server_fakes import FakeEngine, ServerThread, wait_for


def test_percentile_interpolates():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 50) == 5.5
    assert percentile([1, 2, 3], 99) == pytest.approx(2.98)
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3  # the ends, unsorted input
    assert percentile(list(range(1001)), 99.9) == pytest.approx(999.0)  # numpy.percentile's value


@pytest.mark.parametrize("concurrency, processes", [(1, 1), (3, 1), (3, 2)])
def test_level_counts_every_request_and_token(concurrency, processes):
    """processes=2: clients 2 + 1 and requests 3 + 2 in two child processes, their timings summarized together."""
    fake = FakeEngine(max_num_seqs=4)
    engine = AsyncLLMEngine(lambda: fake, "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        assert served_model(url) == "fake-model"
        result = asyncio.run(run_level(url, "fake-model", concurrency, requests=5, prompt_len=4, max_tokens=6,
                                       processes=processes))
    engine.shutdown()
    assert (result.concurrency, result.requests, result.errors, result.output_tokens) == (concurrency, 5, 0, 30)
    assert result.input_tokens == 5 * len(fake.tokenizer.encode("hello " * 4))
    assert result.output_tok_per_s == result.output_tokens / result.duration > 0
    assert 0 < result.ttft.median <= result.ttft.p99 and result.e2el.median >= result.ttft.median
    assert result.tpot.median > 0 and result.itl.median > 0


def test_summary_is_mean_median_population_std_and_p99():
    from appliance.loadgen import Summary

    assert Summary.of([]) == Summary(0.0, 0.0, 0.0, 0.0)
    s = Summary.of([1.0, 2.0, 3.0, 6.0])
    assert (s.mean, s.median, s.p99) == pytest.approx((3.0, 2.5, 5.91))
    assert s.std == pytest.approx(1.8708287)  # numpy.std's population form, as vLLM computes it


def test_tpot_is_the_time_per_token_after_the_first():
    from appliance.loadgen import RequestTiming

    assert RequestTiming(ttft=0.1, e2e=0.5, output_tokens=5).tpot == pytest.approx(0.1)
    assert RequestTiming(ttft=0.1, e2e=0.1, output_tokens=1).tpot is None
    assert RequestTiming(ttft=0.1, e2e=0.1, output_tokens=0).tpot is None


def test_json_keys_are_vllm_benchmark_serving_ones_in_ms():
    from appliance.loadgen import LevelResult, Summary

    r = LevelResult(concurrency=4, requests=8, errors=1, input_tokens=40, output_tokens=80, duration=2.0,
                    ttft=Summary(0.012, 0.010, 0.004, 0.030), tpot=Summary(0.003, 0.002, 0.001, 0.006),
                    itl=Summary(0.0025, 0.002, 0.001, 0.005), e2el=Summary(0.55, 0.5, 0.1, 0.9))
    assert r.to_json() == pytest.approx({
        "max_concurrency": 4, "completed": 8, "failed": 1, "total_input_tokens": 40, "total_output_tokens": 80,
        "duration": 2.0, "request_throughput": 4.0, "output_throughput": 40.0, "total_token_throughput": 60.0,
        "mean_ttft_ms": 12.0, "median_ttft_ms": 10.0, "std_ttft_ms": 4.0, "p99_ttft_ms": 30.0,
        "mean_tpot_ms": 3.0, "median_tpot_ms": 2.0, "std_tpot_ms": 1.0, "p99_tpot_ms": 6.0,
        "mean_itl_ms": 2.5, "median_itl_ms": 2.0, "std_itl_ms": 1.0, "p99_itl_ms": 5.0,
        "mean_e2el_ms": 550.0, "median_e2el_ms": 500.0, "std_e2el_ms": 100.0, "p99_e2el_ms": 900.0})


@pytest.mark.parametrize("processes", [1, 2])
def test_level_counts_errors_for_an_unknown_model(processes):
    engine = AsyncLLMEngine(lambda: FakeEngine(), "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        result = asyncio.run(run_level(url, "no-such-model", 2, requests=3, prompt_len=4, max_tokens=2,
                                       processes=processes))
    engine.shutdown()
    assert (result.requests, result.errors) == (0, 3)
    assert result.first_error.startswith("HTTP 404: ") and "no-such-model" in result.first_error  # the server's


def test_bench_shows_why_requests_failed_and_fails_where_none_succeeded(monkeypatch):
    """A whole level failing (max_tokens over the context, say) was an all-zero row and exit 0, the server's 400
    never shown; --requests -1 was taken."""
    from typer.testing import CliRunner

    from appliance.cli import app
    engine = AsyncLLMEngine(lambda: FakeEngine(max_model_len=64), "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        result = CliRunner().invoke(app, ["bench", "--url", url, "--concurrency", "1", "--max-tokens", "100",
                                          "--prompt-len", "4"])
        ok = CliRunner().invoke(app, ["bench", "--url", url, "--concurrency", "1", "--max-tokens", "2",
                                      "--prompt-len", "4", "--requests", "2"])
        negative = CliRunner().invoke(app, ["bench", "--url", url, "--requests", "-1"])
    engine.shutdown()
    flat = " ".join(result.output.split())
    assert result.exit_code == 1 and "4 of 4 requests failed; the first: HTTP 400:" in flat, result.output
    assert "error: every request at concurrency 1 failed: HTTP 400:" in flat and "reduce the length" in flat
    assert ok.exit_code == 0 and "failed" not in ok.output, ok.output
    assert negative.exit_code == 1 and "--requests, --processes and --num-warmups must be 0 or more" in " ".join(
        negative.output.split())


def test_clients_and_requests_split_evenly_over_processes():
    from appliance.loadgen import _shares, auto_processes

    assert _shares(5, 2) == [3, 2] and _shares(256, 8) == [32] * 8 and _shares(3, 3) == [1, 1, 1]
    assert auto_processes(1) == 1 and auto_processes(64) == 1
    assert auto_processes(256) == min(4, max(1, (os.cpu_count() or 2) // 2))


def test_cli_bench_prints_a_row_per_level_and_rejects_bad_input():
    from typer.testing import CliRunner

    from appliance.cli import app

    engine = AsyncLLMEngine(lambda: FakeEngine(max_num_seqs=4), "fake-model")
    runner = CliRunner()
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        ok = runner.invoke(app, ["bench", "--url", url, "--concurrency", "1,2", "--prompt-len", "4",
                                 "--max-tokens", "3", "--requests", "2", "--json"])
        bad = runner.invoke(app, ["bench", "--url", url, "--concurrency", "one"])
    engine.shutdown()
    assert ok.exit_code == 0, ok.output
    import json
    rows = json.loads(ok.output)
    assert [(r["max_concurrency"], r["completed"], r["failed"], r["total_output_tokens"]) for r in rows] == [
        (1, 2, 0, 6), (2, 2, 0, 6)]
    assert set(rows[0]) == {"max_concurrency", "completed", "failed", "total_input_tokens", "total_output_tokens",
                            "duration", "request_throughput", "output_throughput", "total_token_throughput",
                            *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                              for stat in ("mean", "median", "std", "p99"))}
    assert bad.exit_code == 1 and "not a list of numbers" in bad.output
    down = runner.invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--concurrency", "1"])
    assert down.exit_code == 1 and "no server answers" in down.output


def test_cli_bench_warm_up_rounds_run_before_each_level_untimed():
    """--num-warmups 2 at levels 1 and 3: 2 and 6 short requests (at most WARMUP_TOKENS tokens) before each level's
    timed ones, which alone are counted."""
    from typer.testing import CliRunner

    from appliance.cli import app
    from appliance.loadgen import WARMUP_TOKENS

    fake = FakeEngine(max_num_seqs=4)
    engine = AsyncLLMEngine(lambda: fake, "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        result = CliRunner().invoke(app, ["bench", "--url", url, "--concurrency", "1,3", "--prompt-len", "4",
                                          "--max-tokens", "20", "--requests", "2", "--num-warmups", "2", "--json"])
        negative = CliRunner().invoke(app, ["bench", "--url", url, "--num-warmups", "-1"])
    engine.shutdown()
    import json
    rows = json.loads(result.output)
    assert [(r["completed"], r["total_output_tokens"]) for r in rows] == [(2, 40), (2, 40)]
    assert [p.max_tokens for p in fake.params] == [WARMUP_TOKENS] * 2 + [20] * 2 + [WARMUP_TOKENS] * 6 + [20] * 2
    assert negative.exit_code == 1 and "--num-warmups must be 0 or more" in " ".join(negative.output.split())


def test_cli_bench_waits_for_a_loading_model():
    """A server still loading its model (/health 503) is waited for, as `appliance chat` and vLLM's bench do (it was
    a one-line error: `appliance start && appliance bench` failed); then the level runs."""
    import json
    import threading

    from typer.testing import CliRunner

    from appliance.cli import app

    gate = threading.Event()
    engine = AsyncLLMEngine(lambda: (gate.wait(30), FakeEngine())[1], "fake-model")
    try:
        with ServerThread(build_app(engine)) as url:
            assert httpx.get(f"{url}/health").status_code == 503
            threading.Timer(1.0, gate.set).start()
            result = CliRunner().invoke(app, ["bench", "--url", url, "--concurrency", "1", "--prompt-len", "4",
                                              "--max-tokens", "3", "--requests", "1", "--json"])
    finally:
        gate.set()
        engine.shutdown()
    assert result.exit_code == 0, result.output
    assert [(r["completed"], r["failed"]) for r in json.loads(result.stdout)] == [(1, 0)]  # stdout: the JSON alone
    assert result.stderr == f"waiting for the server at {url} to load the model (at most 600 s) ...\n"


def _sse_app(lines: list[str], models: dict | None = None):
    """A stand-in server: /v1/completions streams ``lines`` as SSE ``data:`` lines, /health 200, /v1/models."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        async def body():
            for line in lines:
                yield f"data: {line}\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/health", lambda r: JSONResponse({})),
                             Route("/v1/models", lambda r: JSONResponse(models or {"data": [{"id": "m"}]}))])


@pytest.mark.parametrize("lines", [
    ['{"error": {"message": "engine died", "code": 500}}', "[DONE]"],  # the server's error event
    ['{"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}', "[DONE]"],  # no text at all
    ["{not json", "[DONE]"]])
def test_a_stream_with_an_error_event_no_text_or_garbage_is_a_failed_request(lines):
    with ServerThread(_sse_app(lines)) as url:
        result = asyncio.run(run_level(url, "m", 2, requests=3, prompt_len=4, max_tokens=2))
    assert (result.requests, result.errors) == (0, 3)


def test_a_stream_with_null_usage_counts_zero_tokens():
    lines = ['{"choices": [{"text": "hi"}]}', '{"choices": [], "usage": {"prompt_tokens": null, '
             '"completion_tokens": null}}', "[DONE]"]
    with ServerThread(_sse_app(lines)) as url:
        result = asyncio.run(run_level(url, "m", 1, requests=2, prompt_len=4, max_tokens=2))
    assert (result.requests, result.errors, result.input_tokens, result.output_tokens) == (2, 0, 0, 0)


@pytest.mark.parametrize("models", [{"data": []}, {"object": "list"}])
def test_cli_bench_on_a_server_listing_no_model_says_so(models):
    from typer.testing import CliRunner

    from appliance.cli import app

    with ServerThread(_sse_app([], models)) as url:
        result = CliRunner().invoke(app, ["bench", "--url", url, "--concurrency", "1"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1 and "/v1/models did not list a model" in out and "Traceback" not in out, out

"""``appliance top``: the numbers it computes from /metrics and /v1/kv, the Textual app against a live server (the
fake engine of the server tests), and the CLI's errors."""
import asyncio
import socket
import time

import httpx
import pytest
from rich.console import Console
from appliance_testenv import isolate
from test_appliance_cli import one_line_error, runner
from test_server_fakes import FakeEngine, ServerThread, wait_for

from appliance.cli import app as cli
from engine.async_engine import AsyncLLMEngine
from engine.server.api_server import build_app
from tui.app import TopApp, _ms
from tui.metrics import Histogram, Scrape, block_map, parse_metrics, view


def test_histogram_quantiles_interpolate_as_prometheus():
    h = Histogram([(0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)], count=8.0, total=1.0)
    assert h.quantile(0.5) == pytest.approx(0.15)  # rank 4: half way through (0.1, 0.2]
    assert h.quantile(0.25) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert h.quantile(0.1) == pytest.approx(0.04)  # rank 0.8 of 2 in (0, 0.1]
    assert h.quantile(0.95) == 0.2  # in the +inf bucket: the largest finite bound
    assert Histogram().quantile(0.5) is None
    older = Histogram([(0.1, 2.0), (0.2, 2.0), (float("inf"), 2.0)], count=2.0, total=0.1)
    since = h.minus(older)  # the 6 observations since: 4 in (0.1, 0.2], 2 above
    assert since.buckets == [(0.1, 0.0), (0.2, 4.0), (float("inf"), 6.0)] and since.count == 6.0
    assert since.quantile(0.5) == pytest.approx(0.175)


def test_block_map_folds_blocks_into_cells():
    assert block_map("##..#c..####", 4) == "▓▒▒█"  # 3 blocks a cell: 2/3, 1/3, 1/3 and 3/3 used
    assert block_map("..c.c.", 3) == "·cc"  # a cell with a cached block and none used
    assert block_map("#" * 7 + "." * 3, 3) == "█▇·"  # 4, 4 (3 used: not full) and 2 blocks a cell
    assert block_map("#.", 10) == "█·" and block_map("", 10) == ""


@pytest.fixture
def server():
    fake = FakeEngine()
    engine = AsyncLLMEngine(lambda: fake, "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        yield url
    engine.shutdown()


def complete(url: str, n: int) -> None:
    for _ in range(n):
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake-model", "prompt": "hello there",
                                                      "max_tokens": 5}, timeout=20)
        assert r.status_code == 200


def scrape(url: str) -> Scrape:
    return parse_metrics(httpx.get(f"{url}/metrics").text, time.monotonic())


def finished(url: str, n: int) -> None:
    """Wait until the server's metrics count ``n`` finished requests (a request's last output reaches its client
    just before the metrics see it)."""
    wait_for(lambda: sum(scrape(url).finished.values()) == n, what=f"{n} finished requests in /metrics")


def test_view_of_two_scrapes_counts_what_happened_between(server):
    before = scrape(server)
    complete(server, 3)
    finished(server, 3)
    after = scrape(server)
    assert (after.model, after.generation_tokens - before.generation_tokens, after.finished) == \
        ("fake-model", 15.0, {"stop": 0.0, "length": 3.0, "abort": 0.0})
    v = view(before, after)
    assert v.generation_tok_s * v.seconds == pytest.approx(15.0)
    assert v.requests_per_s * v.seconds == pytest.approx(3.0) and v.finished == 3.0
    assert after.latencies["time_to_first_token"].count == 3.0 and v.percentiles["time_to_first_token"][0] > 0
    assert v.percentiles["inter_token_latency"][1] is not None  # 4 gaps per request
    assert view(after, after).percentiles["e2e_request_latency"] == (None, None)  # nothing new in no time
    assert view(None, after).generation_tok_s == 0.0  # one reading: totals, no rates
    assert not after.restarted_since(before) and before.restarted_since(after)  # counters only go up


def test_parse_metrics_reads_the_cache_config_and_skips_what_it_does_not_know():
    text = """# HELP vllm:cache_config_info Information of the KV cache.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="int8",model_name="m",num_gpu_blocks="100"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} NaN
# TYPE something_else counter
something_else_total 5.0
"""
    s = parse_metrics(text, 1.0)
    assert (s.model, s.running, s.waiting) == ("m", 3, 0)
    assert s.cache == {"block_size": "16", "cache_dtype": "int8", "num_gpu_blocks": "100"}
    with pytest.raises(ValueError):
        parse_metrics("<html>not metrics</html>", 1.0)


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def text(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_dashboard_reads_the_server(server):
    async def scenario():
        app = TopApp(server, interval=60)  # polled by hand below
        async with app.run_test(size=(160, 50)) as pilot:
            await until(lambda: app.kv is not None)  # the first reading comes right after the start
            assert app.kv["num_blocks"] == 512 and len(app.scrapes) == 1
            complete(server, 2)
            finished(server, 2)
            await app.poll()
            summary = text(app.query_one("#summary").content)
            assert "fake-model" in summary and "of 512 blocks of 4 tokens" in summary
            assert "2 finished" in summary and "asleep" not in summary
            ttft50 = app.shown.percentiles["time_to_first_token"][0]
            assert ttft50 is not None and _ms(ttft50) in text(app.query_one("#latency").content).split("p50")[1]
            assert text(app.query_one("#blocks").content).startswith("KV blocks, 2/cell: █ used")
            app._say("[/models/x] a message with brackets")  # the server's words, not markup
            assert str(app.query_one("#status").content) == "[/models/x] a message with brackets"
            await pilot.press("p")
            assert app.paused
            await app.poll()  # paused: no new reading
            assert len(app.scrapes) == 2
            await pilot.press("p")  # resumed: the window starts again
            assert not app.scrapes
            await pilot.press("ctrl+c")  # quits, as top and htop do (Textual's own binding only told of ctrl+q)
            await pilot.pause()
            assert app.return_code == 0 and not app.is_running
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_dashboard_says_when_the_engine_sleeps():
    """``sleep_after_idle_s``: /v1/kv says so, and the dashboard's model line (the counts are an empty cache's)."""
    fake = FakeEngine()
    fake.asleep = True  # as EngineProcess.asleep after sleep()
    engine = AsyncLLMEngine(lambda: fake, "fake-model")
    with ServerThread(build_app(engine)) as url:
        wait_for(lambda: engine.is_ready, what="engine ready")
        assert httpx.get(f"{url}/v1/kv").json()["asleep"] is True

        async def scenario():
            app = TopApp(url, interval=60)
            async with app.run_test(size=(160, 50)):
                await until(lambda: app.kv is not None)
                assert "asleep: unloaded, the next request loads it again" in text(app.query_one("#summary").content)
                fake.waking = True  # a request loads it again (EngineProcess.waking)
                assert httpx.get(f"{url}/v1/kv").json()["waking"] is True
                await app.poll()
                assert "waking: a request loads the model again" in text(app.query_one("#summary").content)
        asyncio.run(asyncio.wait_for(scenario(), 30))
    engine.shutdown()


def test_dashboard_window_starts_again_after_a_gap_or_a_restart():
    app = TopApp("http://127.0.0.1:9", window=10)
    for t in (0, 1, 5, 11, 12):
        app._add_reading(Scrape(time=t, generation_tokens=100 * t))
    assert [s.time for s in app.scrapes] == [1, 5, 11, 12]  # the newest at least 10 s older stays
    app._add_reading(Scrape(time=30, generation_tokens=3000))  # 18 s since the last: a gap
    assert [s.time for s in app.scrapes] == [30]
    app._add_reading(Scrape(time=31, generation_tokens=10))  # the counter went back: a restart
    assert [s.time for s in app.scrapes] == [31]


def test_dashboard_keeps_its_numbers_dimmed_and_dated_when_the_server_goes(server):
    """An outage showed the last numbers (8 running, 36 tok/s) as if live, for a minute, the error below the
    screen's edge in a small terminal: now they are dimmed, the running requests cleared, and the status line (the
    first under the header) dates them."""
    async def scenario():
        app = TopApp(server, interval=60)
        async with app.run_test(size=(60, 15)):
            await until(lambda: app.kv is not None)
            app._show_requests([{"request_id": "r1", "num_blocks": 3}])
            app.url = "http://127.0.0.1:9"  # nothing listens there
            await app.poll()
            assert app.error.startswith("http://127.0.0.1:9 does not answer: ConnectError")
            assert len(app.scrapes) == 1 and app.kv["num_blocks"] == 512
            status = str(app.query_one("#status").content)
            assert status == f"numbers from {app.read_at}: {app.error}" and app.read_at.count(":") == 2
            assert app.query_one("#status").region.y == 1  # right under the header
            assert all(app.query_one(w).has_class("stale") for w in ("#summary", "#latency", "#blocks"))
            assert app.query_one("#running").row_count == 0
            app.url = server
            await app.poll()
            assert not any(app.query_one(w).has_class("stale") for w in ("#summary", "#latency", "#blocks"))
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_dashboard_fits_the_terminal_and_a_long_interval(server):
    """The block map was 6 x 64 cells at any size (ragged rows below 66 columns, or where a scrollbar shows); an
    --interval over the 10 s window never showed a rate, and one reading showed 0.0 tok/s instead of none."""
    async def scenario():
        app = TopApp(server, interval=60)
        async with app.run_test(size=(40, 15)) as pilot:
            await until(lambda: app.kv is not None)
            assert app._map_shape() == (1, 36)
            lines = app._blocks({"blocks": "#" * 72}).plain.splitlines()
            assert lines[1:] == ["█" * 36] and lines[0].startswith("KV blocks, 2/cell: █ used")
            for size in [(50, 30), (120, 40)]:  # a resize redraws the map for the new size at once
                await pilot.resize_terminal(*size)
                await pilot.pause()
                blocks = app.query_one("#blocks")
                drawn = text(blocks.content).splitlines()[1:]
                assert drawn and max(map(len, drawn)) == min(64, size[0] - 4) <= blocks.content_region.width
        app = TopApp(server, interval=60)  # an app runs once
        async with app.run_test(size=(160, 50)):
            await until(lambda: app.kv is not None)
            assert app._map_shape() == (6, 64)
    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert TopApp("http://h:1", interval=30).window == 90 and TopApp("http://h:1").window == 10
    one = text(TopApp._summary(Scrape(time=1.0), view(None, Scrape(time=1.0)), {}))
    assert "- generated tok/s, - prompt tok/s, - req/s" in one


def test_quitting_while_a_reading_is_out_is_quiet(server):
    """A reading that came back after the app closed drew into widgets already gone: a WorkerFailed traceback."""
    answers = {path: httpx.get(f"{server}{path}") for path in ("/metrics", "/v1/kv")}

    class Late:  # the server's answers, given after the app closed
        async def get(self, url):
            return answers[url.removeprefix(server)]

    async def scenario():
        app = TopApp(server, interval=60)
        async with app.run_test():
            await until(lambda: app.kv is not None)
        app.client = Late()
        await app.poll()  # returns quietly
        app.client = Late()
        app.url = "http://127.0.0.1:9"
        answers["http://127.0.0.1:9/metrics"] = answers["http://127.0.0.1:9/v1/kv"] = httpx.Response(
            503, request=httpx.Request("GET", "http://127.0.0.1:9/metrics"))
        await app.poll()  # the error path too
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_timeout_is_named_in_the_status_line(server):
    async def scenario():
        app = TopApp(server, interval=60)
        async with app.run_test():
            await until(lambda: app.kv is not None)

            async def times_out(url):
                raise httpx.ReadTimeout("")
            app.client.get = times_out
            await app.poll()
            assert app.error == f"{server} does not answer: ReadTimeout: no answer in 2 s"
    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.fixture(autouse=True)
def no_installed_server(monkeypatch, tmp_path):
    """`top` reads the installed server's address and key when not given: none here, whatever this machine has.
    The CLI runner has no terminal: the tests stand one in (but for the test of its absence)."""
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr("appliance.cli._has_terminal", lambda: True)


def test_top_without_a_terminal_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr("appliance.cli._has_terminal", lambda: False)
    one_line_error(runner.invoke(cli, ["top", "--url", "http://127.0.0.1:9"]), "needs a terminal", "/metrics")


def test_top_and_bench_default_to_the_installed_servers_address_and_key(monkeypatch, tmp_path):
    from appliance import config as cfgmod

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing answers there
    cfgmod.save(cfgmod.Config(model="m", host="0.0.0.0", port=port, api_key="sesame"))
    for command in (["top"], ["bench", "--concurrency", "1"]):
        one_line_error(runner.invoke(cli, command), f"no server answers at http://127.0.0.1:{port}")
    engine = AsyncLLMEngine(lambda: FakeEngine(), "fake-model")
    try:
        with ServerThread(build_app(engine, api_key="sesame")) as url:
            cfgmod.save(cfgmod.Config(model="m", port=int(url.rsplit(":", 1)[1]), api_key="sesame"))
            started = []
            monkeypatch.setattr(TopApp, "run", lambda self: started.append((self.url, self.headers)))
            result = runner.invoke(cli, ["top"])
            assert result.exit_code == 0 and started == [(url, {"Authorization": "Bearer sesame"})], result.output
            cfgmod.save(cfgmod.Config(model="m", port=port, api_key="sesame"))  # installed elsewhere now
            # the installed key never goes to another address
            one_line_error(runner.invoke(cli, ["top", "--url", url]), "answered 401", "--api-key")
    finally:
        engine.shutdown()


def test_top_without_a_server_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the CLI connects
    one_line_error(runner.invoke(cli, ["top", "--url", f"http://127.0.0.1:{port}"]), "no server answers")
    one_line_error(runner.invoke(cli, ["top", "--interval", "0"]), "--interval must be positive")


def test_dashboard_waits_for_a_loading_model(monkeypatch):
    """While the model loads, /v1/kv answers 503: the CLI starts the dashboard anyway, which shows the server's
    message and its first numbers once the engine is up."""
    import threading

    gate = threading.Event()
    engine = AsyncLLMEngine(lambda: gate.wait(20) and FakeEngine(), "fake-model")

    async def scenario(url):
        app = TopApp(url, interval=60)
        async with app.run_test():
            await until(lambda: app.error is not None)
            assert app.error.startswith(f"{url} answered 503: ") and not app.scrapes
            gate.set()
            wait_for(lambda: engine.is_ready, what="engine ready")
            await app.poll()
            assert app.error is None and app.kv["num_blocks"] == 512

    try:
        with ServerThread(build_app(engine)) as url:
            started = []
            monkeypatch.setattr(TopApp, "run", lambda self: started.append((self.url, self.interval)))
            result = runner.invoke(cli, ["top", "--url", url + "/", "--interval", "0.5"])
            assert result.exit_code == 0 and started == [(url, 0.5)], result.output
            monkeypatch.undo()
            asyncio.run(asyncio.wait_for(scenario(url), 30))
    finally:
        gate.set()
        engine.shutdown()


def test_top_needs_the_servers_api_key():
    engine = AsyncLLMEngine(lambda: FakeEngine(), "fake-model")
    try:
        with ServerThread(build_app(engine, api_key="sesame")) as url:
            one_line_error(runner.invoke(cli, ["top", "--url", url]), "answered 401: the server needs an API key",
                           "pass --api-key")
            one_line_error(runner.invoke(cli, ["top", "--url", url, "--api-key", "wrong"]),
                           "answered 401: the server refused the API key", "check --api-key")
    finally:
        engine.shutdown()
    one_line_error(runner.invoke(cli, ["top", "--url", "http://[::1:9"]), "no server answers")

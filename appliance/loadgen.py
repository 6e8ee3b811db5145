"""``appliance bench``: a load sweep against a running server, vLLM ``benchmark_serving``-style.

For each concurrency level, that many clients each stream completions back to back (``/v1/completions`` with
``stream: true`` and ``ignore_eos``) until ``requests`` have finished; per level it reports req/s, output tok/s
and TTFT / TPOT / ITL / E2E latencies (mean, median, standard deviation, 99th percentile; the table shows medians
and 99th percentiles). A request counts as failed on an HTTP error, an error event in its stream, or a stream
without text (as vLLM's benchmark counts them). Everything goes over HTTP: it measures what a user sees. Before
each level, untimed warm-up rounds (``--num-warmups``) of as many requests as clients,
the level's prompt and :data:`WARMUP_TOKENS` output tokens, so that the level's batch sizes have run once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

#: output tokens of each warm-up request (fewer than a level's: they only need the level's batch sizes to run once)
WARMUP_TOKENS = 16


@dataclass
class RequestTiming:
    """One streamed request: seconds from send to the first text, between text chunks, and to the end;
    ``input_tokens`` / ``output_tokens`` from the stream's final usage chunk."""

    ttft: float
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, in seconds (vLLM's TPOT); None for one token or none."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True)
class Summary:
    """Mean, median, standard deviation (of the population) and 99th percentile of some latencies, in seconds;
    all 0.0 for none (as vLLM's ``benchmark_serving`` reports a level with no such values)."""

    mean: float
    median: float
    std: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(statistics.fmean(values), percentile(values, 50), statistics.pstdev(values), percentile(values, 99))


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level: counts, ``duration`` in seconds of wall time, and a latency :class:`Summary` each for
    TTFT, TPOT, ITL and E2E latency (``e2el``)."""

    concurrency: int
    requests: int
    errors: int
    input_tokens: int
    output_tokens: int
    duration: float
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary
    first_error: str | None = None  # why the first failed request failed (the server's message where it sent one)

    @property
    def req_per_s(self) -> float:
        return self.requests / self.duration

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.duration

    def to_json(self) -> dict:
        """This level under the key names of vLLM's ``benchmark_serving.py --save-result`` (latencies in
        milliseconds, ``duration`` in seconds), so that scripts written for its results read ours."""
        ms = {f"{stat}_{name}_ms": 1e3 * getattr(getattr(self, name), stat)
              for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")}
        return {"max_concurrency": self.concurrency, "completed": self.requests, "failed": self.errors,
                "total_input_tokens": self.input_tokens, "total_output_tokens": self.output_tokens,
                "duration": self.duration, "request_throughput": self.req_per_s,
                "output_throughput": self.output_tok_per_s,
                "total_token_throughput": (self.input_tokens + self.output_tokens) / self.duration, **ms}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between the sorted values (``numpy.percentile``'s
    default, as vLLM's ``benchmark_serving`` computes it); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _error_message(body: bytes) -> str:
    """An error answer's text: the OpenAI-shaped JSON's ``error.message``, else its first 200 bytes."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return repr(body[:200])


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    start = time.perf_counter()
    timing, last, usage = None, start, {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {_error_message(await resp.aread())}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server failed the request after the stream started
                raise RuntimeError(f"error event: {str(chunk['error'])[:200]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if timing is None:
                timing = RequestTiming(ttft=now - start)
            else:
                timing.itl.append(now - last)
            last = now
    if timing is None:  # as vLLM's benchmark: a stream without a valid text chunk is a failed request
        raise RuntimeError("the stream ended without text")
    timing.e2e = time.perf_counter() - start
    timing.input_tokens = usage.get("prompt_tokens") or 0
    timing.output_tokens = usage.get("completion_tokens") or 0
    return timing


def auto_processes(concurrency: int) -> int:
    """Load-generator processes for a level: one per 64 streams, at most half the CPUs (one Python client parses
    at most about 5-10k streamed chunks a second: bench/RESULTS.md, where one measured 180 µs of CPU per chunk)."""
    return max(1, min(-(-concurrency // 64), (os.cpu_count() or 2) // 2))


def client_processes(concurrency: int, requests: int, processes: int = 0) -> int:
    """The processes a level runs in: ``processes`` (0: :func:`auto_processes`), at most one per client and per
    request."""
    return max(1, min(processes or auto_processes(concurrency), concurrency, requests))


async def run_level(url: str, model: str, concurrency: int, requests: int, prompt_len: int,
                    max_tokens: int, api_key: str | None = None, processes: int = 1) -> LevelResult:
    """Run ``requests`` streamed completions with ``concurrency`` clients in flight; bounded by the count.
    ``processes`` > 1 (0: :func:`auto_processes`; at most :func:`client_processes`) splits the clients and requests
    over that many processes (``python -m appliance.loadgen``,
    started together at one wall-clock time), whose timings are summarized together; the duration runs from the
    common start to the last one's end."""
    processes = client_processes(concurrency, requests, processes)
    if processes == 1:
        timings, errors, first_error, start, end = await _timings(url, model, concurrency, requests, prompt_len,
                                                                  max_tokens, api_key)
    else:
        timings, errors, first_error, start, end = await _timings_in_processes(
            url, model, concurrency, requests, prompt_len, max_tokens, api_key, processes)
    return LevelResult(concurrency, len(timings), errors, sum(t.input_tokens for t in timings),
                       sum(t.output_tokens for t in timings), end - start, Summary.of([t.ttft for t in timings]),
                       Summary.of([t.tpot for t in timings if t.tpot is not None]),
                       Summary.of([x for t in timings for x in t.itl]), Summary.of([t.e2e for t in timings]),
                       first_error)


async def _timings(url: str, model: str, concurrency: int, requests: int, prompt_len: int, max_tokens: int,
                   api_key: str | None, start_at: float | None = None
                   ) -> tuple[list[RequestTiming], int, str | None, float, float]:
    """(timings, failed requests, why the first failed, start, end: ``time.time()`` seconds) of one process's share;
    it starts at the wall-clock time ``start_at`` when given."""
    body = {"model": model, "prompt": "hello " * prompt_len, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timings: list[RequestTiming] = []
    errors, first_error = 0, None
    todo = iter(range(requests))

    async def worker(client):
        nonlocal errors, first_error
        for _ in todo:
            try:
                timings.append(await _one(client, url, body))
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                errors += 1  # unreachable, an HTTP error or error event, or a stream that is not one
                first_error = first_error or (str(exc) if isinstance(exc, RuntimeError) else
                                              f"{type(exc).__name__}: {exc}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        start = time.time()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        end = time.time()
    return timings, errors, first_error, start, end


def _shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive counts (the first ones larger)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


async def _timings_in_processes(url: str, model: str, concurrency: int, requests: int, prompt_len: int,
                                max_tokens: int, api_key: str | None,
                                processes: int) -> tuple[list[RequestTiming], int, str | None, float, float]:
    """:func:`_timings` over ``processes`` child processes (their arguments on stdin, their timings as JSON on
    stdout), all starting 2 s from now (interpreter start-up is not load). Raises RuntimeError when one fails."""
    start_at = time.time() + 2.0
    jobs = []
    for conc, reqs in zip(_shares(concurrency, processes), _shares(requests, processes)):
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "appliance.loadgen",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        args = dict(url=url, model=model, concurrency=conc, requests=reqs, prompt_len=prompt_len,
                    max_tokens=max_tokens, api_key=api_key, start_at=start_at)
        jobs.append((proc, json.dumps(args).encode()))
    done = await asyncio.gather(*(proc.communicate(args) for proc, args in jobs))
    timings, errors, first_errors, starts, ends = [], 0, [], [], []
    for (proc, _), (out, err) in zip(jobs, done):
        if proc.returncode != 0:
            raise RuntimeError(f"a load-generator process failed (exit {proc.returncode}): {err.decode()[-300:]}")
        share = json.loads(out)
        timings += [RequestTiming(**t) for t in share["timings"]]
        errors += share["errors"]
        first_errors += [share["first_error"]] if share["first_error"] else []
        starts.append(share["start"])
        ends.append(share["end"])
    return timings, errors, (first_errors or [None])[0], min(starts), max(ends)


def _child() -> None:
    """``python -m appliance.loadgen``: one process's share of a level (:func:`_timings_in_processes`)."""
    args = json.loads(sys.stdin.read())
    timings, errors, first_error, start, end = asyncio.run(_timings(**args))
    json.dump({"timings": [dataclasses.asdict(t) for t in timings], "errors": errors, "first_error": first_error,
               "start": start, "end": end}, sys.stdout)


def model_cards(url: str, api_key: str | None = None) -> list[dict]:
    """The model cards the server lists (``GET /v1/models``' ``data``; raises httpx.HTTPError when it is
    unreachable or refuses, ValueError for a body that is not JSON, KeyError / TypeError for one that is no model
    list)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    resp.raise_for_status()
    return list(resp.json()["data"])


def served_models(url: str, api_key: str | None = None) -> list[str]:
    """The model ids the server lists (:func:`model_cards`' errors)."""
    return [card["id"] for card in model_cards(url, api_key)]


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model id the server lists (raises httpx.HTTPError when it is unreachable, IndexError when it
    lists none)."""
    return served_models(url, api_key)[0]


if __name__ == "__main__":
    _child()

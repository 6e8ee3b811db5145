"""Load test (issue 4): 64 concurrent streaming chat clients against the real engine on the demo model (CPU,
loopback), with mixed prompt lengths and max_tokens and seeded random disconnects.

Every response must be a 200 (no 5xx, no refusal: 64 fit in max_num_seqs + max_waiting); every stream read to
the end must be well formed (each ``data:`` chunk parses, one role delta first, exactly one finish_reason, the
usage chunk last when asked for, ``data: [DONE]`` at the end); afterwards every request has finished exactly once
(``vllm:request_success_total`` sums to 64), nothing is left in the engine and no KV block is held.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass, field

import httpx
import pytest

pytest.importorskip("engine.llm_engine")

from test_server_fakes import demo_model_server, wait_for  # noqa: E402

CLIENTS = 64
SEED = 4
WORDS = ("the quick brown fox jumps over a lazy dog while seven kings of old count their gold and sing "
         "about rivers mountains bread wine").split()


@dataclass
class Client:
    """One simulated user: what it asks, when it leaves (after that many ``data:`` lines; None = stays to the
    end), and what it got."""

    words: int
    max_tokens: int
    include_usage: bool
    leave_after: int | None
    status: int = 0
    events: list[str] = field(default_factory=list)  # the ``data:`` payloads
    other_lines: list[str] = field(default_factory=list)  # anything but data, comments (pings) and blank lines

    def body(self, model: str) -> dict:
        content = " ".join(WORDS[i % len(WORDS)] for i in range(self.words))
        body = {"model": model, "messages": [{"role": "user", "content": f"Repeat after me: {content}"}],
                "max_tokens": self.max_tokens, "temperature": 0.7, "seed": self.words, "stream": True}
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body


def make_clients(rng: random.Random) -> list[Client]:
    return [Client(words=rng.randint(1, 120), max_tokens=rng.randint(4, 24), include_usage=rng.random() < 0.5,
                   leave_after=rng.randint(0, 3) if rng.random() < 0.3 else None) for _ in range(CLIENTS)]


async def run_client(http: httpx.AsyncClient, model: str, c: Client) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=c.body(model)) as r:
        c.status = r.status_code
        if c.status != 200:
            c.events.append((await r.aread()).decode())
            return
        if c.leave_after == 0:
            return  # leaves as soon as the headers came
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                c.events.append(line[len("data: "):])
                if c.leave_after is not None and len(c.events) >= c.leave_after:
                    return  # closing the unread response drops the connection
            elif line and not line.startswith(":"):
                c.other_lines.append(line)


def check_stream(c: Client) -> None:
    """The whole stream of a client that stayed: well-formed SSE chunks of one chat completion."""
    assert c.other_lines == []
    assert c.events[-1] == "[DONE]" and c.events.count("[DONE]") == 1, c.events[-3:]
    chunks = [json.loads(e) for e in c.events[:-1]]
    assert all("error" not in ch and ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert len({ch["id"] for ch in chunks}) == 1
    with_choices = [ch for ch in chunks if ch["choices"]]
    assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in ch["choices"][0]["delta"] for ch in with_choices[1:])
    assert all([choice["index"] for choice in ch["choices"]] == [0] for ch in with_choices)
    reasons = [ch["choices"][0]["finish_reason"] for ch in with_choices]
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] in ("stop", "length")
    if not c.include_usage:
        assert chunks == with_choices and all("usage" not in ch for ch in chunks)
        return
    assert chunks[:-1] == with_choices and all(ch["usage"] is None for ch in with_choices)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (usage["completion_tokens"] == c.max_tokens) == (reasons[-1] == "length")
    assert 1 <= usage["completion_tokens"] <= c.max_tokens


def success_total(metrics: str, model: str) -> dict[str, float]:
    pattern = rf'^vllm:request_success_total\{{finished_reason="(\w+)",model_name="{re.escape(model)}"\}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, metrics, re.MULTILINE)}


def test_64_streaming_clients_with_disconnects_leave_nothing_behind():
    clients = make_clients(random.Random(SEED))
    leavers = [c for c in clients if c.leave_after is not None]
    assert 10 <= len(leavers) <= 30 and any(c.leave_after == 0 for c in leavers)
    with demo_model_server(max_model_len=256, max_num_seqs=16, cpu_kv_cache_gib=0.25) as (url, engine):
        model = engine.model_name

        async def main() -> None:
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
                await asyncio.gather(*(run_client(http, model, c) for c in clients))

        asyncio.run(main())
        assert [c.status for c in clients] == [200] * CLIENTS, [c.events for c in clients if c.status != 200]
        for c in clients:
            if c.leave_after is None:
                check_stream(c)
        wait_for(lambda: engine.num_requests == 0 and engine.get_stats().num_running == 0
                 and engine.get_stats().num_waiting == 0, timeout=120, what="engine idle")
        kv = httpx.get(f"{url}/v1/kv").json()
        assert (kv["used"], kv["running"], kv["free"] + kv["cached"]) == (0, [], kv["num_blocks"])
        llm = engine.engine  # idle: the engine thread waits for a command, so reading it here is safe
        llm.block_manager.check([])
        assert not llm.requests and not llm.scheduler.running and not llm.scheduler.waiting
        metrics = httpx.get(f"{url}/metrics").text
        finished = success_total(metrics, model)
        assert sum(finished.values()) == CLIENTS  # every request finished exactly once
        assert finished.get("abort", 0) <= len(leavers)
        assert f'vllm:num_requests_running{{model_name="{model}"}} 0.0' in metrics
        assert httpx.get(f"{url}/health").status_code == 200

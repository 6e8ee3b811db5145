"""The OpenAI server's CPU time per streamed token, with no model: ``python bench/server_cpu.py [STREAMS] [TOKENS]``.

At many concurrent streams the server's one event loop (SSE, JSON, HTTP) is what limits a GPU server's output
(bench/RESULTS.md, runs 88-89), and on a GPU that cost is mixed with everything else. Here the engine is the test
suite's ``FakeEngine`` (tests/test_server_fakes.py: one token per request per step, ``STEP_DELAY`` seconds a step,
default 0.02) behind ``AsyncLLMEngine``'s engine thread, uvicorn serves it in this process, and a load generator in a
child process streams STREAMS completions of TOKENS tokens at once (``ignore_eos``). Printed: the output tok/s the
client saw, and this process's CPU seconds less the fake engine's steps, per token and per SSE chunk (a lagging
client gets several tokens in one chunk). ``PLAIN=1`` hides uvloop and httptools, so uvicorn runs on asyncio's loop
and h11 (``engine_bench.HTTP_MODES``). Needs no GPU; the figures are this machine's.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time

if os.environ.get("PLAIN"):
    sys.modules["uvloop"] = sys.modules["httptools"] = None  # uvicorn's "auto" falls back (ImportError)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # run as a script: the repository's packages, the test fakes

import uvicorn  # noqa: E402

from engine.server.api_server import build_app  # noqa: E402
from test_server_fakes import FakeEngine, started_engine  # noqa: E402

CLIENT = """
import asyncio, sys, time, httpx
streams, tokens, url = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
async def one(client):
    chunks = 0
    body = dict(model="fake-model", prompt="hi", max_tokens=tokens, stream=True, ignore_eos=True)
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks
async def main():
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 8)) as client:
        t = time.monotonic()
        chunks = await asyncio.gather(*(one(client) for _ in range(streams)))
        print(sum(chunks), time.monotonic() - t)
asyncio.run(main())
"""


def main() -> None:
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    fake = FakeEngine(max_model_len=tokens + 64, max_num_seqs=streams, num_blocks=4096, reply="ab" * tokens,
                      step_delay=float(os.environ.get("STEP_DELAY", "0.02")))
    engine_cpu = [0.0]
    step = fake.step

    def timed_step():
        t = time.thread_time()
        try:
            return step()
        finally:
            engine_cpu[0] += time.thread_time() - t
    fake.step = timed_step
    with started_engine(fake) as eng:
        config = uvicorn.Config(build_app(eng), host="127.0.0.1", port=0, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        before = resource.getrusage(resource.RUSAGE_SELF)
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-c", CLIENT, str(streams), str(tokens), f"http://127.0.0.1:{port}"],
                              capture_output=True, text=True, check=True)
        after = resource.getrusage(resource.RUSAGE_SELF)
        client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        server.should_exit = True
        thread.join(10)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) - engine_cpu[0]
    client = (client_after.ru_utime - client_before.ru_utime) + (client_after.ru_stime - client_before.ru_stime)
    chunks, seconds = done.stdout.split()
    total = streams * tokens
    loop = "asyncio + h11" if os.environ.get("PLAIN") else "uvloop + httptools where installed"
    print(f"{streams} streams x {tokens} tokens ({loop}): {total / float(seconds):.0f} tok/s at the client; "
          f"server CPU {cpu:.2f} s without the fake engine's {engine_cpu[0]:.2f} s = {cpu / total * 1e6:.0f} us per "
          f"token, {cpu / int(chunks) * 1e6:.0f} us per chunk ({chunks} chunks); the client's CPU "
          f"{client / total * 1e6:.0f} us per token")


if __name__ == "__main__":
    main()

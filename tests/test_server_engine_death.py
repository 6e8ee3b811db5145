"""``run_server`` when the engine dies while serving: the process exits with status 1 (vLLM's rule, so that systemd's
``Restart=on-failure`` starts it again), or with ``keep_alive_on_engine_death`` stays up answering 503.

The server runs in a subprocess over the fake engine (``test_server_fakes.FakeEngine``) whose first step raises.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine.errors import ENGINE_DIED_LOG
from engine.server.api_server import ENGINE_DIED_EXIT

SERVER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_server_fakes import FakeEngine
    from engine.async_engine import AsyncLLMEngine
    from engine.server import api_server

    def from_config(cls, config, max_waiting=512, engine_process=None, sleep_after_idle_s=None):
        return cls(lambda: FakeEngine(fail_at_step={fail!r}), "fake-model", None, max_waiting)

    AsyncLLMEngine.from_config = classmethod(from_config)
    api_server.run_server(None, port={port}, log_level="warning", keep_alive_on_engine_death={keep})
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _start(keep: bool, fail: int | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    script = SERVER.format(tests=str(Path(__file__).parent), port=port, keep=keep, fail=fail)
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if _get(url + "/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail("the server did not become ready in 60 s")


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        return proc.wait(20), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


#: how a server stopped by SIGTERM ends: uvicorn (0.29 on) raises the signal again after its graceful shutdown (a
#: clean stop for systemd), older ones exit 0; never ENGINE_DIED_EXIT
STOPPED = (0, -signal.SIGTERM)
COMPLETION = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def test_a_server_whose_engine_dies_while_serving_exits_with_status_1():
    proc, url = _start(keep=False, fail=0)
    status, body = _get(url + "/v1/completions", COMPLETION)
    # the request that met the failure gets the engine's death, not a 500 (a bug)
    assert (status, body["error"]["code"]) == (503, "engine_dead") and "fake engine failure" in body["error"]["message"]
    code, err = _stop(proc)
    assert code == ENGINE_DIED_EXIT == 1
    assert ENGINE_DIED_LOG in err and "fake engine failure" in err


def test_kept_alive_it_answers_503_with_the_error_until_stopped():
    proc, url = _start(keep=True, fail=0)
    try:
        status, body = _get(url + "/v1/completions", COMPLETION)
        assert (status, body["error"]["code"]) == (503, "engine_dead")
        status, body = _get(url + "/health")
        assert (status, body["status"]) == (503, "dead") and "fake engine failure" in body["error"]
        assert _get(url + "/v1/completions", COMPLETION)[0] == 503
        assert proc.poll() is None
    finally:
        proc.terminate()
    code, err = _stop(proc)
    assert code in STOPPED and ENGINE_DIED_LOG not in err


def test_a_server_stopped_by_sigterm_ends_as_before():
    proc, url = _start(keep=False, fail=None)
    assert _get(url + "/v1/completions", COMPLETION)[0] == 200
    proc.terminate()
    assert _stop(proc)[0] in STOPPED


def _demo_server(demo_model) -> tuple[subprocess.Popen, str]:
    """``python -m engine.server`` over the demo model with an engine process of its own (the default on CUDA), in
    a session of its own (a process group, as systemd's and ``appliance start``'s), once ready."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "--model", str(demo_model), "--device", "cpu",
                             "--engine-process", "--port", str(port), "--max-model-len", "256",
                             "--max-num-seqs", "2", "--log-level", "warning"], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _get(url + "/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the demo server did not become ready: {proc.stderr.read()}")


def test_a_killed_engine_process_makes_the_real_server_exit_with_status_1(demo_model):
    """The kernel's OOM killer, say, takes the engine process while the server waits; the engine thread's idle
    look finds it gone and the server exits."""
    import psutil

    proc, url = _demo_server(demo_model)
    try:
        engines = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(engines) == 1  # multiprocessing's resource tracker, if any, is left alone
        engines[0].kill()
        code, err = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == ENGINE_DIED_EXIT and ENGINE_DIED_LOG in err and "EngineProcessDied" in err


def test_sigterm_to_the_group_lets_a_streaming_answer_finish_and_is_no_engine_death(demo_model):
    """`systemctl stop` / `restart` and `appliance stop` signal every process of the group. The engine process,
    serving, ignores SIGTERM and ends when the server goes; the stream gets ``STREAM_GRACE_S`` to finish, so a short
    answer ends normally (all its tokens, then ``[DONE]``); nothing reads as an engine death."""
    import os
    import threading

    from engine.server.serving import STREAM_GRACE_S

    import psutil

    proc, url = _demo_server(demo_model)
    engines = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events, first = [], threading.Event()

    def stream():
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    first.set()

    reader = threading.Thread(target=stream, daemon=True)
    try:
        reader.start()
        assert first.wait(60)
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        reader.join(30)
        code, err = _stop(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    took = time.monotonic() - stopped
    assert events[-1] == b"[DONE]" and finish[-1] == "length", (took, events[-3:])
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1 and took < STREAM_GRACE_S + 10
    assert code in STOPPED and ENGINE_DIED_LOG not in err and "engine thread died" not in err
    assert len(engines) == 1 and not engines[0].is_running()  # the engine process went with the server

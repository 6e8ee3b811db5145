"""``AsyncLLMEngine``: the synchronous ``LLMEngine`` loop on its own thread, beside the asyncio event loop.

One thread ("engine thread") owns the ``LLMEngine``: it builds it (model load), then loops
``drain commands -> step() -> deliver outputs`` and sleeps on a ``threading.Event`` when there is nothing to do.
Event-loop code talks to it only through a thread-safe command queue (add / abort) and receives each request's
``RequestOutput``s on a per-request ``asyncio.Queue`` filled with ``loop.call_soon_threadsafe`` (once per step
for all of them: :func:`hand_over`).
Stats are snapshotted by the engine thread after every step, so readers never call into the engine.
On CUDA the "``LLMEngine``" is by default an ``EngineProcess`` (engine/engine_process.py): the same interface,
with the real engine in a child process, so that this process's event loop never takes the GIL from it.

Admission: at most ``max_num_seqs + max_waiting`` requests are in the engine at once (submitted and not finished
or aborted), so at most ``max_waiting`` of them wait for a batch slot; one more is refused at once with
``EngineOverloadedError`` (the server answers 503 with ``Retry-After``) and leaves nothing behind. The default
``max_waiting`` is Ollama's ``OLLAMA_MAX_QUEUE`` (512); vLLM itself queues without a bound.

Request ids: an id names at most one live request (submitted, neither finished nor aborted); adding a live id is
refused with ``ValueError`` (as vLLM's AsyncLLM), and an id may be reused as soon as ``abort`` returns. Each
``RequestStream`` object is its request's key: commands carry the stream, and the engine thread routes the
``LLMEngine``'s outputs through ``_routes`` (id inside the ``LLMEngine`` -> the stream of the request it holds
under that id). A reused id enters the ``LLMEngine`` only once the old request's last output (its "abort") is
out, so the ``LLMEngine`` never holds two requests of one id and nothing of the old one reaches the new stream
(after a failed step, until the next step that succeeds: the ``LLMEngine`` delivers what it held then).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineBroken, StepFailed
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


#: Requests that may wait for a batch slot beyond the ``max_num_seqs`` that run (Ollama's OLLAMA_MAX_QUEUE).
DEFAULT_MAX_WAITING = 512
#: engine steps that may fail in a row (each failing only its own requests) before the engine is declared dead
MAX_FAILED_STEPS = 3


class EngineDeadError(RuntimeError):
    """The engine thread stopped (failed to load, raised in ``step``, or was shut down); nothing can be served."""


class EngineOverloadedError(RuntimeError):
    """The engine already holds ``limit`` requests (``max_num_seqs + max_waiting``); the new one was not taken."""

    def __init__(self, limit: int, max_waiting: int) -> None:
        super().__init__(f"The server is overloaded: {limit} requests are already running or waiting "
                         f"(max_waiting={max_waiting}); retry later.")
        self.limit, self.max_waiting = limit, max_waiting


_ACCEPTED = object()  # first item on a request's queue once the engine has taken it
_ABORTED = object()  # last item on a request's queue when ``AsyncLLMEngine.abort`` ended it from outside


class _FailedRoute:
    """The route of a request whose step failed: the ``LLMEngine`` may still hold an output of it, delivered by its
    next step. Never live, so that output reaches nobody, and a reused id stays parked until it is out."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
OutputListener = Callable[[list[RequestOutput]], None]


def hand_over(items: list[tuple[RequestStream, Any]]) -> None:
    """Put each (stream, item) on its stream's queue from any thread, in order: one ``call_soon_threadsafe`` per
    event loop for all of them (each is a write to the loop's self-pipe and a wake-up; one per stream and step was
    the engine thread's largest cost with 64 streams). A stream whose loop is closed (nobody listens any more) is
    aborted instead."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed
            for stream, _ in batch:
                stream._engine._abort_stream(stream)


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._queue.put_nowait(item)


class RequestStream:
    """The outputs of one request, consumed on the event loop: ``async for out in stream``.

    Yields cumulative ``RequestOutput``s; when the consumer lags, intermediate ones are skipped (each output
    contains everything before it). Stops after the finished output. Raises what the engine raised for it
    (``ContextLengthError``, ``ValueError``, ``EngineDeadError``).
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._error: BaseException | None = None

    def put_threadsafe(self, item: Any) -> None:
        """Hand ``item`` (an output, ``_ACCEPTED`` or an exception) to the consumer from any thread."""
        hand_over([(self, item)])

    async def wait_accepted(self) -> None:
        """Wait until the engine took the request; raise its rejection (and mark the stream finished), or
        ``asyncio.CancelledError`` when it was aborted by id first."""
        item = await self._queue.get()
        if item is _ABORTED:
            self.finished = True
            raise asyncio.CancelledError(f"request {self.request_id!r} was aborted")
        if isinstance(item, BaseException):
            self.finished = True
            raise item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._error is not None or self.finished:
            self.finished = True
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and item is not _ABORTED and not self._queue.empty():
            newer = self._queue.get_nowait()
            if isinstance(newer, BaseException) or newer is _ABORTED:
                # an error is raised on the next call, after this output; an abort by id ends the iteration there
                self._error = newer if newer is not _ABORTED else None
                self.finished = newer is _ABORTED
                break
            item = newer  # a newer cumulative output supersedes this one
        if item is _ABORTED:  # aborted by id from outside: the iteration ends
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = self.finished or item.finished
        return item

    def abort(self) -> None:
        """Abort the request in the engine unless it already finished; idempotent. Never touches a newer request
        that reuses the id."""
        if not self.finished:
            self.finished = True
            self._engine._abort_stream(self)


class AsyncLLMEngine:
    """Async front of one ``LLMEngine``, safe to use from any number of asyncio tasks.

    ``engine_factory`` builds the ``LLMEngine`` on the engine thread (it may take minutes); ``model_name`` is the
    served name, known before load. States: "new" -> "loading" -> "ready", or "dead" once loading or a step raised
    (``error`` holds the exception). Requests submitted while loading wait for the load.
    ``max_waiting``: how many requests may wait beyond ``config.max_num_seqs`` (``EngineConfig``'s default when
    there is no config) before ``add_request`` raises ``EngineOverloadedError``. ``sleep_after_idle_s``: seconds
    without requests after which an engine that can sleep (``EngineProcess.sleep``: its process stops, the GPU's
    memory is freed) is put to sleep, as Ollama unloads an idle model; the next request loads it again and waits
    for that (``EngineWakeFailed`` for it where the load fails). None: never (vLLM's way). The state stays "ready"
    asleep.
    """

    def __init__(self, engine_factory: Callable[[], Any], model_name: str, config: EngineConfig | None = None,
                 max_waiting: int = DEFAULT_MAX_WAITING, sleep_after_idle_s: float | None = None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting: must be non-negative, got {max_waiting}")
        if sleep_after_idle_s is not None and not sleep_after_idle_s >= 0:
            raise ValueError("sleep_after_idle_s: must be None (never sleep) or at least 0 seconds, got "
                             f"{sleep_after_idle_s}")
        self.sleep_after_idle_s = sleep_after_idle_s
        self.model_name = model_name
        self.config = config
        self.max_waiting = max_waiting
        self.max_requests = (config.max_num_seqs if config is not None else EngineConfig.max_num_seqs) + max_waiting
        self.error: BaseException | None = None
        self._factory = engine_factory
        self._engine: Any = None
        self._state = "new"
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.RLock()  # makes registering a stream, and releasing a given one, atomic
        self._streams: dict[str, RequestStream] = {}  # the live requests by id
        # engine thread only: id in the LLMEngine -> its request's stream (a _FailedRoute after a failed step)
        self._routes: dict[str, RequestStream | _FailedRoute] = {}
        self._parked: dict[str, tuple] = {}  # engine thread only: "add"s waiting for an old request of their id to end
        self._listeners: list[OutputListener] = []
        self._failure_listeners: list[Callable[[list[str]], None]] = []
        self._death_listeners: list[Callable[[BaseException], None]] = []
        self._stats: EngineStats | None = None
        self._stop = False
        self._failed_steps = 0  # engine steps that raised in a row
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting: int = DEFAULT_MAX_WAITING,
                    engine_process: bool | None = None, sleep_after_idle_s: float | None = None) -> AsyncLLMEngine:
        """An engine that loads ``LLMEngine(config)`` when started; served as ``served_model_name`` or folder name.
        ``engine_process``: run the ``LLMEngine`` in a process of its own (``engine/engine_process.py``), so that
        the event loop's work never waits for the GIL the engine needs, or on this process's engine thread; None:
        a process of its own on CUDA (``engine_process.wanted``). ``sleep_after_idle_s``: see the class (only an
        engine in a process of its own sleeps)."""
        from engine import engine_process as ep
        own_process = ep.wanted(config) if engine_process is None else engine_process

        def build():
            if own_process:
                return ep.EngineProcess(config)
            from engine.llm_engine import LLMEngine
            return LLMEngine(config)
        return cls(build, config.served_model_name or Path(config.model).name, config, max_waiting,
                   sleep_after_idle_s)

    # ---- state, read from any thread ----
    @property
    def state(self) -> str:
        return self._state

    @property
    def is_ready(self) -> bool:
        return self._state == "ready"

    @property
    def is_dead(self) -> bool:
        return self._state == "dead"

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps (``sleep_after_idle_s``): still "ready", its GPU memory freed until a request."""
        return bool(getattr(self._engine, "asleep", False))

    @property
    def waking(self) -> bool:
        """Whether a request is waking the sleeping engine (it loads its model again)."""
        return bool(getattr(self._engine, "waking", False))

    @property
    def engine(self) -> Any:
        """The loaded ``LLMEngine`` (read-only use: ``tokenizer``, ``max_model_len``); None until ready."""
        return self._engine

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished or aborted (what ``max_requests`` bounds)."""
        return len(self._streams)

    def get_stats(self) -> EngineStats | None:
        """The snapshot taken after the latest step (None before the engine is loaded); while a request wakes the
        sleeping engine, the engine's own (that request waiting: ``EngineProcess.waking``). Every live request the
        snapshot does not show running waits: those queued in front of the engine (behind a step or a wake, or
        parked) and those it took since the snapshot; where the engine's own count is higher it stands (an aborted
        request runs in it until its next step). A dead engine's requests all failed: none runs or waits."""
        stats = self._engine.get_stats() if self.waking else self._stats
        if stats is None:
            return None
        if self.is_dead:
            return dataclasses.replace(stats, num_running=0, num_waiting=0, running=[])
        waiting = max(stats.num_waiting, self.num_requests - stats.num_running)
        return stats if waiting == stats.num_waiting else dataclasses.replace(stats, num_waiting=waiting)

    def add_output_listener(self, fn: OutputListener) -> None:
        """Call ``fn(outputs)`` on the engine thread after every step (metrics); exceptions are logged."""
        self._listeners.append(fn)

    def remove_output_listener(self, fn: OutputListener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def add_failure_listener(self, fn: Callable[[list[str]], None]) -> None:
        """Call ``fn(request_ids)`` on the engine thread for the requests a failed step ended (they get no finished
        output; metrics forget them); exceptions are logged."""
        self._failure_listeners.append(fn)

    def remove_failure_listener(self, fn: Callable[[list[str]], None]) -> None:
        if fn in self._failure_listeners:
            self._failure_listeners.remove(fn)

    def add_death_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call ``fn(error)`` on the engine thread, once, when an engine that was serving dies (``error``: what
        killed it; its requests have had ``EngineDeadError`` or that error already). Not for a load that fails
        (the engine never served: /health reports it) nor for ``shutdown``. The server exits on it
        (``api_server.run_server``), as vLLM's does, so that its service manager starts it again."""
        self._death_listeners.append(fn)

    # ---- lifecycle ----
    def start(self) -> None:
        """Start the engine thread (which loads the engine); idempotent."""
        if self._thread is None:
            self._state = "loading"
            self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; pending requests get ``EngineDeadError``. A thread still
        in its step after ``timeout`` s (an engine process stuck on the GPU) has its engine killed, where the
        engine can be (``EngineProcess.kill``: the thread's wait then ends), and gets 5 s more."""
        self._stop = True
        self._wakeup.set()
        if self._thread is None or self._thread is threading.current_thread():
            return
        self._thread.join(timeout)
        kill = getattr(self._engine, "kill", None)
        if self._thread.is_alive() and kill is not None:
            logger.warning("the engine did not stop in %.0f s; killing its process", timeout)
            kill()
            self._thread.join(5.0)

    # ---- requests, called on the event loop ----
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Submit a request and wait until the engine accepted it; returns its output stream.

        Raises what ``LLMEngine.add_request`` raises (``ContextLengthError``, ``ValueError``),
        ``EngineOverloadedError`` when ``max_requests`` requests are already in (nothing is kept of this one) and
        ``EngineDeadError``. The caller must ``stream.abort()`` if it stops reading before the end.
        """
        if self._state == "new":
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(self, request_id)
        self._register(stream)
        if self.is_dead:  # checked after registering: _fail_all() cannot miss this stream
            self._release(stream)
            raise EngineDeadError(f"engine is dead: {self.error!r}")
        try:
            grammar = await self._compile_ahead(params)
        except BaseException:  # a schema it cannot follow, or the caller gave up: nothing of it is kept
            stream.abort()
            raise
        self._send(("add", stream, prompt, params, arrival, grammar))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def _compile_ahead(self, params: SamplingParams) -> Any:
        """A structured request's compiled grammar, compiled on a worker thread (xgrammar releases the GIL) and
        handed to the engine thread with the request, so that a long compile does not stall the running requests;
        None for another request, and while the engine loads (the engine thread compiles it then). Raises
        ValueError as ``LLMEngine.add_request`` would (a schema the grammar cannot follow, no xgrammar)."""
        if params.structured_outputs is None or self._state != "ready":  # "ready" is set after _engine
            return None
        engine, loop = self._engine, asyncio.get_running_loop()
        compiler = await loop.run_in_executor(None, engine.grammar_compiler)
        return await loop.run_in_executor(None, compiler.compile, params.structured_outputs)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until finished; closing or cancelling the consumer aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort the live request ``request_id`` from any thread; no further outputs are delivered for it and the
        id may be reused at once. Idempotent; an id that is not live is ignored."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send(("abort", stream))
            stream.put_threadsafe(_ABORTED)  # a consumer still reading it stops (its outputs stop here)

    # ---- live streams, from any thread ----
    def _register(self, stream: RequestStream) -> None:
        """Make ``stream`` the live request of its id. Raises ValueError while the id is live and
        ``EngineOverloadedError`` at ``max_requests``; nothing is kept when it raises."""
        with self._lock:
            if stream.request_id in self._streams:
                raise ValueError(f"request_id: {stream.request_id!r} is already running")
            if len(self._streams) >= self.max_requests:
                raise EngineOverloadedError(self.max_requests, self.max_waiting)
            self._streams[stream.request_id] = stream

    def _is_live(self, stream: RequestStream) -> bool:
        """Whether ``stream`` is still the live request of its id (not finished, failed or aborted)."""
        return self._streams.get(stream.request_id) is stream

    def _release(self, stream: RequestStream) -> bool:
        """End ``stream``'s life unless it ended already (its id may name a newer request by now). True when this
        call ended it: only that caller hands the stream its last item."""
        with self._lock:
            if not self._is_live(stream):
                return False
            del self._streams[stream.request_id]
            return True

    def _abort_stream(self, stream: RequestStream) -> None:
        """``abort`` the request of ``stream`` if it is still live: never a newer request that reuses the id."""
        with self._lock:
            if self._is_live(stream):
                self.abort(stream.request_id)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread ----
    def _run(self) -> None:
        served = False
        try:
            self._engine = self._factory()
            self._stats = self._engine.get_stats()
            if self.sleep_after_idle_s is not None and not hasattr(self._engine, "sleep"):
                logger.warning("sleep_after_idle_s is ignored: only an engine in a process of its own sleeps")
            self._state = "ready"
            served = True
            logger.info("engine ready: %s", self.model_name)
            while not self._stop:
                self._wakeup.clear()  # before draining: a command sent after this sets it again
                if self._stop:  # a shutdown between the loop's test and the clear: its wake-up is gone
                    break
                self._drain_commands()
                if not self._engine.has_unfinished_requests():
                    if self._clear_failed_routes():  # nothing is held any more: parked requests may enter
                        continue
                    self._stats = self._engine.get_stats()
                    self._wait_idle()
                    continue
                try:
                    outputs = self._engine.step()
                except StepFailed as e:
                    self._step_failed(e)
                    continue
                self._failed_steps = 0
                self._stats = self._engine.get_stats()
                self._deliver(outputs)
                self._clear_failed_routes()  # a step that succeeds delivers every output held before it
        except BaseException as e:  # noqa: BLE001 - any failure makes the engine dead, never a hung request
            logger.exception("engine thread died")
            self.error = e
        self._state = "dead"
        self._fail_all(self.error or EngineDeadError("engine was shut down"))
        close = getattr(self._engine, "close", None)  # an EngineProcess: its child stops
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - the engine is dead already; a failing stop is only logged
                logger.exception("stopping the engine process failed")
        if served and self.error is not None and not self._stop:
            for fn in list(self._death_listeners):
                try:
                    fn(self.error)
                except Exception:  # noqa: BLE001 - a listener must not hide the others
                    logger.exception("engine death listener failed")

    def _wait_idle(self) -> None:
        """Sleep until a command or shutdown sets ``_wakeup``; an engine with ``idle_look_s`` (the CPU path's thread
        count; an engine process's liveness) gets ``idle()`` every that many seconds meanwhile and once on waking (a
        failing look is logged, never fatal, except ``EngineBroken``: the engine is dead), and, one that can sleep,
        ``sleep()`` once ``sleep_after_idle_s`` seconds have passed."""
        period = getattr(self._engine, "idle_look_s", None)
        since = time.monotonic()
        while not self._stop:
            woke = self._wakeup.wait(period)
            if period is not None:
                try:
                    self._engine.idle()
                except EngineBroken:  # an engine process that died while the server waited: the engine is dead
                    raise
                except Exception:  # noqa: BLE001 - bookkeeping must not kill serving
                    logger.exception("idle look failed")
            if woke:
                return
            if (self.sleep_after_idle_s is not None and time.monotonic() - since >= self.sleep_after_idle_s
                    and hasattr(self._engine, "sleep") and not self._engine.asleep):
                try:
                    self._engine.sleep()
                    self._stats = self._engine.get_stats()
                except EngineBroken:
                    raise
                except Exception:  # noqa: BLE001 - an engine that cannot sleep goes on serving awake
                    logger.exception("putting the engine to sleep failed")

    def _step_failed(self, e: StepFailed) -> None:
        """A step failed for some requests: they get the error, the others carry on (the step's outputs are
        delivered). A forward pass that raised is a bug (a 500); after ``MAX_FAILED_STEPS`` of those in a row (a
        broken device, say) it is re-raised: the engine is dead. A request's own sampling failure is a 400."""
        if e.request_error:  # the requests' own parameters: they get the ValueError (a 400), nothing is broken
            logger.warning("requests %s failed: %s", e.request_ids, e.cause)
        else:
            self._failed_steps += 1
            logger.error("engine step failed (%d in a row); failing requests %s", self._failed_steps,
                         e.request_ids, exc_info=e.cause)
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise e
        for fn in list(self._failure_listeners):
            try:
                fn(list(e.request_ids))
            except Exception:  # noqa: BLE001 - a broken listener must not kill serving
                logger.exception("failure listener failed")
        for request_id in e.request_ids:
            stream = self._routes.get(request_id)
            if stream is None:
                continue
            self._routes[request_id] = _FailedRoute(request_id)  # cleared after the next step that succeeds
            if self._release(stream):
                stream.put_threadsafe(e.cause if e.request_error else e)
        self._stats = self._engine.get_stats()
        self._deliver(e.outputs)

    def _clear_failed_routes(self) -> bool:
        """Free the ids of requests whose step failed (their held outputs are out by now); True if there were any."""
        failed = [r for r, stream in self._routes.items() if isinstance(stream, _FailedRoute)]
        for request_id in failed:
            del self._routes[request_id]
        return bool(failed)

    def _drain_commands(self) -> None:
        """Admit the parked requests whose id came free, then apply the commands in the order they were sent."""
        for request_id in [r for r in self._parked if r not in self._routes]:
            self._admit(*self._parked.pop(request_id))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._admit(*cmd[1:])
            elif self._routes.get(cmd[1].request_id) is cmd[1]:  # "abort": only if the engine holds that request
                self._engine.abort_request(cmd[1].request_id)

    def _admit(self, stream: RequestStream, prompt: str | list[int], params: SamplingParams, arrival: float,
               grammar: Any) -> None:
        """Hand ``stream``'s request to the ``LLMEngine`` unless it was aborted meanwhile. While the engine still
        holds an old request of the same id (aborted, its last output not out yet) it is parked until that ends."""
        if not self._is_live(stream):  # aborted before the engine saw it
            return
        if self._stop:  # shutting down: no request starts now (nor wakes a sleeping engine)
            if self._release(stream):
                stream.put_threadsafe(EngineDeadError("engine was shut down"))
            return
        if stream.request_id in self._routes:
            self._parked[stream.request_id] = (stream, prompt, params, arrival, grammar)  # an earlier one was aborted
            return
        try:
            self._engine.add_request(stream.request_id, prompt, params, arrival_time=arrival, grammar=grammar)
        except EngineBroken:  # not the request's fault: the engine is dead (``_run``)
            raise
        except Exception as e:  # noqa: BLE001 - rejections belong to the request, not the engine
            if self._release(stream):
                stream.put_threadsafe(e)
            return
        self._routes[stream.request_id] = stream
        stream.put_threadsafe(_ACCEPTED)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route each output to the stream of the request the engine holds under its id: only while that stream is
        live (an aborted one gets nothing more); a finished output ends the route and the stream. The listeners
        (the Prometheus metrics) see the step's outputs first, so a client that has its output finds it counted."""
        for fn in list(self._listeners):
            try:
                fn(outputs)
            except Exception:  # noqa: BLE001 - a broken listener must not kill serving
                logger.exception("output listener failed")
        items = []
        for out in outputs:
            if out.finished:
                stream = self._routes.pop(out.request_id, None)
                live = stream is not None and self._release(stream)
            else:
                stream = self._routes.get(out.request_id)
                live = stream is not None and self._is_live(stream)
            if live:
                items.append((stream, out))
        hand_over(items)

    def _fail_all(self, cause: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if self._release(stream):
                err = EngineDeadError(f"engine is dead: {cause!r}")
                err.__cause__ = cause
                stream.put_threadsafe(err)

"""``EngineProcess``: the ``LLMEngine`` in a process of its own, driven through two one-way pipes (commands in,
outputs out), so that the API server's
event loop (sockets, SSE, JSON) never holds the GIL the engine's host work needs (vLLM V1 splits its API server
from its engine core for the same reason).

The parent (``EngineProcess``) stands in for an ``LLMEngine`` on ``AsyncLLMEngine``'s engine thread: the same
``add_request`` / ``abort_request`` / ``step`` / ``has_unfinished_requests`` / ``get_stats`` and the read-only
``tokenizer``, ``max_model_len``, ``vocab_size``, ``default_sampling``, ``grammar_compiler()``. It tokenizes and
checks each request itself (``llm_engine.prompt_token_ids``), so a bad request is refused at once, as in process,
and only token ids cross the pipe.

The child (:func:`_serve`) loads the ``LLMEngine``, then loops: apply the commands that arrived (add, abort), run a
step while any request is unfinished, and send that step's outputs, one message per step, without waiting for the
parent to read them (the pipe's buffer is the only back-pressure). Right after a failed step it runs the next step
before it applies any command (:func:`_drop`). So the parent's ``step`` reads the next message;
the two agree on which requests are unfinished because every request the child holds ends in an output it sends
(finished, aborted or failed).

Outputs cross as deltas (:class:`_Encoder` / :class:`_Decoder`): per choice the new token ids and logprobs, and the
text as (characters kept, characters added), since a stop string may take back text already sent; the parent
rebuilds the same cumulative ``RequestOutput`` the engine made. Exceptions cross as themselves when they pickle
(a ``ValueError`` that does not becomes a ``ValueError`` of its message, anything else a ``RuntimeError``).

The child exits when the parent closes the pipe or dies (it reads end-of-file), ignores SIGINT (a terminal's
Ctrl-C reaches the whole process group; the parent stops it) and, once serving, SIGTERM (``systemctl stop``
signals the whole group; the parent's graceful shutdown needs the child to finish the running requests, then stops
it: :meth:`EngineProcess.close`, or :meth:`EngineProcess.kill` for one stuck in a step, also at the parent's exit).
A structured request's grammar is compiled again in the child, on its command reader's thread (the parent's
compiled grammar does not cross the pipe). :meth:`EngineProcess.sleep` stops the child of an idle engine (its GPU
memory freed; ``AsyncLLMEngine``'s ``sleep_after_idle_s``) and the next ``add_request`` starts it again.
"""
from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineBroken, EngineWakeFailed, StepFailed
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats, TokenHistogram

logger = logging.getLogger(__name__)

#: seconds ``close`` waits for the child to exit after "stop" before it is killed
STOP_WAIT_S = 10.0
#: seconds a sleeping engine's wake may take to load the model (a stuck CUDA start, say) before it is given up
WAKE_TIMEOUT_S = 600.0
#: seconds after a failed wake during which requests get its error at once (the HTTP 503's Retry-After)
WAKE_RETRY_S = 10.0
#: ``EngineStats``' cumulative counters (and histogram): a woken engine's child counts from 0, the parent adds what
#: came before
_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
             "prefix_cache_hits_total", "iteration_tokens")


class EngineProcessDied(EngineBroken):
    """The engine's process exited (a crash, the OOM killer) or its pipe broke; nothing it held can be served."""


@dataclass(frozen=True)
class EngineInfo:
    """What the child's loaded ``LLMEngine`` tells the parent once, with "ready"."""

    model_name: str
    max_model_len: int  # tokens
    vocab_size: int  # token ids a request may name
    model_vocab_size: int  # rows of the model's logits (the grammar masks' width)
    eos_token_ids: tuple[int, ...]
    default_sampling: dict


def wanted(config: EngineConfig) -> bool:
    """The default: a process of its own on CUDA (``device`` "cuda" or "cuda:N", or "auto" where the engine takes
    the GPU: ``model_runner.resolve_device``'s rule), the engine thread on the CPU (where the two processes would
    share the same few cores anyway)."""
    if config.device != "auto":
        return config.device.startswith("cuda")
    from engine.model_runner import resolve_device  # the parent imports it anyway (prompt_token_ids' module)
    return resolve_device("auto").type == "cuda"


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives a pickle round trip, else a ValueError (a request's fault, a 400) or RuntimeError of its
    type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not round-trip is replaced
        kind = ValueError if isinstance(e, ValueError) else RuntimeError
        return kind(f"{type(e).__name__}: {e}")


# ---- outputs as deltas ---------------------------------------------------------------------------------------------
#: one choice of a delta: (index, new token ids, new logprobs or None, text characters kept, text added,
#: finish_reason, stop_reason, (new logprob ranks, cumulative logprob) or None)
ChoiceDelta = tuple[int, list[int], list | None, int, str, str | None, Any, tuple | None]


class _Encoder:
    """Child side: what each request's outputs added since the last one sent. Invariant: ``_sent`` holds exactly the
    requests that had an output sent and no finished one (nor a failure)."""

    def __init__(self) -> None:
        self._sent: dict[str, list[tuple[int, int, str]]] = {}  # id -> per choice (ids sent, logprobs sent, text)
        self._prompt_lp_sent: set[str] = set()

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        deltas = []
        for out in outputs:
            prev = self._sent.get(out.request_id) or [(0, 0, "")] * len(out.outputs)
            choices, state = [], []
            for c, (n_ids, n_lp, text) in zip(out.outputs, prev):
                # a stop string may take back text sent; commonprefix loops in Python over every character, so
                # only then (as the only path it cost 19.6 ms a step here at 256 outputs of 2,000 characters)
                keep = len(text) if c.text.startswith(text) else len(os.path.commonprefix((text, c.text)))
                lps = None if c.logprobs is None else c.logprobs[n_lp:]
                ranks = None if c.logprob_ranks is None else (c.logprob_ranks[n_lp:], c.cumulative_logprob)
                choices.append((c.index, c.token_ids[n_ids:], lps, keep, c.text[keep:], c.finish_reason,
                                c.stop_reason, ranks))
                state.append((len(c.token_ids), len(c.logprobs or ()), c.text))
            prompt_lp = None
            if out.prompt_logprobs is not None and out.request_id not in self._prompt_lp_sent:
                prompt_lp = (out.prompt_logprobs, out.prompt_logprob_ranks)
                self._prompt_lp_sent.add(out.request_id)
            if out.finished:
                self.forget(out.request_id)
            else:
                self._sent[out.request_id] = state
            deltas.append((out.request_id, choices, out.finished, out.metrics, out.num_cached_tokens, prompt_lp))
        return deltas

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._prompt_lp_sent.discard(request_id)


@dataclass
class _Held:
    """Parent side: one request as the child's outputs built it so far."""

    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[CompletionOutput] | None = None
    prompt_logprobs: list | None = None
    prompt_logprob_ranks: list | None = None


class _Decoder:
    """Parent side: rebuilds each cumulative ``RequestOutput`` from its delta (new lists each time: an output
    handed out is never changed afterwards). Invariant: ``held`` holds the requests added and not yet finished or
    failed."""

    def __init__(self) -> None:
        self.held: dict[str, _Held] = {}

    def add(self, request_id: str, prompt: str | None, ids: list[int]) -> None:
        self.held[request_id] = _Held(prompt, ids)

    def decode(self, deltas: list[tuple]) -> list[RequestOutput]:
        outputs = []
        for request_id, choices, finished, metrics, num_cached, prompt_lp in deltas:
            held = self.held.get(request_id)
            if held is None:  # a request the parent gave up (a failed step): its last output reaches nobody
                continue
            prev = held.choices or [CompletionOutput(i, "", [], logprobs=None) for i in range(len(choices))]
            held.choices = [
                CompletionOutput(index, p.text[:keep] + added, p.token_ids + ids,
                                 finish, stop, None if lps is None else (p.logprobs or []) + lps,
                                 None if ranks is None else ranks[1],
                                 None if ranks is None else (p.logprob_ranks or []) + ranks[0])
                for p, (index, ids, lps, keep, added, finish, stop, ranks) in zip(prev, choices)]
            if prompt_lp is not None:
                held.prompt_logprobs, held.prompt_logprob_ranks = prompt_lp
            if finished:
                del self.held[request_id]
            outputs.append(RequestOutput(request_id, held.prompt, held.prompt_token_ids, held.choices, finished,
                                         metrics, num_cached, held.prompt_logprobs, held.prompt_logprob_ranks))
        return outputs


# ---- the child -----------------------------------------------------------------------------------------------------
def _serve(config: EngineConfig, commands: Connection, conn: Connection, log_level: int) -> None:
    """The child's main: load, say "ready" (or "failed") on ``conn``, then apply the commands that arrived on
    ``commands`` and step until "stop" or end-of-file. Messages to the parent: ("ready", EngineInfo, EngineStats),
    ("failed", exception), ("step", deltas, EngineStats), ("step_failed", request ids, cause, request_error, deltas,
    EngineStats).

    Commands are read by a thread of their own (:func:`_read_commands`) into a queue, so the parent's sends never
    wait for this loop: a child blocked sending outputs (the parent busy, the pipe full) and a parent blocked
    sending an add would otherwise wait for each other forever (seen on an H200 at 16 concurrent streams)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable()  # a crash in native code (a driver, a kernel) leaves its Python stack in the log
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - the parent reports it (a bad folder, too little memory)
        logger.exception("engine failed to load")
        conn.send(("failed", _portable(e)))
        return
    info = EngineInfo(engine.model_name, engine.max_model_len, engine.vocab_size,
                      engine.runner.model.config["vocab_size"], tuple(sorted(engine.eos_token_ids)),
                      engine.default_sampling)
    # Serving, it stops when the parent says so or goes (end-of-file), never on the SIGTERM that `systemctl stop`
    # sends the whole group: the parent's graceful shutdown needs it to finish the running requests, and a child
    # gone first would read as an engine death (the server's exit status 1). Loading, SIGTERM ends it at once.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_commands, args=(commands, inbox, engine), name="engine-commands",
                     daemon=True).start()
    conn.send(("ready", info, engine.get_stats()))
    encoder = _Encoder()
    failed: set[str] = set()  # requests whose step just failed: outputs of theirs made before it are dropped
    try:
        while True:
            if not engine.has_unfinished_requests():
                failed.clear()
                period = engine.idle_look_s
                try:
                    cmd = inbox.get(timeout=period)  # None: block until a command comes
                except queue.Empty:
                    cmd = None
                if period is not None:
                    engine.idle()  # the CPU path's thread count follows the other processes' load meanwhile
                if cmd is None:
                    continue
                if not _apply(engine, cmd, conn, encoder):
                    return
            while not failed and not inbox.empty():  # none right after a failed step: see below
                if not _apply(engine, inbox.get(), conn, encoder):
                    return
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except StepFailed as e:
                    failed.update(e.request_ids)
                    for request_id in e.request_ids:
                        encoder.forget(request_id)
                    conn.send(("step_failed", e.request_ids, _portable(e.cause), e.request_error,
                               encoder.encode(_drop(e.outputs, failed)), engine.get_stats()))
                    continue
                conn.send(("step", encoder.encode(_drop(outputs, failed)), engine.get_stats()))
                failed.clear()
    except (BrokenPipeError, ConnectionResetError):
        logger.warning("the server closed the engine's pipe without a stop; the engine process exits")


def _drop(outputs: list[RequestOutput], failed: set[str]) -> list[RequestOutput]:
    """``outputs`` less those of the requests in ``failed``. After a failed step the engine may hold outputs made
    before it (``LLMEngine.step``: delivered by the next call), among them some of the failed requests; the parent
    gave those up, and a new request could take their id before they arrived and be sent them. So the child runs
    the next step before it applies any command (no new request can hold such an id yet) and drops them here."""
    return [o for o in outputs if o.request_id not in failed] if failed else outputs


def _read_commands(commands: Connection, inbox: queue.SimpleQueue, engine: Any) -> None:
    """The child's command reader: every command from the parent onto ``inbox`` as it arrives; ("stop",) when the
    parent closed its end or died (end-of-file), or when this thread fails (the child then exits and the parent
    finds the engine dead, instead of a main loop that waits for commands forever). A structured request's grammar
    is compiled here, before its add is queued (xgrammar releases the GIL while it compiles): on the main loop
    every running request would wait for the whole compile. Commands behind an add wait for its compile (an abort
    too; compiles are cached per schema). An add carries its compiled grammar, or the exception the compile raised,
    last."""
    try:
        while True:
            cmd = commands.recv()
            if cmd[0] == "add" and cmd[3].structured_outputs is not None:
                try:
                    grammar = engine.grammar_compiler().compile(cmd[3].structured_outputs)
                except BaseException as e:  # noqa: BLE001 - the request's fault: _apply fails it alone
                    grammar = e if isinstance(e, Exception) else RuntimeError(f"grammar compile: {e!r}")
                cmd = (*cmd, grammar)
            inbox.put(cmd)
    except (EOFError, OSError):
        logger.warning("the server closed the engine's command pipe")
        inbox.put(("stop",))
    except BaseException:  # noqa: BLE001 - a command that does not unpickle, say: stop rather than hang
        logger.exception("the engine's command reader failed; the engine process stops")
        inbox.put(("stop",))


def _apply(engine: Any, cmd: tuple, conn: Connection, encoder: _Encoder) -> bool:
    """One command from the parent; False for "stop". An add the engine refuses after the parent's checks (a
    grammar it cannot build, say) fails that request alone, as a step would."""
    if cmd[0] == "add":
        _, request_id, ids, params, arrival, *grammar = cmd  # a structured request's grammar: _read_commands
        grammar = grammar[0] if grammar else None
        try:
            if isinstance(grammar, Exception):
                raise grammar
            engine.add_request(request_id, ids, params, arrival_time=arrival, grammar=grammar)
        except Exception as e:  # noqa: BLE001 - the request's own fault: it fails, the engine goes on
            conn.send(("step_failed", [request_id], _portable(e), True, [], engine.get_stats()))
    elif cmd[0] == "abort":
        engine.abort_request(cmd[1])
    elif cmd[0] == "stop":
        return False
    return True


# ---- the parent ----------------------------------------------------------------------------------------------------
#: the engine processes started and not known to be gone (weakly: a closed one is collected)
_LIVE: weakref.WeakSet = weakref.WeakSet()
_KILL_REGISTERED = False


def _kill_at_exit() -> None:
    """At this process's exit, kill the engine processes still running. Registered after multiprocessing's own exit
    handler (which sends its daemonic children SIGTERM, which a serving child ignores, then joins them without a
    limit), so it runs first: an exit never hangs on a child stuck in a step, nor leaves it orphaned."""
    global _KILL_REGISTERED
    if not _KILL_REGISTERED:
        atexit.register(lambda: [proc.kill() for proc in list(_LIVE)])
        _KILL_REGISTERED = True


class EngineProcess:
    """An ``LLMEngine`` running in a spawned child process; see the module docstring. Call from one thread only
    (``AsyncLLMEngine``'s engine thread), except the read-only attributes and ``grammar_compiler``.

    Building it starts the child and waits for the model load: raises what ``LLMEngine(config)`` raised there
    (``FileNotFoundError``, ``ValueError``, ...), or ``EngineProcessDied`` when the child exited first.
    """

    #: what the child runs (``_serve``; a test may swap in another module-level function)
    _child_main = staticmethod(_serve)
    #: seconds between the caller's idle looks: each checks that the child is alive (it judges the CPU thread count
    #: itself, ``_serve``), so a child that died while the server waited (the OOM killer) shows on /health at once
    idle_look_s = 1.0

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer
        self.config = config
        self._asleep = self._stopping = self._waking = False
        self._wake_failure: tuple[float, str] = (float("-inf"), "")  # (monotonic time, error) of the last failed wake
        self._carried: dict[str, int | TokenHistogram] = {}  # the counters of the children before this one (sleep)
        self._decoder = _Decoder()
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self._start()
        tokenizer_error = None
        try:
            try:  # while the child loads; the child's own error comes first (it checks the folder)
                self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
            except Exception as e:  # noqa: BLE001 - raised below unless the child says why first
                tokenizer_error = e
            msg = self._recv()
        except BaseException:
            self.close()
            raise
        if msg[0] == "failed" or tokenizer_error is not None:
            self.close()
            raise msg[1] if msg[0] == "failed" else tokenizer_error
        self._ready(msg)

    def _start(self) -> None:
        """Spawn the child, which loads the engine and then says "ready" (or "failed")."""
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        # two one-way pipes: commands to the child, outputs from it (see ``_serve`` for why not one)
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._conn, outputs_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=self._child_main, name="llm-engine-core", daemon=True,
                                    args=(self.config, commands_in, outputs_out,
                                          logging.getLogger().getEffectiveLevel()))
        self._process.start()
        _LIVE.add(self)
        _kill_at_exit()
        commands_in.close()  # the child's ends live in the child only: its exit shows here as end-of-file
        outputs_out.close()

    def _ready(self, msg: tuple) -> None:
        """Take in the child's "ready" message: what the loaded engine tells (``EngineInfo``) and its first
        snapshot, which is also what a sleeping engine reports (every block free)."""
        _, info, stats = msg
        self._stats = self._fresh_stats = self._counted(stats)
        self.info: EngineInfo = info
        self.model_name, self.max_model_len, self.vocab_size = info.model_name, info.max_model_len, info.vocab_size
        self.default_sampling = info.default_sampling
        logger.info("engine process %d ready", self._process.pid)

    @property
    def pid(self) -> int | None:
        """The child's process id; None while asleep."""
        return None if self._asleep else self._process.pid

    @property
    def asleep(self) -> bool:
        """Whether the child is stopped by :meth:`sleep` (the next request starts it again)."""
        return self._asleep

    @property
    def waking(self) -> bool:
        """Whether a request is waking the engine: asleep still, the child loading (its snapshot counts that
        request as waiting)."""
        return self._waking

    def sleep(self) -> None:
        """Stop the child, which frees all its memory (the GPU's: weights, KV cache, CUDA graphs), and keep what
        this side holds (tokenizer, ``EngineInfo``): the next ``add_request`` loads the engine again (as long as a
        start; as Ollama's ``keep_alive`` unloads a model). Only with no request held (``ValueError`` otherwise);
        idempotent. The prefix cache is lost with the child."""
        if self._asleep:
            return
        if self._decoder.held:
            raise ValueError(f"sleep: {len(self._decoder.held)} requests are running")
        self.close()
        self._carried = {name: getattr(self._stats, name) for name in _COUNTERS}  # the next child counts from 0
        self._asleep, self._stats = True, self._counted(self._fresh_stats, fresh=True)
        logger.info("engine asleep: its process stopped, its GPU memory freed; the next request loads it again")

    def _wake(self) -> None:
        """Start the child again after :meth:`sleep` and wait for its load (at most ``WAKE_TIMEOUT_S``). Raises
        ``EngineWakeFailed`` when the load fails, the child dies first or does not load in time, the spawn fails,
        or the engine is being killed (:meth:`kill`), and stays asleep: the next request tries again, or, within
        ``WAKE_RETRY_S`` of a failure, gets that failure at once (requests queued behind a failed wake do not
        each wait for a load of their own)."""
        if self._stopping:
            raise EngineWakeFailed("the engine is stopping")
        failed_at, error = self._wake_failure
        if time.monotonic() - failed_at < WAKE_RETRY_S:
            raise EngineWakeFailed(f"{error} ({time.monotonic() - failed_at:.1f} s ago; not tried again yet)")
        start, asleep_stats = time.monotonic(), self._stats
        # the request that wakes it waits (those queued behind it are not seen here)
        self._waking, self._stats = True, dataclasses.replace(asleep_stats, num_waiting=1)
        try:
            self._start()
            if self._stopping:  # a kill() that came while the child started, before it could see the child
                raise EngineWakeFailed("the engine is stopping")
            if not self._conn.poll(WAKE_TIMEOUT_S):
                raise EngineWakeFailed(f"the engine process did not load the model in {WAKE_TIMEOUT_S:.0f} s")
            msg = self._recv()
            if msg[0] == "failed":
                raise EngineWakeFailed(f"loading the model again failed: {type(msg[1]).__name__}: {msg[1]}")
        except BaseException as e:
            self._waking, self._stats = False, asleep_stats
            self._kill_child()
            self.close()
            if not isinstance(e, (EngineWakeFailed, EngineProcessDied, OSError)):
                raise
            error = e if isinstance(e, EngineWakeFailed) else EngineWakeFailed(
                f"the engine process did not start again: {type(e).__name__}: {e}")
            self._wake_failure = (time.monotonic(), str(error))
            raise error from (None if error is e else e)
        self._ready(msg)
        self._asleep = self._waking = False
        logger.info("engine awake in %.1f s", time.monotonic() - start)

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise self._died(e) from e

    def _send(self, cmd: tuple) -> None:
        try:
            self._commands.send(cmd)
        except OSError as e:
            raise self._died(e) from e

    def _died(self, e: BaseException) -> EngineProcessDied:
        self._process.join(1.0)
        code = self._process.exitcode
        how = "is still running" if code is None else f"exited (exit code {code})"
        return EngineProcessDied(f"the engine process {how}; its pipe: {type(e).__name__}: {e}")

    # ---- what LLMEngine offers ----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, grammar: Any = None) -> None:
        """Check and queue a request (``LLMEngine.add_request``'s errors, raised here at once; ``EngineWakeFailed``
        where it wakes a sleeping engine that cannot load); ``grammar`` is not sent (the child compiles its own)."""
        from engine.llm_engine import prompt_token_ids
        if request_id in self._decoder.held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = prompt_token_ids(self.tokenizer, self.vocab_size, self.max_model_len, prompt, params)
        if self._asleep:  # a request the engine would take: load it again (EngineWakeFailed if that fails)
            self._wake()
        self._send(("add", request_id, ids, params, arrival_time or time.monotonic()))
        self._decoder.add(request_id, prompt if isinstance(prompt, str) else None, ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its "abort" output comes with a later ``step`` (as ``LLMEngine.abort_request``)."""
        if request_id in self._decoder.held:
            self._send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._decoder.held)

    def step(self) -> list[RequestOutput]:
        """The outputs of the child's next step (blocks until it sent them). Raises StepFailed as
        ``LLMEngine.step`` does, and ``EngineProcessDied``."""
        msg = self._recv()
        if msg[0] == "step":
            _, deltas, stats = msg
            self._stats = self._counted(stats)
            return self._decoder.decode(deltas)
        _, request_ids, cause, request_error, deltas, stats = msg
        self._stats = self._counted(stats)
        for request_id in request_ids:
            self._decoder.held.pop(request_id, None)
        raise StepFailed(request_ids, cause, self._decoder.decode(deltas), request_error=request_error)

    def get_stats(self) -> EngineStats:
        """The child's snapshot after its latest step read here (asleep: all blocks free), its counters counting
        on over sleeps; every request held here and not running in it is waiting (the requests sent since it was
        taken are in no snapshot yet: the child takes them between its steps)."""
        stats = self._stats
        if self._asleep or self._waking:
            return stats
        waiting = max(stats.num_waiting, len(self._decoder.held) - stats.num_running)
        return stats if waiting == stats.num_waiting else dataclasses.replace(stats, num_waiting=waiting)

    def _counted(self, stats: EngineStats, fresh: bool = False) -> EngineStats:
        """``stats`` with the counters of the children before this one added (a counter never goes back); with
        ``fresh``, ``stats`` is a first snapshot whose counters are replaced by the totals so far."""
        if not self._carried:
            return stats
        return dataclasses.replace(stats, **{name: self._carried[name] if fresh else
                                             self._carried[name] + getattr(stats, name) for name in _COUNTERS})

    def idle(self) -> None:
        """Raises ``EngineProcessDied`` when the child has exited (it takes its own idle looks), unless asleep."""
        if not self._asleep and not self._process.is_alive():
            raise self._died(RuntimeError("found dead while the server waited"))

    def grammar_compiler(self):
        """A grammar compiler over this tokenizer, built at the first call (``LLMEngine.grammar_compiler``): the
        async engine compiles a structured request's grammar with it first, so that a schema it cannot follow is
        refused before the request is queued."""
        from engine.structured_output import GrammarCompiler
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.info.model_vocab_size,
                                                 list(self.info.eos_token_ids))
            return self._grammars

    def kill(self) -> None:
        """Kill the child at once (SIGKILL) and reap it: for one stuck in a step, which a stop command never
        reaches. Its end of the outputs pipe closes, so a thread blocked reading it gets end-of-file. An engine
        asleep is not woken after this (``EngineWakeFailed``)."""
        self._stopping = True  # set before the look at the child: _wake looks at it after its start
        self._kill_child()

    def _kill_child(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5.0)

    def close(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the child (after its current step) and wait for it; killed after ``timeout`` s (serving, it ignores
        SIGTERM). Idempotent."""
        if self._process.is_alive():
            try:
                self._commands.send(("stop",))
            except OSError:
                pass
            self._conn.close()  # a child blocked sending a step's outputs (nobody reads them now) gets a broken pipe
            self._process.join(timeout)
            if self._process.is_alive():
                logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
                self._process.kill()
                self._process.join(5.0)
        self._commands.close()
        self._conn.close()

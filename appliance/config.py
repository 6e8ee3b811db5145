"""The appliance's TOML configuration and where its files live.

Paths (design.md §1):

* config: ``/etc/appliance/config.toml`` for the system service, else ``$XDG_CONFIG_HOME/appliance/config.toml``
  (default ``~/.config``); ``$APPLIANCE_CONFIG`` names another file.
* data (quantized models, pid and log files of the background server): ``/var/lib/appliance`` for the system
  service, else ``$XDG_DATA_HOME/appliance`` (default ``~/.local/share``); ``$APPLIANCE_DATA_DIR`` overrides.

Every key of the file can be overridden by an ``APPLIANCE_<KEY>`` environment variable (``APPLIANCE_PORT=9000``);
the systemd unit reads such variables from an ``EnvironmentFile``. The file is written under a temporary name in
the same folder and renamed over the old one, so a reader never sees half a file.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

import tomli_w

from appliance.errors import ApplianceError
from engine.async_engine import DEFAULT_MAX_WAITING
from engine.server.cors import LOCAL_ORIGINS

SYSTEM_CONFIG = Path("/etc/appliance/config.toml")
SYSTEM_DATA_DIR = Path("/var/lib/appliance")
ENV_PREFIX = "APPLIANCE_"


class ConfigError(ApplianceError):
    """The config file or an ``APPLIANCE_*`` variable holds something unusable."""


@dataclass
class Config:
    """What ``appliance serve`` runs, as written by ``appliance install``.

    ``model`` is the folder the engine loads (the quantized checkpoint); ``source_model`` and ``quantization``
    record where it came from. ``None`` values are left out of the file (TOML has no null).
    """

    model: str | None = None
    served_model_name: str | None = None
    source_model: str | None = None
    quantization: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # tokens one step computes (chunked prefill); none: 2048, vLLM's
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"  # compute dtype: auto (on a GPU the checkpoint's 16-bit dtype, else bfloat16; float32 on a
    # CPU), float32, bfloat16, float16
    swap_space: float = 0.0
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued beyond max_num_seqs before new ones get 503
    tune_kernels: bool = True  # measure the W4A16 kernel plans on this GPU at the first start (engine/kernel_plans.py)
    tool_call_parser: str = "auto"  # tool_choice "auto": hermes, mistral, llama3_json, none, or auto (the template)
    reasoning_parser: str = "auto"  # <think> blocks as reasoning: deepseek_r1, qwen3, none, or auto (the template)
    allowed_origins: str = LOCAL_ORIGINS  # web pages that may call the API from a browser (engine/server/cors.py)
    keep_alive_on_engine_death: bool = False  # an engine that dies while serving: keep answering 503 instead of
    # exiting with status 1 for systemd to restart the server (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)
    sleep_after_idle_s: float | None = None  # seconds without requests after which a GPU engine frees the GPU's
    # memory (its process stops) until the next request loads it again, as Ollama's keep_alive; none: never
    data_dir: str | None = None

    def engine_config(self):
        """The ``engine.config.EngineConfig`` these settings describe."""
        from engine.config import EngineConfig

        if not self.model:
            raise ConfigError("no model is configured",
                              "run `appliance install` or pass MODEL_DIR to `appliance serve`")
        try:
            return EngineConfig(
                model=self.model,
                served_model_name=self.served_model_name,
                device=self.device,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=self.max_num_batched_tokens,
                kv_cache_dtype=self.kv_cache_dtype,
                dtype=self.dtype,
                swap_space=self.swap_space,
                tune_kernels=self.tune_kernels,
                kernel_plans_dir=str(Path(self.data_dir) / "kernel-plans") if self.data_dir else None,
            )
        except ValueError as exc:  # the engine's messages start with the key: "max_num_seqs: must be ..."
            raise ConfigError(f"invalid setting: {exc}", fix_hint(str(exc).split(":", 1)[0])) from None


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
#: the keys `appliance serve` also takes as a flag: --max-num-seqs, ...
_FLAGS = {**{key: "--" + key.replace("_", "-") for key in (
    "host", "port", "api_key", "device", "dtype", "gpu_memory_utilization", "kv_cache_dtype", "max_model_len",
    "max_num_batched_tokens", "max_num_seqs", "swap_space", "max_waiting", "tool_call_parser", "reasoning_parser",
    "allowed_origins")}, "sleep_after_idle_s": "--sleep-after-idle"}


def fix_hint(key: str) -> str:
    """Where ``key``'s value comes from, to change it: the config file, its APPLIANCE_* variable, its flag if any."""
    if key not in _FIELDS:
        return "change it in the config file, its APPLIANCE_* variable or the command's flag"
    flag = f" or `appliance serve {_FLAGS[key]}`" if key in _FLAGS else ""
    return f"change {key} in the config file, {ENV_PREFIX}{key.upper()}{flag}"


# The declared type of each key, without "| None" (annotations are strings under `from __future__ import annotations`).
_TYPES = {name: f.type.replace(" | None", "") for name, f in _FIELDS.items()}
_OPTIONAL = {name for name, f in _FIELDS.items() if "None" in f.type}


def _home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def user_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(_home() / ".config")
    return Path(base) / "appliance" / "config.toml"


def config_path(system: bool | None = None) -> Path:
    """The config file to use.

    ``system=True``/``False`` picks the system-wide or the per-user file. ``None`` (reading) means:
    ``$APPLIANCE_CONFIG`` if set, else the per-user file if it exists, else the system-wide one if it exists,
    else the per-user path.
    """
    if os.environ.get("APPLIANCE_CONFIG"):
        return Path(os.environ["APPLIANCE_CONFIG"])
    if system is True:
        return SYSTEM_CONFIG
    user = user_config_path()
    if system is False or user.is_file() or not SYSTEM_CONFIG.is_file():
        return user
    return SYSTEM_CONFIG


def data_dir(system: bool = False) -> Path:
    """Where models and state live: ``$APPLIANCE_DATA_DIR``, else /var/lib/appliance or $XDG_DATA_HOME/appliance."""
    if os.environ.get("APPLIANCE_DATA_DIR"):
        return Path(os.environ["APPLIANCE_DATA_DIR"])
    if system:
        return SYSTEM_DATA_DIR
    base = os.environ.get("XDG_DATA_HOME") or str(_home() / ".local" / "share")
    return Path(base) / "appliance"


def _coerce(key: str, value: Any, origin: str) -> Any:
    """Check (TOML) or convert (environment strings) one value to the type of ``key``."""
    kind = _TYPES[key]
    if isinstance(value, str) and kind != "str":
        text = value.strip()
        if text.lower() in ("", "none", "null") and key in _OPTIONAL:
            return None
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{origin}: expected true or false, got {value!r}", "set it to true or false")
        try:
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
        except ValueError:
            raise ConfigError(f"{origin}: expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}",
                              f"set it to a valid {kind}") from None
    if kind == "str" and isinstance(value, str):
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{origin}: expected {kind}, got {value!r}", f"set it to a valid {kind}")


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``APPLIANCE_<KEY>`` variables that name a config key, converted to the key's type."""
    environ = os.environ if environ is None else environ
    out = {}
    for key in _FIELDS:
        name = ENV_PREFIX + key.upper()
        if name in environ:
            out[key] = _coerce(key, environ[name], name)
    return out


def load(path: Path | str | None = None, env: bool = True) -> Config:
    """Read the config file (a missing file gives the defaults), then apply the environment overrides."""
    path = Path(path) if path is not None else config_path()
    values: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}", f"fix or delete {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}", "check its permissions") from None
        for key, value in raw.items():
            if key not in _FIELDS:
                raise ConfigError(f"{path}: unknown key {key!r}", f"remove it; known keys: {', '.join(_FIELDS)}")
            values[key] = _coerce(key, value, f"{path}: {key}")
    if env:
        values.update(env_overrides())
    return Config(**values)


def save(config: Config, path: Path | str | None = None) -> Path:
    """Write ``config`` as TOML atomically (temporary file in the same folder, then rename); return the path."""
    path = Path(path) if path is not None else config_path()
    data = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    text = ("# edge-appliance configuration, written by `appliance install`.\n"
            "# Every key can be overridden by an APPLIANCE_<KEY> environment variable (APPLIANCE_PORT=9000).\n\n"
            + tomli_w.dumps(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600 if config.api_key else 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path

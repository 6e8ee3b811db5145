"""``python -m engine.server --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--max-waiting N]
[--tool-call-parser auto|hermes|llama3_json|none] [--reasoning-parser auto|deepseek_r1|qwen3|none]
[--[no-]engine-process] [--keep-alive-on-engine-death] [--sleep-after-idle SECONDS] [engine options]``.

Every ``EngineConfig`` field is an option (``--max-model-len 2048``, ``--enforce-eager``, ...).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from engine.async_engine import DEFAULT_MAX_WAITING
from engine.config import EngineConfig, field_docs
from engine.server import reasoning, tool_parsers
from engine.server.api_server import run_server
from engine.server.cors import LOCAL_ORIGINS, origin_regex


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--<field>`` for each ``EngineConfig`` field, typed from its annotation. Bools are flags with a
    ``--no-<field>`` form, as vLLM's (``--no-enable-prefix-caching``), so a default of True can be turned off."""
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        text = docs.get(f.name, "").replace("``", "").replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            parser.add_argument(flag, type=kind, required=f.default is dataclasses.MISSING,
                                default=None if f.default is dataclasses.MISSING else f.default, help=text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.server", description="OpenAI-compatible server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                        help="requests queued beyond --max-num-seqs before new ones get 503 with Retry-After")
    parser.add_argument("--tool-call-parser", default="auto", choices=tool_parsers.SETTINGS,
                        help='tool_choice "auto": hermes (<tool_call> blocks), mistral ([TOOL_CALLS]), llama3_json, '
                             "none, or auto (by the model's chat template)")
    parser.add_argument("--reasoning-parser", default="auto", choices=reasoning.SETTINGS,
                        help="chat answers' <think> blocks as their reasoning: deepseek_r1 or qwen3 (the same "
                             "split), none, or auto (when the model's chat template writes <think>)")
    parser.add_argument("--allowed-origins", default=LOCAL_ORIGINS,
                        help="web pages that may call the API from a browser: origins, comma-separated or a JSON "
                             "list, * a wildcard ('*' any page, '' none; default: localhost pages)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in a process of its own, apart from the HTTP server's event loop "
                             "(default: on CUDA, not on the CPU)")
    parser.add_argument("--keep-alive-on-engine-death", action="store_true",
                        help="an engine that dies while serving: keep the server up answering 503 (default: exit "
                             "with status 1 so that a service manager restarts it, as vLLM)")
    parser.add_argument("--sleep-after-idle", type=float, default=None, metavar="SECONDS",
                        help="seconds without requests after which an engine in a process of its own frees the "
                             "GPU's memory until the next request (as Ollama's keep_alive; default: never)")
    _engine_options(parser)
    args = vars(parser.parse_args(argv))
    host, port, api_key, log_level, max_waiting, parser_name, reasoning_name, origins, own_process, keep_alive = (
        args.pop(k) for k in ("host", "port", "api_key", "log_level", "max_waiting", "tool_call_parser",
                              "reasoning_parser", "allowed_origins", "engine_process", "keep_alive_on_engine_death"))
    sleep_after_idle = args.pop("sleep_after_idle")
    try:
        origin_regex(origins)
    except ValueError as exc:
        parser.error(str(exc))
    if sleep_after_idle is not None and not sleep_after_idle >= 0:
        parser.error(f"--sleep-after-idle: must be at least 0 seconds, got {sleep_after_idle}")
    run_server(EngineConfig(**args), host=host, port=port, api_key=api_key, log_level=log_level,
               max_waiting=max_waiting, tool_call_parser=parser_name, reasoning_parser=reasoning_name,
               engine_process=own_process, allowed_origins=origins, keep_alive_on_engine_death=keep_alive,
               sleep_after_idle_s=sleep_after_idle)


if __name__ == "__main__":
    main()

"""Which web pages may call the API from a browser (CORS, the Fetch standard's cross-origin rules).

A page's script may read this server's answers only when the answer names the page's origin in
``Access-Control-Allow-Origin`` (and a POST with a JSON body is sent only after a preflight ``OPTIONS`` says so).
The setting is a list of origins, comma-separated (Ollama's ``OLLAMA_ORIGINS`` form) or a JSON list (vLLM's
``--allowed-origins``); ``*`` matches a run of letters, digits, dots and hyphens (a host name's characters:
``https://*.example.com`` cannot match ``https://evil.com#.example.com``), a trailing ``:*`` any port or none,
and ``*`` alone every origin. The default, :data:`LOCAL_ORIGINS`, lets in pages whose origin is localhost,
127.0.0.1 or [::1] (a chat UI on ``http://localhost:3000``; for a browser on another machine that is its own
host) and no others, as Ollama does: any web site would otherwise be able to use the model through the visitor's
browser. ``"*"`` lets every page in (vLLM's default); ``""`` sends no CORS headers at all.
"""
from __future__ import annotations

import json
import re

#: pages served from this machine, on any port
LOCAL_ORIGINS = ",".join(f"{scheme}://{host}:*" for scheme in ("http", "https")
                         for host in ("localhost", "127.0.0.1", "[::1]"))


def origin_patterns(setting: str) -> list[str]:
    """The origin patterns of ``setting`` (see the module doc), stripped, empty ones dropped.

    Raises ValueError for a JSON list that does not parse or holds something other than strings."""
    text = setting.strip()
    if not text.startswith("["):
        return [p.strip() for p in text.split(",") if p.strip()]
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"allowed_origins: not a JSON list of origins ({exc})") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError("allowed_origins: a JSON list must hold origins as strings, e.g. [\"http://localhost:3000\"]")
    return [i.strip() for i in items if i.strip()]


def origin_regex(setting: str) -> str | None:
    """A regular expression matching exactly the origins ``setting`` allows (anchored at the end too, so a plain
    ``re.match`` is as strict as Starlette's ``fullmatch``), or None when it allows none (then the server sends no
    CORS headers). Raises ValueError as :func:`origin_patterns`."""
    alternatives = []
    for pattern in origin_patterns(setting):
        if pattern == "*":
            alternatives.append(".*")
            continue
        port = pattern.endswith(":*")
        parts = (pattern[:-2] if port else pattern).split("*")
        alternatives.append("[A-Za-z0-9.-]*".join(re.escape(p) for p in parts) + (r"(:[0-9]+)?" if port else ""))
    return "(?:" + "|".join(f"(?:{a})" for a in alternatives) + r")\Z" if alternatives else None

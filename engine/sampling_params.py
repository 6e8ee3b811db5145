"""Sampling parameters of one request, with vLLM's fields and defaults.

Source: vLLM ``SamplingParams`` (vllm/sampling_params.py); OpenAI API reference for the HTTP names.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import operator
from dataclasses import dataclass, field

@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's ``StructuredOutputsParams``), exactly one of: ``json``, a JSON schema (dict or
    JSON text) the output must match; ``json_object``: a JSON object (any keys and values); ``regex``: a regular
    expression the whole output matches; ``choice``: the output is one of these strings; ``grammar``: an EBNF
    grammar (GBNF-style, with a ``root`` rule; not Lark) the output follows. ``disable_any_whitespace``: JSON in
    one fixed layout, separators ", " and ": " and no other whitespace (json / json_object only; xgrammar's
    ``any_whitespace=False``, as vLLM). Enforced by a grammar over the tokens
    (``engine/structured_output.py``, xgrammar). Raises ValueError (naming the field) for none or several, a
    field of the wrong type, an empty ``choice`` or a non-string one."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs: {name} must be true or false")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs: json must be a JSON schema (an object, or its JSON text)")
        given = [self.json is not None, self.regex is not None, self.choice is not None, self.grammar is not None,
                 self.json_object]
        if sum(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, regex, choice, grammar and "
                             "json_object: true")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs: choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs: {name} must be a string")


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")


def _is_int(value) -> bool:
    """An integer of any integer type (a numpy one too: ``operator.index``), not a float with an integer value
    (which silently never matched as a stop id, and crashed the engine as ``n``) nor a bool."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample one request's completion(s).

    Invariants checked by :meth:`validate` (raises ``ValueError`` naming the field): the count, id and seed
    fields integers (not floats or bools; token id lists too; stored as ``int``); ``seed`` -1 means none and
    ``logprobs`` / ``prompt_logprobs`` True means 1 (vLLM); every float field finite
    (JSON bodies may carry ``Infinity`` / ``NaN``); ``n >= 1``; ``temperature >= 0`` (0 means greedy);
    ``0 < top_p <= 1``; ``top_k == -1 or top_k >= 0`` (0 and -1 both mean off); ``0 <= min_p <= 1``; penalties
    in vLLM's ranges; ``max_tokens >= 1`` or None (None = up to ``max_model_len``); ``0 <= min_tokens <=
    max_tokens``; ``logprobs`` and ``prompt_logprobs`` in [0, 20] or None; no empty stop string (it would match
    before any text; vLLM refuses it too); ``stop_token_ids`` non-negative (the engine also checks them against
    the vocabulary);
    ``seed`` a signed 64-bit integer (vLLM's range); ``logit_bias`` maps non-negative token ids (checked against
    the vocabulary by the engine) to finite biases, which are clamped to [-100, 100] (OpenAI's range, as vLLM);
    ``allowed_token_ids`` None or a non-empty list of non-negative ids (checked against the vocabulary by the
    engine); ``truncate_prompt_tokens`` None, -1 or at least 1; ``structured_outputs`` None or a
    StructuredOutputsParams (a dict of its fields is turned into one).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top-k at its position (vLLM)
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, the text stays "" (vLLM); stop strings need the text
    logit_bias: dict[int, float] | None = None  # added to the token's logit before everything else (OpenAI)
    structured_outputs: StructuredOutputsParams | None = None  # a schema, JSON, regex, choice or grammar to follow
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled (vLLM): the others masked
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: its last max_model_len (vLLM)

    def __post_init__(self) -> None:
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: True asks for the token's own logprob (1)
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):  # the HTTP body's spelling, {"json": ...}
            fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {unknown}; the fields are {sorted(fields)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()
        if self.logit_bias:
            self.logit_bias = {int(t): min(100.0, max(-100.0, float(b))) for t, b in self.logit_bias.items()}

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        """True when the next token is always the arg-max (temperature 0)."""
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ``ValueError("<field>: <reason>")`` for the first out-of-range field."""
        checks = [(name, _is_int(getattr(self, name)), "must be an integer") for name in _INTS
                  if getattr(self, name) is not None]
        checks += [(name, all(_is_int(t) for t in getattr(self, name) or ()), "must be a list of integer token ids")
                   for name in ("stop_token_ids", "allowed_token_ids")]
        for name, ok, why in checks:  # the ranges below compare these
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")
        for name in _INTS:  # plain ints from here on (a numpy integer would reach torch and JSON)
            if getattr(self, name) is not None:
                setattr(self, name, operator.index(getattr(self, name)))
        checks = [(name, math.isfinite(getattr(self, name)), "must be a finite number") for name in _FLOATS]
        checks += [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be non-negative"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (off) or non-negative"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty, "must be positive"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("stop", all(self.stop), "must not contain an empty string"),
            ("stop", self.detokenize or not self.stop, "needs detokenize=True (stop strings are found in the text)"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative token ids"),
            ("seed", self.seed is None or -2**63 <= self.seed < 2**63, "must be a signed 64-bit integer"),
            ("logit_bias", all(int(t) >= 0 and math.isfinite(b) for t, b in (self.logit_bias or {}).items()),
             "must map token ids to finite numbers"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                len(self.allowed_token_ids) > 0 and all(t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of non-negative token ids"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "must be a StructuredOutputsParams (or a dict of its fields)"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
             or self.truncate_prompt_tokens >= 1, "must be -1 (max_model_len) or at least 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

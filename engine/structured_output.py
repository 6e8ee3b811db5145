"""Structured outputs (vLLM's ``StructuredOutputsParams``: a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar; OpenAI's ``response_format`` json_object / json_schema): a grammar over the tokens that
masks, at every step, the tokens that cannot continue a valid output.

The grammar and its matcher come from xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models"; the library vLLM uses), imported on the first structured request:
an install without it refuses those (ValueError, a 400 from the API). One :class:`GrammarCompiler` per engine holds
the tokenizer's vocabulary (built on the first structured request, about 0.2 s for a 49k vocabulary) and caches up
to :data:`CACHE_BYTES` of compiled grammars; each sequence gets its own matcher (``Sequence.matcher``), which
accepts the tokens read back. ``json_object`` is the schema ``{"type": "object"}`` (OpenAI's JSON mode, vLLM's).
The server compiles a request's grammar on a worker thread and hands it to the engine thread with the request
(``AsyncLLMEngine.add_request``), so a long compile does not stall the running requests (vLLM compiles off its
scheduler's thread too).

The mask needs the matcher to have seen every token before it, so a step holding a structured sequence is read
back before the next step is scheduled (no async-scheduling overlap for those steps; ``LLMEngine.step``). The
model runner masks the logits in place before sampling and logprobs (:func:`apply_masks`), as vLLM V1 does:
the sampler's processing and the logprobs see the masked distribution.
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch

from engine.sampling_params import StructuredOutputsParams

#: compiled grammars kept per engine (xgrammar's cache; unbounded by default, and every client schema differs)
CACHE_BYTES = 256 << 20


def _reason(e: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[-1] if lines else type(e).__name__)


def choice_grammar(choice: list[str]) -> str:
    """The EBNF grammar whose outputs are exactly the strings of ``choice``: ``root ::= "a" | "b"``, each a JSON
    string literal (xgrammar's EBNF reads the same escapes: quote, backslash, newline)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _what(spec: StructuredOutputsParams) -> str:
    return ("JSON schema" if spec.json is not None or spec.json_object else "regex" if spec.regex is not None
            else "choice" if spec.choice is not None else "grammar")


def _schema_text(spec: StructuredOutputsParams) -> str:
    """The JSON schema of a ``json`` / ``json_object`` spec, as text (json_object: a JSON object, not any value)."""
    schema = '{"type": "object"}' if spec.json_object else spec.json
    return schema if isinstance(schema, str) else json.dumps(schema)


def _grammar(xgr: Any, spec: StructuredOutputsParams) -> Any:
    """``spec`` as an ``xgrammar.Grammar`` (no tokenizer needed): raises xgrammar's RuntimeError when it is not a
    schema, regex or EBNF grammar it can read."""
    if spec.json is not None or spec.json_object:
        return xgr.Grammar.from_json_schema(_schema_text(spec), any_whitespace=not spec.disable_any_whitespace)
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    return xgr.Grammar.from_ebnf(choice_grammar(spec.choice) if spec.choice is not None else spec.grammar)


def check(spec: StructuredOutputsParams) -> None:
    """Raise ValueError when xgrammar cannot make a grammar of ``spec`` (the message without a field name: the
    caller's validator adds it); nothing when xgrammar is not installed (the engine refuses the request then)."""
    try:
        import xgrammar
    except ImportError:
        return
    try:
        _grammar(xgrammar, spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"not a {_what(spec)} this server can follow ({_reason(e)})") from e


class GrammarCompiler:
    """Compiled grammars for one tokenizer and logits width ``vocab_size``; ``stop_token_ids`` end a complete
    output (the model's EOS ids). Raises ValueError when xgrammar is not installed."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        try:
            import xgrammar
        except ImportError as e:
            raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from e
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """``spec``'s compiled grammar (``xgrammar.CompiledGrammar``), from the cache when it was compiled before.
        Safe from any thread; xgrammar releases the GIL while it compiles. Raises ValueError (naming the field)
        for a schema, regex or grammar xgrammar cannot compile."""
        try:
            if spec.json is not None or spec.json_object:
                return self._compiler.compile_json_schema(_schema_text(spec),
                                                          any_whitespace=not spec.disable_any_whitespace)
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            return self._compiler.compile_grammar(choice_grammar(spec.choice) if spec.choice is not None
                                                  else spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: not a {_what(spec)} this server can follow ({_reason(e)})") from e

    def matcher(self, spec: StructuredOutputsParams, grammar: Any = None) -> Any:
        """A new matcher (``xgrammar.GrammarMatcher``) for ``spec``, of ``grammar`` when the caller compiled it
        (:meth:`compile`); raises as :meth:`compile`."""
        return self._xgr.GrammarMatcher(grammar if grammar is not None else self.compile(spec))


def apply_masks(logits: torch.Tensor, matchers: list[Any], vocab_size: int) -> None:
    """Set to -inf, in place, the logits [S, V] float32 of every token each row's matcher (``matchers[i]``, None
    for an unconstrained row) rejects now: one bitmask [S, ceil(vocab_size / 32)] int32 (``vocab_size``: the
    grammar compiler's, the model's logits width) filled on the host, copied over without a sync and applied by
    xgrammar's kernel (Triton on CUDA)."""
    import xgrammar

    from engine.sampler import to_device

    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, to_device(bitmask.numpy(), torch.int32, logits.device),
                                         vocab_size=vocab_size, indices=rows)

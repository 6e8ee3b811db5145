"""The synchronous engine: requests in, one model step at a time, ``RequestOutput`` s out.

One request from arrival to finish: ``add_request`` tokenizes and validates it and queues one ``Sequence`` per
choice; each ``step`` asks the scheduler for a batch, launches it on the model runner (swaps, one forward pass,
sampling), advances every scheduled sequence's computed tokens, and reads a launched step back: appends the
sampled tokens (none for a prefill chunk that stops short of its prompt's end: such a sequence is neither
detokenized nor reported), detokenizes incrementally, applies the stop rules (EOS, stop token ids, stop strings,
max_tokens, max_model_len) and frees the blocks of whatever finished. With async scheduling the step read back is
the one launched by the call before (see :meth:`LLMEngine.step`).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import detokenizer
from engine.block_manager import BlockManager
from engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from engine.cpu_threads import INTERVAL_S, CpuThreads
from engine.generation_config import sampling_defaults
from engine.errors import ContextLengthError, StepFailed
from engine.sampler import INVALID
from engine.model_runner import ModelRunner
from engine.models.context import max_context
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats, TokenHistogram
from engine.structured_output import GrammarCompiler
from engine.swap_pool import SwapPool

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """A request and the sequences (one per choice) generated for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detok: list[detokenizer.DetokenizerState]
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def _eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def prompt_token_ids(tokenizer, vocab_size: int, max_model_len: int, prompt: str | list[int],
                     params: SamplingParams, capped: bool = False) -> list[int]:
    """A request's prompt as token ids, checked as ``LLMEngine.add_request`` checks it (also where the engine runs
    in a process of its own, ``engine/engine_process.py``): a string is encoded with the tokenizer's special
    tokens, ids are taken as they are; with ``truncate_prompt_tokens`` k only the last k are kept (-1: the last
    ``max_model_len``), as vLLM. Raises ContextLengthError when prompt + max_tokens exceed ``max_model_len``
    (tokens), ValueError for an empty prompt, a prompt, stop, logit-bias or allowed token id outside [0,
    ``vocab_size``), or min_tokens over the tokens left in the context when max_tokens is None. ``capped`` (vLLM's
    offline ``LLM``): the generation stops at ``max_model_len`` instead ("length"), so only a prompt that leaves
    no room for one token is refused, and min_tokens is not compared with the context."""
    params.validate()  # again: a field set after the constructor (detokenize=False beside stop strings, say)
    ids = tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
    if params.truncate_prompt_tokens is not None:
        keep = max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        if keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {keep} is over max_model_len ({max_model_len}); use at most "
                             f"{max_model_len}, or -1")
        ids = _left_truncated(tokenizer, prompt, ids, keep)
    if not ids:
        raise ValueError("prompt: must not be empty")
    # the embedding and the sampler (stop ids, biases, the allowed-token mask) index with them
    for name, tokens in (("prompt", ids), ("stop_token_ids", params.stop_token_ids),
                         ("logit_bias", params.logit_bias or {}),
                         ("allowed_token_ids", params.allowed_token_ids or [])):
        if any(not 0 <= t < vocab_size for t in tokens):
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(ids)
    if len(ids) + max(1 if capped else max_tokens, 1) > max_model_len:  # capped: the prompt alone is too long
        raise ContextLengthError(max_model_len, len(ids), 0 if capped else max_tokens)
    # max_tokens None: what the context leaves (vLLM's check after defaulting)
    if params.min_tokens > max_tokens and not capped:
        raise ValueError(f"min_tokens: must not exceed max_tokens ({max_tokens}: what max_model_len={max_model_len} "
                         f"leaves after {len(ids)} prompt tokens), got {params.min_tokens}")
    return ids


def _left_truncated(tokenizer, prompt: str | list[int], ids: list[int], keep: int) -> list[int]:
    """The prompt's last ``keep`` tokens, as vLLM truncates (on the left, in the tokenizer): token ids as they are,
    a text keeps the special tokens its encoding added around it (a BOS) and the text's last tokens fill the rest.
    Raises ValueError for a ``keep`` below the number of those special tokens."""
    if len(ids) <= keep:
        return ids
    body = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else ids
    start = next((i for i in range(len(ids) - len(body) + 1) if ids[i:i + len(body)] == body), None)
    if start is None:
        return ids[-keep:]
    specials = len(ids) - len(body)
    if keep < specials:
        raise ValueError(f"truncate_prompt_tokens: {keep} is fewer than the {specials} special tokens the prompt's "
                         "encoding adds")
    return ids[:start] + body[len(body) - (keep - specials):] + ids[start + len(body):]


class LLMEngine:
    """Single-threaded engine; see docs/architecture.md for the contract the server relies on."""

    def __init__(self, config: EngineConfig):
        """Load the model folder ``config.model``. Raises FileNotFoundError when it is not a model folder (there are
        no hub downloads), ValueError for settings the model or the memory cannot take."""
        if not (Path(config.model) / "config.json").is_file():
            raise FileNotFoundError(f"model: {config.model} is not a model folder (no config.json there); give a "
                                    "local Hugging Face folder: nothing is downloaded")
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self._decode = detokenizer.decoder(self.tokenizer)  # resolved once: called twice per token
        self.model_name = config.served_model_name or Path(config.model).name
        model_cfg = json.loads((Path(config.model) / "config.json").read_text())
        limit, limit_why = max_context(model_cfg)  # raises RopeError (a ValueError) for a RoPE not served
        self.max_model_len = (config.max_model_len if config.max_model_len is not None
                              else min(limit, DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len: {self.max_model_len} is over {limit_why}, {limit} tokens; use at "
                             f"most {limit}")
        #: token ids a request may name: the tokenizer's, and no more than the model's logits have rows for
        self.vocab_size = min(len(self.tokenizer), model_cfg.get("vocab_size") or len(self.tokenizer))
        budget = config.token_budget(self.max_model_len)  # raises before the model loads
        self.runner = ModelRunner(config, self.max_model_len, model_cfg)
        if self.runner.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"max_model_len: the KV cache holds {self.runner.num_blocks * config.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; lower max_model_len or give the KV cache more memory")
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.swap_pool = SwapPool(self.runner.num_swap_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, budget,
                                   config.enable_chunked_prefill, self.swap_pool, self.max_model_len)
        self.eos_token_ids = _eos_token_ids(config.model, self.tokenizer)
        logger.info("model %s on %s in %s, KV cache %s: %d blocks of %d tokens, max_model_len %d",
                    self.model_name, self.runner.device, str(self.runner.dtype).removeprefix("torch."),
                    str(self.runner.kv_dtype).removeprefix("torch."), self.runner.num_blocks, config.block_size,
                    self.max_model_len)
        #: the model's generation_config.json sampling values: what a request that leaves them out gets (vLLM)
        self.default_sampling = sampling_defaults(config.model)
        if self.default_sampling:
            logger.info("the model's generation_config.json sets default sampling parameters %s (a request's own "
                        "values win; its max_new_tokens caps max_tokens)", self.default_sampling)
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None  # structured outputs: built at the first such request
        self._grammars_lock = threading.Lock()
        self._aborted: list[RequestOutput] = []
        self._pending: tuple | None = None  # (batch, LaunchedStep) launched and not read back (async scheduling)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        # on the CPU the thread count follows the other processes' load (OpenMP threads stall behind a busy core)
        self.cpu_threads = CpuThreads() if self.runner.device.type == "cpu" else None
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._iteration_tokens = TokenHistogram()  # steps launched, by the tokens each computes

    # ---- requests in -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, grammar: Any = None, capped: bool = False) -> None:
        """Validate, tokenize and queue a request. A string prompt is encoded with the tokenizer's special tokens
        (its BOS, for Llama-family tokenizers), as vLLM encodes ``LLM.generate`` and ``/v1/completions`` prompts;
        token ids are taken as they are (the chat endpoint renders its template to ids itself). ``grammar``: a
        structured request's grammar, compiled by the caller (``grammar_compiler().compile``; the async engine
        compiles on a worker thread); None compiles it here. ``capped``: see :func:`prompt_token_ids`.

        Raises ContextLengthError when prompt + max_tokens exceed max_model_len, ValueError for an empty prompt,
        a duplicate id, what :func:`prompt_token_ids` refuses (a token id outside the vocabulary in the prompt,
        stop_token_ids, logit_bias or allowed_token_ids; truncate_prompt_tokens over max_model_len; min_tokens over
        what the context leaves).
        """
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        text = prompt if isinstance(prompt, str) else None
        ids = prompt_token_ids(self.tokenizer, self.vocab_size, self.max_model_len, prompt, params, capped)
        matchers = [self._matcher(params, grammar) for _ in range(params.n)]  # a schema it cannot follow raises
        seqs = [Sequence(request_id, i, list(ids), params,  # a seeded child i draws from seed + i (vLLM V1)
                         torch.Generator(self.runner.device).manual_seed(params.seed + i)
                         if params.seed is not None else None, matcher=matchers[i])
                for i in range(params.n)]
        room = self.max_model_len - len(ids)  # a request without max_tokens gets it; a capped one at most it
        self.requests[request_id] = Request(
            request_id, text, ids, params, seqs, [detokenizer.new_state(len(ids)) for _ in seqs],
            RequestMetrics(arrival_time=arrival_time or time.monotonic(),
                           max_tokens=room if params.max_tokens is None else min(params.max_tokens, room)))
        for seq in seqs:
            self.scheduler.add(seq)

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured outputs' grammar compiler, built at the first call (about 0.2 s for a 49k vocabulary);
        callable from any thread (the async engine compiles on a worker thread). Raises ValueError without
        xgrammar."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.runner.model.config["vocab_size"],
                                                 sorted(self.eos_token_ids))
            return self._grammars

    def _matcher(self, params: SamplingParams, grammar: Any = None):
        """A grammar matcher for a structured request, of ``grammar`` when given (None for another request);
        ValueError when it cannot be had."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler().matcher(params.structured_outputs, grammar)

    def abort_request(self, request_id: str, forget: bool = False) -> None:
        """Stop a request now and free its blocks; its last output (finish_reason "abort") comes with the next
        ``step``. Unknown or finished ids are ignored. ``forget``: unregister its blocks from the prefix cache
        first, for a request whose step was cut off (Ctrl-C) after scheduling: their K/V may be unwritten."""
        req = self._remove(request_id, forget)
        if req is None:
            return
        req.metrics.finished_time = time.monotonic()
        self._aborted.append(self._output(req))

    def _remove(self, request_id: str, forget: bool = False) -> Request | None:
        """Take a request out of the engine, finishing ("abort") its unfinished sequences and freeing their blocks;
        ``forget``: unregister them from the prefix cache first (their K/V may be half written)."""
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req is not None else ():
            if forget:
                self.block_manager.forget(seq)
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return req

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work. False also tells the CPU thread governor that the engine goes idle (the next
        step starts a new window; the wait is judged by :meth:`idle`, where a server calls it)."""
        unfinished = bool(self.requests) or bool(self._aborted) or self._pending is not None
        if not unfinished and self.cpu_threads is not None:
            self.cpu_threads.pause()
        return unfinished

    @property
    def idle_look_s(self) -> float | None:
        """How often a server waiting for requests should call :meth:`idle` (s); None: never (CUDA)."""
        return INTERVAL_S if self.cpu_threads is not None else None

    def idle(self) -> None:
        """For a server waiting for requests, every ``idle_look_s`` and on waking: the CPU path's thread count
        follows the other processes' load meanwhile (``CpuThreads.idle_look``), so that the next request, one step
        long perhaps, starts at the right count."""
        if self.cpu_threads is not None:
            self.cpu_threads.idle_look()

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one batch; return an output for every request that advanced, finished or was
        aborted. Raises StepFailed for the requests that could not go on: when they could not sample, the others'
        outputs come with it; when a launch or a read-back raised, the outputs already made are held for the next
        call.

        Async scheduling (``EngineConfig.async_scheduling``, on by default on CUDA): the batch launched here is
        read back in the *next* call, after that call has launched its own batch, so the host's work (reading
        back, detokenizing, stop rules, outputs, scheduling, preparing inputs) overlaps the device's. A sequence
        of the unread batch counts its token as pending (see Sequence) and the next batch reads it on the
        device. A sequence found finished on read-back may be in the next batch already: that token is dropped
        (and its logprobs entry with it). A launched batch holding a structured-output sequence is read back
        before scheduling instead: its grammar mask needs every token (engine/structured_output.py).
        """
        outputs, self._aborted = self._aborted, []
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        if self._pending is not None and any(s.matcher is not None for s in self._pending[0].seqs):
            outputs = self._read_back([self._take_pending()], outputs)  # their grammar masks need every token
        batch = self.scheduler.schedule()
        if batch is None:
            return self._read_back([self._take_pending()], outputs)
        now = time.monotonic()
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        try:
            launched = self.runner.launch(batch, self.eos_token_ids)
        except Exception as e:
            failed = self._fail_batch(batch)
            try:
                outputs = self._read_back([self._take_pending()], outputs)
            except StepFailed as unsampled:  # the step before had a request that could not sample, too
                failed, outputs = failed + unsampled.request_ids, unsampled.outputs
            self._aborted = outputs + self._aborted  # delivered by the next step
            raise StepFailed(failed, e) from e
        for seq, num_new_tokens, samples in zip(batch.seqs, batch.num_new_tokens, batch.samples):
            seq.num_computed_tokens += num_new_tokens
            seq.num_pending_tokens += samples
        if batch.num_batched_tokens:  # a step that only swaps out computes none
            self._iteration_tokens = self._iteration_tokens.observe(batch.num_batched_tokens)
        steps = [self._take_pending()]
        self._pending = (batch, launched)
        if not self.async_scheduling:
            steps.append(self._take_pending())
        return self._read_back(steps, outputs)

    def _take_pending(self) -> tuple | None:
        pending, self._pending = self._pending, None
        return pending

    def _read_back(self, steps: list, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Read back launched steps ((batch, LaunchedStep) or None), oldest first: append each sampled token,
        apply the stop rules, and add the outputs to ``outputs``. Raises StepFailed (``request_error``) for the
        requests whose token could not be sampled, with the outputs of the others; a step whose read-back raises
        (a device error that surfaced late) fails its requests and those of the steps after it, like a launch."""
        invalid: list[str] = []
        steps = [step for step in steps if step is not None]
        for i, (batch, launched) in enumerate(steps):
            try:
                tokens, logprobs = launched.read()
            except Exception as e:
                self._aborted = outputs + self._aborted  # delivered by the next step
                failed = [r for later, _ in steps[i:] for r in self._fail_batch(later)]
                raise StepFailed(list(dict.fromkeys(failed + invalid)), e) from e
            invalid += self._process(batch, tokens, logprobs, outputs)
        if invalid:
            raise StepFailed(list(dict.fromkeys(invalid)), ValueError(
                "sampling: no token can be sampled for this request (every token masked, e.g. by min_tokens with "
                "stop_token_ids, or penalties/temperature that overflow)"), outputs=outputs, request_error=True)
        return outputs

    def _process(self, batch, tokens: list[int], logprobs: list[tuple[dict[int, float], int | None] | None],
                 outputs: list[RequestOutput]) -> list[str]:
        """One launched step's tokens, and their logprobs entries (None where not asked), into its sequences (see
        :meth:`_read_back`); returns the ids of the requests that could not sample (removed here)."""
        tokens, logprobs = iter(tokens), iter(logprobs)
        invalid: list[str] = []
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, samples in zip(batch.seqs, batch.samples):
            if not samples:  # a prefill chunk short of the prompt's end: nothing to sample, detokenize or emit
                continue
            token, entry = next(tokens), next(logprobs)
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # aborted, or stopped by the token before while this step ran: drop it
                continue
            req = self.requests[seq.request_id]
            if token == INVALID:
                invalid.append(seq.request_id)
                continue
            if seq.matcher is not None and not seq.matcher.accept_token(token):  # the mask allowed it: a bug
                logger.error("request %s: token %d breaks its structured output's grammar", seq.request_id, token)
                self.scheduler.finish(seq, "abort")
                touched[req.request_id] = req
                continue
            if len(seq.token_ids) == seq.num_prompt_tokens:
                self._prompt_tokens_total += seq.num_prompt_tokens
            seq.token_ids.append(token)
            if entry is not None:
                seq.add_logprobs(*entry)
            self._generation_tokens_total += 1
            req.metrics.first_token_time = req.metrics.first_token_time or now
            req.metrics.last_token_time = now
            self._check_stop(req, seq, token)
            if not seq.is_finished and seq.matcher is not None and seq.matcher.is_terminated():
                self.scheduler.finish(seq, "stop")  # the grammar took a stop token (ignore_eos let it run on)
            touched[req.request_id] = req
        for request_id in dict.fromkeys(invalid):  # they get the error instead of an output
            touched.pop(request_id, None)
            self._remove(request_id)
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            elif not req.seqs[0].prompt_logprobs_ready:  # another choice ran ahead; outputs are cumulative
                continue
            outputs.append(self._output(req))
        return invalid

    def _fail_batch(self, batch) -> list[str]:
        """Drop the requests of a batch whose forward pass raised, and those swapped out in it (their swap copy may
        not have run): their blocks are unregistered from the prefix cache (their K/V may be half written) and
        released, KV and swap alike, and they leave the engine. Returns their ids (maybe none).

        A row whose request is no longer in the engine is skipped: the request finished or was aborted while the
        batch ran (with async scheduling a row found finished on read-back may be in the next batch already; its
        finished output stands), or its id came free and a new request took it, which was not in the batch."""
        copied = {dst for _, dst in batch.blocks_to_swap_out}  # swapped out this step: the copy may not have run
        live = [seq.request_id for seq in batch.seqs
                if (req := self.requests.get(seq.request_id)) is not None and req.seqs[seq.index] is seq]
        failed = list(dict.fromkeys(live + [
            s.request_id for s in self.scheduler.swapped if copied & set(s.swap_table)]))
        for request_id in failed:
            self._remove(request_id, forget=True)
        return failed

    def _check_stop(self, req: Request, seq: Sequence, token: int) -> None:
        """vLLM's stop rules, in its order, after ``token`` was appended to ``seq`` (counting the tokens read back,
        not one pending behind it): EOS and stop token ids from the ``min_tokens``-th output token on (the sampler
        masks them before), stop strings only after it (vLLM V1's detokenizer), then the length."""
        p, state = seq.params, req.detok[seq.index]
        delta = detokenizer.step(self._decode, seq.token_ids, state, p.skip_special_tokens) if p.detokenize else ""
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                if delta and not p.include_stop_str_in_output:
                    state.text = state.text[:-len(delta)]
                seq.stop_reason = None if token in self.eos_token_ids and not p.ignore_eos else token
                return self.scheduler.finish(seq, "stop")
            hit = (detokenizer.find_stop(state.text, len(delta), p.stop)
                   if delta and p.stop and num_output > p.min_tokens else None)
            if hit is not None:
                start, stop = hit
                state.text = state.text[:start + len(stop) if p.include_stop_str_in_output else start]
                seq.stop_reason = stop
                return self.scheduler.finish(seq, "stop")
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if num_output >= max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _output(self, req: Request) -> RequestOutput:
        choices = []
        for seq, state in zip(req.seqs, req.detok):
            text = state.text
            if not seq.is_finished and seq.params.stop:
                text = text[:len(text) - detokenizer.held_back(text, seq.params.stop)]
            choices.append(CompletionOutput(seq.index, text, seq.output_token_ids, seq.finish_reason,
                                            seq.stop_reason, seq.logprobs, seq.cumulative_logprob,
                                            seq.logprob_ranks))
        # complete once emitted (``_process`` holds a request's outputs back until then; an abort's may not be)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, choices, req.finished, req.metrics,
                             num_cached_tokens=max(req.seqs[0].num_cached_tokens, 0),
                             prompt_logprobs=req.seqs[0].prompt_logprobs,
                             prompt_logprob_ranks=req.seqs[0].prompt_logprob_ranks)

    # ---- introspection -------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        cached = bm.num_cached_blocks
        running = {}
        for seq in self.scheduler.running:
            running[seq.request_id] = running.get(seq.request_id, 0) + len(seq.block_table)
        return EngineStats(
            num_running=len({s.request_id for s in self.scheduler.running}),
            # swapped-out requests wait too (vLLM V1 has no separate gauge for them)
            num_waiting=len({s.request_id for s in (*self.scheduler.waiting, *self.scheduler.swapped)} - set(running)),
            # free + cached + used = num_blocks, as /v1/kv shows them; usage counts cached blocks as free (vLLM).
            block_size=bm.block_size, num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks - cached,
            num_cached_blocks=cached, kv_cache_usage=bm.usage,
            prompt_tokens_total=self._prompt_tokens_total, generation_tokens_total=self._generation_tokens_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=bm.prefix_cache_queries, prefix_cache_hits_total=bm.prefix_cache_hits,
            iteration_tokens=self._iteration_tokens,
            running=sorted(running.items()), block_states=bm.block_states())

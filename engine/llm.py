"""The offline API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))`` (design.md §2, vLLM's ``LLM``)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import StepFailed
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, with_logprob_objects
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


#: vLLM's ``dtype`` spellings that name one of ``EngineConfig.dtype``'s settings
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}


class LLM:
    """Load a model once and generate for batches of prompts.

    Keyword arguments are ``EngineConfig`` fields (gpu_memory_utilization, max_num_seqs, max_model_len,
    kv_cache_dtype, enforce_eager, device, dtype, seed, ...), and these of vLLM's ``LLM``, so that its scripts run:
    ``dtype`` also as "half" / "float" or a ``torch.dtype``; ``trust_remote_code`` and ``disable_log_stats``
    (no effect: the engine runs its own model code, and logs no periodic stats here); ``tensor_parallel_size``
    1 (one GPU); ``tokenizer_mode`` "auto"; ``quantization`` None or the checkpoint's own method (read from its
    config either way); ``max_logprobs`` (20, the most a request may ask for); ``generation_config`` "auto" (the
    model's generation_config.json gives the sampling defaults) or "vllm" (SamplingParams' own).
    Raises TypeError for another argument, ValueError for a value these cannot take.
    """

    def __init__(self, model: str, *, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 disable_log_stats: bool = True, tokenizer_mode: str = "auto", quantization: str | None = None,
                 max_logprobs: int = 20, generation_config: str = "auto", **kwargs):
        del trust_remote_code, disable_log_stats  # no effect here (the class doc)
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: this engine runs on one GPU, got {tensor_parallel_size}")
        if tokenizer_mode != "auto":
            raise ValueError(f"tokenizer_mode: only 'auto' (the model's fast tokenizer), got {tokenizer_mode!r}")
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config: 'auto' or 'vllm' (a folder is not read), got {generation_config!r}")
        if not 0 <= max_logprobs <= 20:
            raise ValueError(f"max_logprobs: must be in [0, 20] (SamplingParams' bound), got {max_logprobs}")
        dtype = kwargs.get("dtype")
        if dtype is not None and not isinstance(dtype, str):  # a torch.dtype: its name
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        elif dtype is not None:
            kwargs["dtype"] = _DTYPE_ALIASES.get(dtype, dtype)
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise TypeError(f"LLM: unexpected keyword argument(s) {', '.join(unknown)}; it takes EngineConfig's "
                            "fields and some of vLLM's (see the class doc)")
        if quantization is not None:
            method = _quant_method(model)
            if quantization.removesuffix("_marlin") != method:
                raise ValueError(f"quantization: the checkpoint is {method or 'not quantized'}, not {quantization}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.max_logprobs = max_logprobs
        self._defaults = self.engine.default_sampling if generation_config == "auto" else {}
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it)."""
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams (vLLM's): the model's generation_config.json
        values (with ``generation_config="auto"``) over SamplingParams' defaults."""
        return SamplingParams(**self._defaults)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in the order given.

        A prompt is a string, a list of token ids, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``;
        ``sampling_params`` is one for all prompts or one per prompt (None: the model's generation_config.json
        values, else SamplingParams()'s defaults, as in vLLM); ``use_tqdm``: a progress bar of finished prompts
        (vLLM's argument; off by default here). Logprobs and prompt logprobs come as vLLM's
        {token_id: ``Logprob(logprob, rank, decoded_token)``} (``engine.outputs.Logprob``), with each choice's
        ``cumulative_logprob``. vLLM's ``lora_request`` (None only: no adapters here) and ``priority`` (None or
        all 0: this scheduler serves in arrival order) are accepted. As vLLM's, a completion that would run past
        ``max_model_len`` stops there (finish_reason "length"); only a prompt that leaves no room for a token is a
        ContextLengthError. Raises that or ValueError before anything runs; ValueError also for a request that
        could not sample a token (every token masked by its own parameters); StepFailed (a RuntimeError) when a
        forward pass failed, or when a request added to ``llm_engine`` directly could not sample. Whatever a call
        raises (Ctrl-C too), its requests are aborted first (their blocks unregistered from the prefix cache: a cut
        step may have left their K/V unwritten), so the next call runs only its own; requests added to
        ``llm_engine`` directly are left as they are.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not served by this engine")
        if priority is not None and any(priority):
            raise ValueError("priority: this engine schedules in arrival order (priorities all 0 only)")
        params = self.get_default_sampling_params() if sampling_params is None else sampling_params
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        for p in params:
            for name in ("logprobs", "prompt_logprobs"):
                if (getattr(p, name) or 0) > self.max_logprobs:
                    raise ValueError(f"{name}: {getattr(p, name)} is over max_logprobs ({self.max_logprobs})")
        ids = [str(next(self._ids)) for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, _prompt_of(prompt), p, capped=True)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException as e:  # Ctrl-C too: the next call must not run (and wait for) this call's requests
            self._drop(ids)
            if isinstance(e, StepFailed) and e.request_error and set(e.request_ids) & set(ids):
                raise e.cause from e  # one of this call's requests could not sample: its own parameters
            raise
        finally:
            if bar is not None:
                bar.close()
        tokenizer = self.engine.tokenizer
        decode = functools.lru_cache(maxsize=None)(lambda t: tokenizer.decode([t]))  # a token's text, once a call
        return [with_logprob_objects(finished[i], p.logprobs or 0, p.prompt_logprobs or 0,
                                     decode if p.detokenize else None) for i, p in zip(ids, params)]

    def _drop(self, ids: list[str]) -> None:
        """Abort the requests ``ids`` (those not finished), forgetting their prefix-cache entries, and, when no
        other request is in the engine, deliver the aborts and read back a launched step (two steps at most), so
        that it holds nothing of a call that raised. A step that raises again here is left unreported: the
        call's own exception is the one to see."""
        for request_id in ids:
            self.engine.abort_request(request_id, forget=True)
        with contextlib.suppress(Exception):
            for _ in range(2):
                if self.engine.requests or not self.engine.has_unfinished_requests():
                    break
                self.engine.step()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             lora_request: None = None, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a list of them,
        each rendered by the tokenizer's chat template, or ``chat_template`` (a Jinja template) when given, with
        ``tools`` (OpenAI's tool definitions) for the template to show the model (ending with the assistant's
        header, or inside the last message with ``continue_final_message``), then :meth:`generate`. The first four
        parameters are vLLM's, in its order; the others are keyword-only (vLLM has more between them, so a
        positional call written for vLLM is a TypeError here, not a silently different prompt). Raises
        ValueError for both of those set, or for messages the template refuses."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: cannot set both it and add_generation_prompt")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer, prompts = self.engine.tokenizer, []
        # list content as the server reads it (ChatMessage.text: text parts one per line, as vLLM); imported here
        # so that the offline API needs the server's pydantic models only when a chat is asked for
        from engine.server.protocol import ChatMessage

        for conversation in conversations:
            conversation = [{**m, "content": ChatMessage(**m).text()} if isinstance(m.get("content"), list) else m
                            for m in conversation]
            try:
                text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                                     tools=tools, add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message,
                                                     **(chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages it refuses
                raise ValueError(f"messages: the chat template rejected them: {e}") from e
            prompts.append(tokenizer.encode(text, add_special_tokens=False))  # the template wrote them
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)


def _quant_method(model: str) -> str | None:
    """The ``quant_method`` of the folder's config.json (awq, gptq, compressed-tensors), None when it has none or
    no config.json (the engine then says why it cannot load the folder)."""
    path = Path(model).expanduser() / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return (config.get("quantization_config") or {}).get("quant_method")


def _prompt_of(prompt: Prompt) -> str | list[int]:
    """A prompt's text or token ids; a dict is vLLM's TextPrompt / TokensPrompt (ValueError for another)."""
    if not isinstance(prompt, dict):
        return prompt
    if prompt.get("multi_modal_data"):
        raise ValueError("prompt: multi_modal_data is not served (this engine runs text models)")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


def _progress(total: int):
    from tqdm.auto import tqdm  # transformers' dependency
    return tqdm(total=total, desc="Processed prompts", unit="prompt")

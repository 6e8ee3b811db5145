"""The offline API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))`` (design.md §2, vLLM's ``LLM``)."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, with_logprob_objects
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Load a model once and generate for batches of prompts.

    Keyword arguments are ``EngineConfig`` fields (gpu_memory_utilization, max_num_seqs, max_model_len,
    kv_cache_dtype, enforce_eager, device, ...).
    """

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in the order given.

        A prompt is a string, a list of token ids, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}``;
        ``sampling_params`` is one for all prompts or one per prompt (None: the model's generation_config.json
        values, else SamplingParams()'s defaults, as in vLLM); ``use_tqdm``: a progress bar of finished prompts
        (vLLM's argument; off by default here). Logprobs and prompt logprobs come as vLLM's
        {token_id: ``Logprob(logprob, rank, decoded_token)``} (``engine.outputs.Logprob``), with each choice's
        ``cumulative_logprob``. Raises ContextLengthError / ValueError before anything runs.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams(**self.engine.default_sampling)
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, _prompt_of(prompt), p)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        finished: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        tokenizer = self.engine.tokenizer
        return [with_logprob_objects(finished[i], p.logprobs or 0, p.prompt_logprobs or 0,
                                     lambda t: tokenizer.decode([t])) for i, p in zip(ids, params)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a list of them,
        each rendered by the tokenizer's chat template (ending with the assistant's header, or inside the last
        message with ``continue_final_message``), then :meth:`generate`. Raises ValueError for both of those set,
        or for messages the template refuses."""
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
                text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message,
                                                     **(chat_template_kwargs or {}))
            except Exception as e:  # noqa: BLE001 - jinja raises its own errors for messages it refuses
                raise ValueError(f"messages: the chat template rejected them: {e}") from e
            prompts.append(tokenizer.encode(text, add_special_tokens=False))  # the template wrote them
        return self.generate(prompts, sampling_params, use_tqdm)


def _prompt_of(prompt: Prompt) -> str | list[int]:
    """A prompt's text or token ids; a dict is vLLM's TextPrompt / TokensPrompt (ValueError for another)."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")


def _progress(total: int):
    from tqdm.auto import tqdm  # transformers' dependency
    return tqdm(total=total, desc="Processed prompts", unit="prompt")

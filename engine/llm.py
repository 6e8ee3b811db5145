"""The offline API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))`` (design.md §2, vLLM's ``LLM``)."""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
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
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in the order given.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``; ``sampling_params`` is one
        for all prompts or one per prompt (None: the model's generation_config.json values, else SamplingParams()'s
        defaults, as in vLLM). Raises ContextLengthError / ValueError before anything runs.
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
                if isinstance(prompt, dict):
                    prompt = prompt["prompt_token_ids"]
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[i] for i in ids]

"""The paged serving engine: ``from engine import LLM, SamplingParams`` (design.md §2)."""
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # LLM and LLMEngine import torch and transformers: load them on first use only.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]

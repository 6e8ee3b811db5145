"""The GPU memory plan of one engine: how many bytes its KV cache gets. The engine sizes its cache with it
(``model_runner``), and the installer's tuner plans with the same function, so that a plan the tuner writes is one
the engine starts with. Torch-free (the tuner runs before torch is imported).

``gpu_memory_utilization`` is, as in vLLM V1, the fraction of the GPU's total memory this engine may take: weights,
activations, the sampler's buffers and the KV cache. Memory other processes hold is not part of it, but it is not
there to take either: the engine gets at most what is free when it starts.
"""
from __future__ import annotations

GIB = 2**30
#: [tokens, hidden] activation buffers one step of ``step_tokens`` tokens holds at its peak, and a spare factor
#: over them (the MLP's wider buffers, the attention's, allocator rounding)
ACTIVATION_BUFFERS, ACTIVATION_SPARE = 16, 4
#: [rows, vocab] float32 buffers of one sampling step at its peak (logits, penalties, top-k/p scratch; measured by
#: bench/sampler_memory.py), one row per running sequence; the sort's temporary storage is one more
SAMPLER_BUFFERS = 10
#: the same for a prompt-logprobs pass (logits, log-softmax, top-k) of :data:`PROMPT_LOGPROBS_ROWS` rows
PROMPT_LOGPROBS_BUFFERS = 3
PROMPT_LOGPROBS_ROWS = 256
#: memory the budget does not count otherwise: the CUDA context, cuBLAS workspaces and compiled kernels (outside
#: torch's allocator), and the CUDA graphs' pool (torch memory, but held apart from the eager steps': activations of
#: a decode batch or of a prefill step of at most 256 tokens; ``StepGraphs.pool_bytes``)
NON_TORCH_BYTES = GIB // 2
#: the tuner's estimates of what the engine measures and it cannot: the CUDA context the engine makes before it
#: reads the free memory, and a margin for allocator rounding and other processes' memory moving meanwhile, kept
#: back from the plan so that the engine gets at least the planned KV cache
CUDA_CONTEXT_BYTES = GIB // 2
PLAN_MARGIN_BYTES = GIB // 4
#: tokens one step computes by default with chunked prefill (vLLM V1's default for an API server on a GPU below
#: 70 GiB; vLLM takes 8,192 on larger ones): a long prompt is prefilled in chunks of this many tokens
DEFAULT_STEP_TOKENS = 2048


def default_step_tokens(max_num_seqs: int, max_model_len: int, chunked_prefill: bool = True) -> int:
    """``max_num_batched_tokens`` when not given: :data:`DEFAULT_STEP_TOKENS` with chunked prefill, else
    ``max_model_len`` (a whole prompt per step); at least ``max_num_seqs`` (every sequence decodes each step)."""
    return max(DEFAULT_STEP_TOKENS if chunked_prefill else max(max_model_len, DEFAULT_STEP_TOKENS), max_num_seqs)


def gpu_kv_budget(total: int, free: int, weights: int, utilization: float, step_tokens: int, hidden: int,
                  itemsize: int, max_num_seqs: int, vocab: int) -> float:
    """Bytes for the KV cache: of ``utilization`` x ``total`` bytes, or of the ``free`` bytes when the engine starts
    if fewer, what the model's ``weights`` (bytes on the GPU), :data:`NON_TORCH_BYTES`, a step's activations
    (:data:`ACTIVATION_BUFFERS` x :data:`ACTIVATION_SPARE` [step_tokens, hidden] buffers of ``itemsize`` bytes) and
    the sampler's float32 [rows, vocab] buffers at their peak leave (:data:`SAMPLER_BUFFERS` for ``max_num_seqs``
    rows, or a prompt-logprobs pass, whichever is larger: 1.6 GB at 256 rows of a 152k vocabulary). Negative when
    nothing is left."""
    activations = ACTIVATION_SPARE * ACTIVATION_BUFFERS * step_tokens * hidden * itemsize
    sampler = 4 * vocab * max(SAMPLER_BUFFERS * max_num_seqs, PROMPT_LOGPROBS_BUFFERS * PROMPT_LOGPROBS_ROWS)
    return min(utilization * total, free) - weights - NON_TORCH_BYTES - activations - sampler

"""The KV cache's share of a GPU (``model_runner.gpu_kv_budget``): what is left of gpu_memory_utilization after the
memory in use, a prefill's activations and the sampler's [rows, V] float32 buffers at their peak (arithmetic only:
the buffer count is measured by bench/sampler_memory.py)."""
from engine.model_runner import PROMPT_LOGPROBS_BUFFERS, SAMPLER_BUFFERS, gpu_kv_budget
from engine.prompt_logprobs import ROWS_PER_PASS

GIB = 2**30
QWEN = dict(max_model_len=4096, hidden=3584, itemsize=2, vocab=152064)  # Qwen2.5-7B in bf16, 4k context


def test_the_sampler_buffers_of_every_sequence_come_out_of_the_kv_cache():
    budget = gpu_kv_budget(24 * GIB, 6 * GIB, 0.9, max_num_seqs=256, **QWEN)
    activations = 4 * 4096 * 3584 * 16 * 2
    assert (SAMPLER_BUFFERS, PROMPT_LOGPROBS_BUFFERS, ROWS_PER_PASS) == (10, 3, 256)
    assert 0.9 * 24 * GIB - 6 * GIB - activations - budget == 4 * 152064 * 10 * 256  # 1.6 GB of sampler buffers


def test_with_few_sequences_a_prompt_logprobs_pass_is_the_larger():
    few = gpu_kv_budget(24 * GIB, 6 * GIB, 0.9, max_num_seqs=8, **QWEN)
    none = gpu_kv_budget(24 * GIB, 6 * GIB, 0.9, max_num_seqs=0, **QWEN)
    assert few == none and 0.9 * 24 * GIB - 6 * GIB - 4 * 4096 * 3584 * 16 * 2 - few == 4 * 152064 * 3 * 256

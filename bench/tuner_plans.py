"""The tuner's GPU plans for popular 4-bit checkpoints on consumer cards' memory, from config.json and file sizes
alone (no GPU needed): a sparse model.safetensors of the published checkpoint's size beside each config.

    python bench/tuner_plans.py [--held GIB]   # GiB other programs hold on the card (default 0.6: a desktop)

Each line: the card, the model, and the plan (``gpu_memory_utilization``, step tokens, ``max_model_len``,
``max_num_seqs``, KV-cache tokens and GiB) or the tuner's refusal. bench/consumer_fit.py runs such plans on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from appliance import tuner
from appliance.hardware import GPU, Hardware

GIB = 2**30
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
#: name -> (config.json fields, bytes of the published AWQ checkpoint's safetensors)
MODELS = {
    "Llama-2-7B": (dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                        max_position_embeddings=4096), 3.89e9),
    "Llama-3.1-8B": (dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                          max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE), 5.73e9),
    "Qwen2.5-7B": (dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                        max_position_embeddings=32768), 5.58e9),
    "Mistral-7B-v0.3": (dict(architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                             max_position_embeddings=32768), 4.15e9),
    "Qwen2.5-14B": (dict(architectures=["Qwen2ForCausalLM"], hidden_size=5120, intermediate_size=13824,
                         num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                         max_position_embeddings=32768), 9.99e9),
}
CARDS_GIB = (8, 12, 16, 24)


def model_folder(root: Path, name: str) -> Path:
    cfg, size = MODELS[name]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16", "quantization_config": AWQ}))
    weights = folder / "model.safetensors"
    weights.touch()
    os.truncate(weights, int(size))  # sparse: only the size matters to the tuner
    return folder


def card(total_gib: float, held_gib: float) -> Hardware:
    total = int(total_gib * GIB)
    return Hardware(kind="cuda", gpus=[GPU(0, f"{total_gib:g} GiB card", total, total - int(held_gib * GIB), "8.9")],
                    driver="-", cpu_cores=8, total_memory=32 * GIB, available_memory=28 * GIB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--held", type=float, default=0.6, help="GiB other programs hold on the card")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for total in CARDS_GIB:
            for name in MODELS:
                info = tuner.ModelInfo.from_dir(model_folder(Path(tmp), name))
                try:
                    p = tuner.plan(info, card(total, args.held))
                except tuner.TuneError as exc:
                    print(f"{total:>2} GiB  {name:<16} refused: {exc.message}")
                    continue
                print(f"{total:>2} GiB  {name:<16} util {p.gpu_memory_utilization:.2f}  step "
                      f"{p.max_num_batched_tokens or 2048:>4}  max_model_len {p.max_model_len:>6}  max_num_seqs "
                      f"{p.max_num_seqs:>3}  KV {p.kv_tokens:>6} tokens ({p.kv_cache_bytes / GIB:.2f} GiB)")


if __name__ == "__main__":
    main()

"""Llama (and Mistral-, Qwen2- and Qwen3-shaped) decoder over the paged KV cache — our own code; transformers gives
only the config.

Source: Touvron et al., "Llama 2" (2023); parameter names follow Hugging Face ``LlamaForCausalLM`` so
checkpoints load as they are. q/k/v and gate/up are stacked into one linear each at load.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, PagedAttention
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from engine.models.context import max_context
from engine.models.checkpoint_config import ARCHITECTURES, check_architecture
from engine.models.loader import CheckpointError, CheckpointReader
from engine.models.rope import RopeError, inv_freq, rope_scaling


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP, residual adds fused into the norms."""

    def __init__(self, cfg: dict, ckpt: CheckpointReader, prefix: str, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        proj = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
        self.qkv_proj = Linear([ckpt.linear(p) for p in proj], [ckpt.bias(p) for p in proj], dtype, device)
        self.o_proj = Linear([ckpt.linear(f"{attn}.o_proj")], [ckpt.bias(f"{attn}.o_proj")], dtype, device)
        proj = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        self.gate_up_proj = Linear([ckpt.linear(p) for p in proj], [ckpt.bias(p) for p in proj], dtype, device)
        self.down_proj = Linear([ckpt.linear(f"{mlp}.down_proj")], [ckpt.bias(f"{mlp}.down_proj")], dtype, device)
        self.input_layernorm = RMSNorm(ckpt.tensor(f"{prefix}.input_layernorm.weight"), eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(ckpt.tensor(f"{prefix}.post_attention_layernorm.weight"), eps,
                                                dtype, device)
        self.q_norm = self.k_norm = None  # Qwen3: RMSNorm over each head of q and k, before the rotation
        if ckpt.has(f"{attn}.q_norm.weight"):
            self.q_norm = RMSNorm(ckpt.tensor(f"{attn}.q_norm.weight"), eps, dtype, device)
            self.k_norm = RMSNorm(ckpt.tensor(f"{attn}.k_norm.weight"), eps, dtype, device)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   sliding_window(cfg))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: [T, hidden_size] → the same, after attention and MLP."""
        x, residual = self.input_layernorm(hidden, residual)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # the split-K sums of q/k/v and of gate/up are added by the next kernel as it loads them (kernels/split_k.py);
        # with q/k norms that kernel is the norm, which takes plain tensors
        qkv = self.qkv_proj(x, defer_sum=self.q_norm is None)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0]
            k = self.k_norm(k.reshape(-1, self.head_dim))[0]
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), meta, positions, rotary.cos_sin)
        hidden = self.o_proj(o.reshape(-1, q_size))
        x, residual = self.post_attention_layernorm(hidden, residual)
        return self.down_proj(self.gate_up_proj(x, defer_sum=True), silu_gated=True), residual


class LlamaForCausalLM(nn.Module):
    """The whole model: embeddings, decoder layers, final norm and LM head (tied to the embeddings if the config
    says so).

    ``forward(input_ids [T] int64, positions [T] int64, meta) -> hidden [T, hidden_size]``;
    ``compute_logits(hidden [S, hidden_size]) -> float32 [S, vocab_size]``.
    """

    def __init__(self, ckpt: CheckpointReader, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None):
        """``max_positions``: rows of the RoPE table, the engine's max_model_len; None = ``max_context``."""
        super().__init__()
        cfg = ckpt.config
        self.config = cfg
        embed = ckpt.tensor("model.embed_tokens.weight").to(device=device, dtype=dtype)
        self.embed_tokens = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ckpt, f"model.layers.{i}", dtype, device)
                                    for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(ckpt.tensor("model.norm.weight"), cfg["rms_norm_eps"], dtype, device)
        if cfg.get("tie_word_embeddings", False) or not ckpt.has("lm_head.weight"):
            self.lm_head = Linear([embed], [None], dtype, device)
        else:
            self.lm_head = Linear([ckpt.linear("lm_head")], [None], dtype, device)
        head_dim, scaling = self.layers[0].head_dim, rope_scaling(cfg)
        freq, attention_factor = inv_freq(scaling, head_dim, cfg.get("max_position_embeddings", 4096))
        self.rotary = RotaryEmbedding(head_dim, max_positions or max_context(cfg)[0], scaling.theta, device, freq,
                                      attention_factor)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens[input_ids], None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, self.rotary)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits. On CUDA the LM head accumulates and writes fp32 (``torch.mm`` with ``out_dtype``), so
        bf16 rounding of the logits does not create ties between the top tokens."""
        head = self.lm_head
        if hidden.is_cuda and head.weight is not None and head.bias is None and head.weight.dtype != torch.float32:
            return torch.mm(hidden, head.weight.t(), out_dtype=torch.float32)
        return head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attn for layer in self.layers]


#: config.json ``architectures`` served by the Llama code (``checkpoint_config.ARCHITECTURES``): Mistral is
#: Llama-shaped; Qwen2 (Qwen2.5) adds biases to q/k/v, which ``Linear`` loads wherever a checkpoint has them; Qwen3
#: adds an RMSNorm over each head of q and k
MODELS = {name: LlamaForCausalLM for name in ARCHITECTURES}


def sliding_window(cfg: dict) -> int:
    """The attention window of a config.json dict, in tokens (0: full attention): Mistral v0.1's
    ``sliding_window`` (later Mistral releases set it to null). Qwen2 and Qwen3 carry one that applies only with
    ``use_sliding_window`` (and then to some layers), which :func:`check_architecture` refuses."""
    window = cfg.get("sliding_window")
    if (cfg.get("architectures") or [""])[0] == "MistralForCausalLM" and isinstance(window, int) and window > 0:
        return window
    return 0


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None) -> LlamaForCausalLM:
    """Build the model class named by config.json's ``architectures`` and load its weights; ``max_positions``: the
    positions its RoPE table covers (the engine's max_model_len; None = the model's whole context).

    Raises CheckpointError for an unsupported architecture (:func:`check_architecture`) or a missing tensor.
    """
    ckpt = CheckpointReader(model_dir, str(device))
    arch = check_architecture(ckpt.config)
    with torch.no_grad():
        return MODELS[arch](ckpt, dtype, device, max_positions).eval()

"""AI2's OLMo 2 (Olmo2ForCausalLM). The Llama decoder's parts, with OLMo 2's differences:

- post-normalization: no norm before attention or the MLP; their outputs are normalised (post_attention_layernorm,
  post_feedforward_layernorm) before they join the residual stream;
- q and k are RMS-normalised over the whole projection (all heads at once, one weight of num_heads * head_dim),
  before rotary, not per head as Qwen3's; so tensor parallelism, which splits the heads, is refused;
- every RMSNorm applies its weight in fp32 before the cast (Llama's casts first).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import GemmaRMSNorm
from streamer.models.layers import ParallelContext, RotaryEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM


class Olmo2RMSNorm(GemmaRMSNorm):
    """x / rms(x) * w in fp32, then cast. Over the last dim, or with `flat`, over the last two (the heads of a
    [T, H, D] projection as one vector)."""

    offset = 0.0

    def __init__(self, size: int, eps: float, flat: bool = False) -> None:
        super().__init__(size, eps)
        self.flat = flat

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.flat:
            return super().forward(x.flatten(-2)).view_as(x)
        return super().forward(x, residual)


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        if ParallelContext.size > 1:
            raise ValueError(f"OLMo 2 does not support tensor parallelism: "
                             f"{registry.entry('Olmo2ForCausalLM').no_tensor_parallel}")
        super().__init__(cfg, backend_cls, rotary)  # (cfg.qk_norm is off: no per-head norms)
        self.q_norm = Olmo2RMSNorm(self.q_size, cfg.rms_norm_eps, flat=True)
        self.k_norm = Olmo2RMSNorm(self.kv_size, cfg.rms_norm_eps, flat=True)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, backend_cls, rotary)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Returns (branch, stream), not yet added, as Llama's layer: the next layer (or the final norm) adds them.
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, decode))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

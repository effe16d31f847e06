"""AI2's OLMo (OlmoForCausalLM: allenai/OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf / OLMo-1.7; not OLMo 2,
models/olmo2.py). Llama's decoder (the SiLU-gated MLP, Llama's names and rotary), with OLMo's differences:

- non-parametric LayerNorm (no weight, no bias, eps 1e-5, computed in fp32 as transformers' OlmoLayerNorm) where
  Llama has RMSNorm: two a layer and a final one; nothing of them is stored in the checkpoint;
- `clip_qkv` (OLMo 1.7): q, k and v clamped to [-clip_qkv, clip_qkv] right after their projection, before rotary;
- `attention_bias` puts biases on q, k, v and o_proj (Llama's).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM

_EPS = 1e-5  # (OlmoLayerNorm's, fixed)


class OlmoLayerNorm(LayerNorm):
    """LayerNorm without weight or bias, in fp32 whatever the input's dtype."""

    def __init__(self, size: int) -> None:
        super().__init__(size, _EPS, affine=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = super().forward(x.float()).to(x.dtype)
        return out if residual is None else (out, residual)


class ClippedAttention(Attention):
    """Attention whose q, k and v are clamped to +-clip right after their projection (OLMo's and MPT's `clip_qkv`;
    None: not clamped). Other keywords go to Attention."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, clip: Optional[float], **kwargs: Any) -> None:
        super().__init__(cfg, backend_cls, rotary, **kwargs)
        self.clip: Optional[float] = None if clip is None else float(clip)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        if self.clip is None:
            return q, k, v
        c = self.clip
        return q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)


class OlmoDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        self.input_layernorm = OlmoLayerNorm(cfg.hidden_size)
        self.post_attention_layernorm = OlmoLayerNorm(cfg.hidden_size)

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return ClippedAttention(cfg, backend_cls, rotary, cfg.raw.get("clip_qkv"))


class OlmoForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = OlmoLayerNorm(cfg.hidden_size)

"""Tencent's Hunyuan dense models (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B / 1.8B / 4B / 7B, -Pretrain and
-Instruct). The Llama decoder with Hunyuan's differences:

- per-head q/k RMSNorms (query_layernorm, key_layernorm) applied AFTER rotary (Qwen3's come before it);
- NTK-alpha rotary: a `rope_scaling` / `rope_parameters` of type "dynamic" with an `alpha` (the released configs'
  alpha 1000) only stretches the base, theta * alpha ** (head_dim / (head_dim - 2)), for every position alike (as
  transformers' compute_ntk_alpha_rope_parameters); dynamic NTK without an alpha depends on the sequence length
  and is refused;
- no MLP biases (transformers hard-codes none); `attention_bias` on q/k/v and o as Llama's.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, require_silu


def ntk_alpha_rope(cfg: ModelConfig) -> ModelConfig:
    """cfg with an NTK-alpha rope folded into its base (and no scaling left); other rope kinds unchanged."""
    s = cfg.rope_scaling
    if s is None or s["rope_type"] != "dynamic":
        return cfg
    if not s.get("alpha"):
        raise ValueError("Hunyuan with dynamic NTK rope scaling (no alpha) is not supported (NTK-alpha is)")
    d = cfg.head_dim
    return dataclasses.replace(cfg, rope_theta=cfg.rope_theta * float(s["alpha"]) ** (d / (d - 2)),
                               rope_scaling=None)


class HunYuanAttention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, backend_cls, rotary)
        self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rotary(positions, q, k)
        return self.attend(self.query_layernorm(q), self.key_layernorm(k), v, kv_cache, decode)


class HunYuanDenseDecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return HunYuanAttention(cfg, backend_cls, rotary)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    decoder_layer = HunYuanDenseDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, "Hunyuan")
        super().__init__(ntk_alpha_rope(cfg), backend_cls, max_positions)

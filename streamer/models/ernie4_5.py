"""Baidu's ERNIE 4.5 dense models (Ernie4_5ForCausalLM: ERNIE-4.5-0.3B-PT / -Base-PT). The Llama decoder with
ERNIE's differences:

- rotary in interleaved pairs: dims (2i, 2i + 1) rotate together by frequency i (GPT-J's layout, as GLM-4's and
  Llama 4's; transformers repeats each cos / sin entry twice and rotates with GLM's interleaved rotate_half);
- one switch, `use_bias`, puts biases on every projection: q, k, v, o and the MLP's gate, up and down (the released
  checkpoints have none); `attention_bias` / `mlp_bias` are not read;
- transformers' config defaults differ from Llama's: rotary base 500,000, a tied LM head, head_dim 128 (not
  hidden_size / heads), rms_norm_eps 1e-5 (its registry entry's `defaults`, models/registry.py).
`BiasedMLPDecoderLayer` (Llama's layer, biases optional everywhere) is also Seed-OSS's (models/seed_oss.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, DecoderLayer, LlamaForCausalLM


class BiasedMLPDecoderLayer(DecoderLayer):
    """Llama's layer whose MLP may carry biases (`mlp_bias`: the model's attribute, read at build)."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0, mlp_bias: bool = False) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp = MLP(cfg, bias=mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def with_biases(cfg: ModelConfig, qkv: bool, o: bool) -> ModelConfig:
    """cfg with the attention's biases as the family's own config keys say (ModelConfig reads `attention_bias`)."""
    return dataclasses.replace(cfg, attention_bias=qkv, o_proj_bias=o)


class Ernie4_5DecoderLayer(BiasedMLPDecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index, mlp_bias=bool(cfg.raw.get("use_bias", False)))


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    decoder_layer = Ernie4_5DecoderLayer
    rope_is_neox = False

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        bias = bool(cfg.raw.get("use_bias", False))
        super().__init__(with_biases(cfg, bias, bias), backend_cls, max_positions)

"""ByteDance's Seed-OSS (SeedOssForCausalLM: Seed-OSS-36B-Base / -Instruct). The Llama decoder with Seed-OSS's
biases, each under its own switch:

- `attention_bias` (transformers' default, and the released checkpoints': True) puts biases on q, k and v only;
- `attention_out_bias` (default False) on o_proj;
- `mlp_bias` (default False) on the MLP's gate, up and down projections.
Otherwise Llama: pre-norms, SwiGLU, neox rotary; head_dim 128 by default (80 heads of 128 over a 5120 hidden size).
"""
from __future__ import annotations

from typing import Callable

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.ernie4_5 import BiasedMLPDecoderLayer, with_biases
from streamer.models.layers import RotaryEmbedding
from streamer.models.llama import LlamaForCausalLM


class SeedOssDecoderLayer(BiasedMLPDecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index, mlp_bias=bool(cfg.raw.get("mlp_bias", False)))


class SeedOssForCausalLM(LlamaForCausalLM):
    decoder_layer = SeedOssDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        raw = cfg.raw
        cfg = with_biases(cfg, bool(raw.get("attention_bias", True)), bool(raw.get("attention_out_bias", False)))
        super().__init__(cfg, backend_cls, max_positions)

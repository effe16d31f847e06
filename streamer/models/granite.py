"""IBM Granite 3.x (GraniteForCausalLM): the Llama decoder with four scalars from the config (each 1.0 when
absent, which is Llama):

- `embedding_multiplier` scales the embeddings;
- `residual_multiplier` scales each branch's output (attention, MLP) before it joins the residual stream, i.e.
  before the next norm's fused add;
- `attention_multiplier` is the softmax scale, instead of head_dim ** -0.5;
- `logits_scaling` divides the logits.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, add_and_norm


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        self.residual_multiplier = float(cfg.raw.get("residual_multiplier", 1.0))

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return Attention(cfg, backend_cls, rotary, scale=float(cfg.raw.get("attention_multiplier", 1.0)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Llama's layer, each branch scaled before the add (the returned MLP branch: by the next norm).
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        h = self.self_attn(positions, h, kv_cache, decode) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    decoder_layer = GraniteDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.from_input_embeddings(self.embed_tokens(input_ids))

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(self.cfg.raw.get("embedding_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / float(self.cfg.raw.get("logits_scaling", 1.0))

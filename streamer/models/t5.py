"""T5's encoder (`T5EncoderModel`: sentence-transformers' sentence-t5 and GTR embedding models), served as an encoder
(models/bert.py: whole prompts, every token seeing all of its prompt, pooling only) in the Llama decoder's shape:

- pre-norm layers with RMSNorms (T5LayerNorm's computation) and a final one; no biases anywhere;
- no position embeddings and no rotary: a learned bias per bucket of each key's distance from its query, read from
  the first layer's `relative_attention_bias` by every layer (models/mpnet.py's BucketBias; T5's encoder buckets
  both ways, `relative_attention_num_buckets` of them up to `relative_attention_max_distance`);
- scores are not scaled by 1 / sqrt(head_dim) (T5 folds that into its initialisation); `d_kv` is the head size,
  whatever d_model / heads is;
- the MLP: ReLU (`feed_forward_proj: relu`, T5 1.0) or GELU-gated (`gated-gelu`, T5 1.1, which GTR and
  sentence-t5 build on: wi_0 activated, times wi_1);
- the token embeddings are `shared` (`encoder.embed_tokens` is the same matrix).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.arcee import UNGATED_PACKED, UpMLP
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from streamer.models.mpnet import BucketBias


class T5Layer(DecoderLayer):
    """Llama's pre-norm layer: RMSNorm, attention, RMSNorm, MLP, each added to the stream."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp = MLP(cfg) if cfg.raw["t5_gated"] else UpMLP(cfg, nn.ReLU())
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return Attention(cfg, backend_cls, rotary, scale=1.0, use_rope=False)


# checkpoint name fragment -> ours (after `encoder.` became `model.`)
_NAMES = (("model.block.0.layer.0.SelfAttention.relative_attention_bias.", "model.relative_attention_bias."),
          ("model.block.", "model.layers."), ("model.final_layer_norm.", "model.norm."),
          (".layer.0.SelfAttention.q.", ".self_attn.q_proj."), (".layer.0.SelfAttention.k.", ".self_attn.k_proj."),
          (".layer.0.SelfAttention.v.", ".self_attn.v_proj."), (".layer.0.SelfAttention.o.", ".self_attn.o_proj."),
          (".layer.0.layer_norm.", ".input_layernorm."), (".layer.1.layer_norm.", ".post_attention_layernorm."),
          (".layer.1.DenseReluDense.wi_0.", ".mlp.gate_proj."), (".layer.1.DenseReluDense.wi_1.", ".mlp.up_proj."),
          (".layer.1.DenseReluDense.wi.", ".mlp.up_proj."), (".layer.1.DenseReluDense.wo.", ".mlp.down_proj."))


class T5EncoderModel(BucketBias, LlamaForCausalLM):
    decoder_layer = T5Layer
    bidirectional = True
    classifier_pooling = "mean"

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        if not cfg.raw["t5_gated"]:
            self.packed = UNGATED_PACKED
        raw = cfg.raw
        buckets = int(raw["relative_attention_num_buckets"])
        self.init_bucket_bias(buckets, cfg.num_heads, buckets, int(raw["relative_attention_max_distance"]))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """T5's names in Llama's spelling; `encoder.embed_tokens` (the same matrix as `shared`) is skipped."""
        for name, t in weights:
            if name == "shared.weight":
                yield "model.embed_tokens.weight", t
                continue
            if name == "encoder.embed_tokens.weight":
                continue
            name = "model." + name.removeprefix("encoder.")
            for theirs, ours in _NAMES:
                name = name.replace(theirs, ours)
            yield name, t

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        if name == "model.embed_tokens.weight":
            return "shared.weight"
        for theirs, ours in reversed(_NAMES):
            name = name.replace(ours, theirs)
        return "encoder." + name.removeprefix("model.")

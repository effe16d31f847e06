"""MPNet (`MPNetModel`, `MPNetForMaskedLM`, `MPNetForSequenceClassification`: sentence-transformers' all-mpnet-base-v2,
multi-qa-mpnet-base, paraphrase-mpnet-base): a BERT-shaped encoder (models/bert.py: post-LN layers, learned absolute
positions from 2 as RoBERTa's, whole prompts) whose attention adds a relative position bias:

- one table for all layers, `encoder.relative_attention_bias` [32 buckets, heads], read at T5's bucket of each key's
  distance from its query: the sign splits the buckets in halves, distances below 8 get a bucket each, longer ones
  share log-spaced buckets up to 128, and every distance from 128 on the last. So the bias of any distance is the
  entry at it clamped to +-128: the model hands the attention backends that as a [heads, 257] table each step
  (AttentionMetadata.position_bias), from its current weights;
- no token types (a pair is told apart by its separators alone); the classifier is RoBERTa's (dense + tanh, then
  out_proj, over the first token); a masked-LM checkpoint's `lm_head` is skipped: it serves as an embedding model.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models import bert
from streamer.models.config import ModelConfig
from streamer.models.family_configs import MPNET_NUM_BUCKETS
from streamer.models.layers import VocabEmbedding

MAX_DISTANCE = 128  # (relative_position_bucket's default: every distance from here on shares the last bucket)


def relative_buckets(distance: torch.Tensor, num_buckets: int = MPNET_NUM_BUCKETS,
                     max_distance: int = MAX_DISTANCE) -> torch.Tensor:
    """T5's bidirectional bucket of each key-minus-query distance (MPNet's relative_position_bucket, T5's encoder's):
    half the buckets for keys after the query; distances below a quarter of the buckets exact, longer ones in
    log-spaced buckets up to max_distance, every one from there on in the last."""
    half = num_buckets // 2
    n = -distance
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    log_ratio = torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (half - exact)).long()).clamp(max=half - 1)
    return ret + torch.where(n < exact, n, large)


class BucketBias:
    """A model whose attention adds a learned bias per bucket of distance (`relative_buckets`), one table for all
    layers (`relative_attention_bias`: [buckets, heads]): the table the backends read, every distance up to
    max_distance (past it, all share the last bucket), from the current weights."""

    relative_bias = True
    relative_attention_bias: VocabEmbedding
    bias_buckets: torch.Tensor

    def init_bucket_bias(self, num_buckets: int, heads: int, table_buckets: int, max_distance: int) -> None:
        """`num_buckets`: the table's rows; `table_buckets`: how many the bucket function spreads distances over."""
        self.relative_attention_bias = VocabEmbedding(num_buckets, heads)
        distances = torch.arange(-max_distance, max_distance + 1)
        self.register_buffer("bias_buckets", relative_buckets(distances, table_buckets, max_distance),  # type: ignore
                             persistent=False)

    def position_bias_table(self) -> torch.Tensor:
        """float32 [heads, 2 * max_distance + 1]: the bias at each distance (AttentionMetadata.position_bias)."""
        return self.relative_attention_bias.weight[self.bias_buckets].t().float().contiguous()


class MPNetModel(BucketBias, bert.BertModel):
    """An encoder (models/bert.py) with MPNet's relative attention bias."""

    names = (("encoder.relative_attention_bias.", "relative_attention_bias."),
             (".attention.attn.q.", ".self_attn.q_proj."), (".attention.attn.k.", ".self_attn.k_proj."),
             (".attention.attn.v.", ".self_attn.v_proj."), (".attention.attn.o.", ".self_attn.o_proj."),
             (".attention.LayerNorm.", ".input_layernorm.")) + bert._NAMES

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.init_bucket_bias(int(cfg.raw["relative_attention_num_buckets"]), cfg.num_heads, MPNET_NUM_BUCKETS,
                              MAX_DISTANCE)

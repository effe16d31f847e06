"""BLOOM (`BloomForCausalLM`: bigscience's bloom-560m to bloom (176B), BLOOMZ, and their fine-tunes). GPT-NeoX's
layer shape (models/gpt_neox.py: a fused per-head query_key_value, LayerNorms with biases, a biased GELU MLP) with:

- no position embeddings, and no rotary: ALiBi. Each head adds slope_h * (key position - query position) to its
  scores (transformers adds slope_h * key position, the same softmax: a row's constant cancels). The slopes are
  transformers' (`alibi_slopes`: a geometric sequence over the largest power of two of heads, the others
  interleaved from the next one's). The model hands the backends that bias as a [heads, 2R + 1] table of every
  distance up to its context length R (AttentionMetadata.position_bias, the relative-bias path MPNet uses), a buffer
  made once, so CUDA graphs read the same memory every step;
- a LayerNorm right after the token embeddings (`word_embeddings_layernorm`), and the final `ln_f`;
- sequential residuals, from the layer's input, or with `apply_residual_connection_post_layernorm` from each norm's
  output (transformers' option; the released checkpoints leave it off);
- the MLP's GELU is the tanh approximation; the LM head is tied to the embeddings;
- no `max_position_embeddings` in the config: ALiBi has no learned positions, so the context is `seq_length` if
  the config gives one, else BLOOM's training length, 2048 (max_model_len may go further).

Checkpoint names are `transformer.` + (word_embeddings, word_embeddings_layernorm, h.N.{input_layernorm,
self_attention.{query_key_value, dense}, post_attention_layernorm, mlp.{dense_h_to_4h, dense_4h_to_h}}, ln_f), or
the same without `transformer.` (bloom-560m's).
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import GeluMLP, fused_qkv_parts, renamed_lora_parts, to_ours, to_theirs
from streamer.models.layers import LayerNorm, ParallelContext, RotaryEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes, float32 [num_heads], as transformers' BLOOM computes them."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 2 * min(closest, num_heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_table(slopes: torch.Tensor, radius: int) -> torch.Tensor:
    """float32 [heads, 2 * radius + 1]: slope_h * d at column radius + d (AttentionMetadata.position_bias)."""
    return slopes[:, None] * torch.arange(-radius, radius + 1, dtype=torch.float32)[None, :]


class AlibiBias:
    """A model whose attention adds ALiBi biases: `init_alibi` keeps this tensor-parallel rank's heads' table as a
    buffer (made once, on the default device: CUDA graphs replay the same memory), which the backends read every
    step (AttentionMetadata.position_bias)."""

    relative_bias = True
    alibi: torch.Tensor

    def init_alibi(self, slopes: torch.Tensor, radius: int, scale: float = 1.0) -> None:
        """`slopes`: every head's [heads] (a rank keeps its own, the next ones in order); `scale` multiplies the
        table (Falcon-RW divides its bias by sqrt(head_dim))."""
        local = len(slopes) // ParallelContext.size
        mine = slopes[ParallelContext.rank * local:(ParallelContext.rank + 1) * local]
        table = (alibi_table(mine, radius) * scale).to(torch.get_default_device())
        self.register_buffer("alibi", table, persistent=False)  # type: ignore[attr-defined]

    def position_bias_table(self) -> torch.Tensor:
        return self.alibi


class BloomLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend_cls, rotary, use_rope=False)
        self.mlp = GeluMLP(cfg, "tanh")
        eps = float(cfg.raw["layer_norm_eps"])
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.residual_from_norm = bool(cfg.raw.get("apply_residual_connection_post_layernorm"))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h = self.input_layernorm(x)
        x = self.self_attn(positions, h, kv_cache, decode) + (h if self.residual_from_norm else x)
        h = self.post_attention_layernorm(x)
        return self.mlp(h) + (h if self.residual_from_norm else x), None


_NAMES = (("word_embeddings_layernorm.", "embed_norm."), ("word_embeddings.", "embed_tokens."), ("ln_f.", "norm."),
          (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.fc1."),
          (".mlp.dense_4h_to_h.", ".mlp.fc2."))
_QKV = re.compile(r"^h\.(\d+)\.self_attention\.query_key_value\.(\w+)$")


class BloomForCausalLM(AlibiBias, LlamaForCausalLM):
    decoder_layer = BloomLayer
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        eps = float(cfg.raw["layer_norm_eps"])
        self.embed_norm = LayerNorm(cfg.hidden_size, eps)
        self.norm = LayerNorm(cfg.hidden_size, eps)
        self.init_alibi(alibi_slopes(cfg.num_heads), max_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(self.embed_tokens(input_ids))

    def from_input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(x)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        heads, dim = self.cfg.num_heads, self.cfg.head_dim
        for name, t in weights:
            if name.startswith("lm_head."):
                yield name, t
                continue
            name = name.removeprefix("transformer.")
            qkv = _QKV.match(name)
            if qkv is None:
                name = to_ours(name, _NAMES).replace("h.", "layers.", 1) if name.startswith("h.") \
                    else to_ours(name, _NAMES)
                yield "model." + name, t
                continue
            layer, suffix = qkv.groups()
            parts = fused_qkv_parts(name, t, heads, dim, 3 * heads * dim, "BLOOM")  # (per head: groups of one)
            for proj, part in zip(("q", "k", "v"), parts):
                yield f"model.layers.{layer}.self_attn.{proj}_proj.{suffix}", part

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        if name.startswith("lm_head."):
            return name
        name = re.sub(r"\.self_attn\.[qkv]_proj\.", ".self_attention.query_key_value.", name)
        name = to_theirs(name, _NAMES).replace("model.layers.", "model.h.")
        return "transformer." + name.removeprefix("model.")

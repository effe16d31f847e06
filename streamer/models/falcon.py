"""Falcon (FalconForCausalLM: tiiuae/falcon-7b, falcon-40b, falcon-180B, Falcon2-11B and their instruct tunes; not
Falcon-H1, models/falcon_h1.py). The Llama decoder's attention and weight loading, with Falcon's differences:

- q, k and v come out of one fused `query_key_value` linear whose rows are grouped by kv head (split into q/k/v as
  they load: models/gpt_neox.py fused_qkv_parts), in one of three layouts:
  `new_decoder_architecture` (40B, 180B, Falcon2): `num_kv_heads` groups, each its query heads' rows then its k
  and v (GQA); else `multi_query` (7B; the default): [all q; k; v], one kv head shared by every query head; else
  every head its own k/v, per head [q_h, k_h, v_h];
- `bias` puts biases on query_key_value, `dense` (o_proj) and the MLP's linears (off in the released models);
- LayerNorm with a bias (eps `layer_norm_epsilon`), and layers (models/gpt_neox.py ParallelResidualLayer) that are
  parallel with two norms (new_decoder_architecture with `num_ln_in_parallel_attn` 2, its default: 40B, 180B):
  x + attn(ln_attn(x)) + mlp(ln_mlp(x)); parallel with one (`parallel_attn`, 7B; Falcon2-11B's
  num_ln_in_parallel_attn 1): x + attn(ln(x)) + mlp(ln(x)); or, with parallel_attn false, sequential (Llama's order);
- full rotary, Llama's rotate-halves layout; head_dim is always hidden_size / heads;
- the MLP is two linears with GELU (`activation`, exact by default) between them (`dense_h_to_4h`, `dense_4h_to_h`;
  width `ffn_hidden_size`, 4 x hidden by default), no gate;
- the LM head tied to `word_embeddings` by default; names under `transformer.` (`h.{i}`, `ln_f`).

Falcon-RW-1B / 7B (`alibi: true`) do not rotate: their heads take BLOOM's ALiBi biases (models/bloom.py), divided by
sqrt(head_dim) as transformers' Falcon divides them. The layer shapes transformers itself cannot run are refused.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.bloom import AlibiBias, alibi_slopes
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import (
    GeluMLP,
    ParallelResidualLayer,
    fused_qkv_parts,
    layer_norm_eps,
    renamed_lora_parts,
    to_ours,
    to_theirs,
)
from streamer.models.layers import LayerNorm, RotaryEmbedding, gelu_approximate
from streamer.models.llama import Attention, LlamaForCausalLM


def layer_shape(raw: dict[str, Any]) -> tuple[bool, bool]:
    """(parallel attention and MLP, two norms a layer) of a Falcon config, refusing the combinations transformers'
    FalconDecoderLayer builds but cannot run (it reads a norm it did not build)."""
    new = bool(raw.get("new_decoder_architecture"))
    parallel = bool(raw.get("parallel_attn", True))
    norms = raw.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if not parallel:
        if new:
            raise ValueError("Falcon with new_decoder_architecture and parallel_attn: false is not supported "
                             "(transformers cannot run it either)")
        return False, True
    if norms not in (1, 2) or (norms == 2 and not new):
        raise ValueError(f"Falcon with num_ln_in_parallel_attn {norms}"
                         f"{'' if new else ' without new_decoder_architecture'} is not supported (transformers "
                         "cannot run it either; 1, or 2 with new_decoder_architecture, are)")
    return True, norms == 2


class FalconLayer(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        # (cfg.attention_bias: the config's `bias`; Falcon-RW's ALiBi layers do not rotate)
        self.self_attn = Attention(cfg, backend_cls, rotary, use_rope=not cfg.raw.get("alibi"))
        self.mlp = GeluMLP(cfg, gelu_approximate(cfg, "gelu", "activation"), bias=cfg.attention_bias)
        self.parallel, two_norms = layer_shape(cfg.raw)
        eps = layer_norm_eps(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)  # (ln_attn with two norms)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps) if two_norms else None  # (or ln_mlp)


# checkpoint name fragment -> ours (after `transformer.` became `model.`)
_NAMES = (("model.word_embeddings.", "model.embed_tokens."), ("model.ln_f.", "model.norm."),
          ("model.h.", "model.layers."), (".self_attention.dense.", ".self_attn.o_proj."),
          (".mlp.dense_h_to_4h.", ".mlp.fc1."), (".mlp.dense_4h_to_h.", ".mlp.fc2."))
_TWO_NORMS = ((".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."))
_QKV = re.compile(r"(model\.layers\.\d+)\.self_attention\.query_key_value\.(\w+)$")


class FalconForCausalLM(AlibiBias, LlamaForCausalLM):
    decoder_layer = FalconLayer
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        two_norms = layer_shape(cfg.raw)[1]
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))
        self.names = _NAMES + (_TWO_NORMS if two_norms else ())
        self.relative_bias = bool(cfg.raw.get("alibi"))
        if self.relative_bias:  # Falcon-RW: BLOOM's ALiBi (models/bloom.py), divided by sqrt(head_dim) as there
            self.init_alibi(alibi_slopes(cfg.num_heads), max_positions, cfg.head_dim ** -0.5)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Falcon's names in Llama's spelling; the fused query_key_value split into q/k/v (whole checkpoint tensors:
        their loaders take each rank's heads, or the shared kv head). Every layout is grouped by kv head (7B's one
        group, per-head groups without multi_query)."""
        c = self.cfg
        rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        for name, t in weights:
            name = to_ours(name, self.names, "transformer.")
            m = _QKV.match(name)
            if m is None:
                yield name, t
                continue
            layer, suffix = m.groups()
            for proj, part in zip("qkv", fused_qkv_parts(name, t, c.num_kv_heads, c.head_dim, rows, "Falcon")):
                yield f"{layer}.self_attn.{proj}_proj.{suffix}", part

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        name = re.sub(r"\.self_attn\.[qkv]_proj\.", ".self_attention.query_key_value.", name)
        return to_theirs(name, self.names, "transformer.")

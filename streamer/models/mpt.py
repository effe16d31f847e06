"""MPT (`MPTForCausalLM`: MosaicML's mpt-7b, -instruct, -chat, -storywriter, mpt-30b), as transformers' `MptForCausalLM`
reads it: BLOOM's ALiBi (models/bloom.py: the relative-bias table) with MPT's slopes (1 / 2^(i * alibi_bias_max / n)
over the next power of two of heads, odd ones first where there are fewer heads), no rotary and no learned
positions; pre-LN sequential layers of LayerNorms without biases; a fused `Wqkv` holding all q rows, then k, then v
(optionally clamped to +-clip_qkv); no biases anywhere; a GELU MLP 4x wide; the LM head tied to `wte`.

Names: transformer.{wte, blocks.N.{norm_1, attn.{Wqkv, out_proj}, norm_2, ffn.{up_proj, down_proj}}, norm_f}.
What transformers' MPT does not build either (qk_ln, learned positions instead of ALiBi, another MLP width, biases,
logit_scale) is refused.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Iterable

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.bloom import AlibiBias
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import GeluMLP, ParallelResidualLayer, renamed_lora_parts, to_ours, to_theirs
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import LlamaForCausalLM
from streamer.models.olmo import ClippedAttention


def mpt_alibi_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """MPT's ALiBi slopes, float32 [num_heads], as transformers' build_mpt_alibi_tensor computes them."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, dtype=torch.float32) * (bias_max / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


class MptLayer(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        attn = cfg.raw["mpt_attn"]
        self.self_attn = ClippedAttention(cfg, backend_cls, rotary, attn["clip_qkv"], scale=attn["softmax_scale"],
                                          use_rope=False)
        self.mlp = GeluMLP(cfg, "none", bias=False)
        eps = float(cfg.raw["layer_norm_eps"])
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps, bias=False)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps, bias=False)
        self.parallel = False


_NAMES = (("model.wte.", "model.embed_tokens."), ("model.norm_f.", "model.norm."), ("model.blocks.", "model.layers."),
          (".norm_1.", ".input_layernorm."), (".norm_2.", ".post_attention_layernorm."),
          (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.up_proj.", ".mlp.fc1."), (".ffn.down_proj.", ".mlp.fc2."))
_QKV = re.compile(r"(model\.layers\.\d+)\.attn\.Wqkv\.(\w+)$")


class MptForCausalLM(AlibiBias, LlamaForCausalLM):
    decoder_layer = MptLayer
    lora_parts = renamed_lora_parts

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, float(cfg.raw["layer_norm_eps"]), bias=False)
        self.init_alibi(mpt_alibi_slopes(cfg.num_heads, float(cfg.raw["mpt_attn"]["alibi_bias_max"])), max_positions)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in weights:
            name = to_ours(name, _NAMES, "transformer.")
            m = _QKV.match(name)
            if m is None:
                yield name, t
                continue
            layer, suffix = m.groups()
            if not isinstance(t, torch.Tensor) or suffix != "weight":
                raise ValueError(f"{name!r}: only a float Wqkv weight is supported in MPT checkpoints")
            for proj, part in zip("qkv", t.chunk(3, dim=0)):  # (all q rows, then k, then v)
                yield f"{layer}.self_attn.{proj}_proj.{suffix}", part

    def checkpoint_name(self, internal: str) -> str:
        name = re.sub(r"\.self_attn\.[qkv]_proj\.", ".attn.Wqkv.", super().checkpoint_name(internal))
        return to_theirs(name, _NAMES, "transformer.")

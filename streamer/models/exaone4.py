"""LG AI Research's EXAONE 4.0 (Exaone4ForCausalLM: EXAONE-4.0-1.2B, EXAONE-4.0-32B). The Llama decoder's parts,
with EXAONE 4.0's differences:

- post-normalization, as OLMo 2's: no norm before attention or the MLP; their outputs are RMS-normalised
  (post_attention_layernorm, post_feedforward_layernorm, Llama's RMSNorm) before they join the residual stream;
- per-head q/k RMSNorms (as Qwen3's), before rotary;
- hybrid attention: `layer_types` (by default every `sliding_window_pattern`-th layer global, 4; a string pattern
  such as "LLLG" repeats over the layers, the last layer always global) marks "sliding_attention" layers, which
  attend within `sliding_window` and rotate q and k, and "full_attention" layers, which attend globally WITHOUT
  rotary (NoPE: transformers rotates only when the config has no sliding window, or on sliding layers). A config
  without `sliding_window` (EXAONE-4.0-1.2B) has only global layers, and those rotate;
- no biases anywhere; the MLP is Llama's SwiGLU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, require_silu

LAYER_TYPES = ("sliding_attention", "full_attention")


def exaone4_layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's kind, as transformers' Exaone4Config derives it when config.json has no `layer_types`."""
    types = raw.get("layer_types")
    if not types:
        pattern = raw.get("sliding_window_pattern", 4)
        if raw.get("sliding_window") is None or not pattern:
            types = ["full_attention"] * num_layers
        elif isinstance(pattern, str):  # "LLLG": local / global, repeating from layer 0; the last layer global
            types = ["full_attention" if pattern[i % len(pattern)].upper() == "G" or i == num_layers - 1
                     else "sliding_attention" for i in range(num_layers)]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]
    types = list(types)
    if len(types) < num_layers or any(t not in LAYER_TYPES for t in types[:num_layers]):
        raise ValueError(f"unsupported layer_types {types!r} for EXAONE 4.0 ({', '.join(LAYER_TYPES)})")
    return types[:num_layers]


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        window = cfg.raw.get("sliding_window")
        sliding = exaone4_layer_types(cfg.raw, cfg.num_layers)[index] == "sliding_attention"
        self.self_attn = Attention(cfg, backend_cls, rotary, sliding_window=window if sliding else None,
                                   qk_norm_cls=RMSNorm, use_rope=window is None or sliding)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Returns (branch, stream), not yet added, as Llama's layer: the next layer (or the final norm) adds them.
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, decode))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Exaone4ForCausalLM(LlamaForCausalLM):
    decoder_layer = Exaone4DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, "EXAONE 4.0")
        exaone4_layer_types(cfg.raw, cfg.num_layers)  # (a bad config fails here, once)
        # (transformers' EXAONE 4.0 has no attention biases, whatever a config says)
        cfg = dataclasses.replace(cfg, attention_bias=False, o_proj_bias=False)
        super().__init__(cfg, backend_cls, max_positions)

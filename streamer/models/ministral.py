"""Mistral's Ministral (MinistralForCausalLM: Ministral-8B-Instruct-2410 as transformers converts it). Mistral's
decoder (Llama's, without attention biases) whose layers may differ in attention: `layer_types` marks
"sliding_attention" layers, which attend within `sliding_window`, and "full_attention" layers, which attend
globally (by default every layer slides when the config has a window, as transformers' MinistralConfig derives it;
its window defaults to 4096 when config.json leaves the key out). Nothing else differs from Mistral.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, require_silu

LAYER_TYPES = ("sliding_attention", "full_attention")


def ministral_windows(raw: dict[str, Any], num_layers: int) -> list[Optional[int]]:
    """Each layer's window (None: global), as transformers' MinistralConfig reads `layer_types` / `sliding_window`."""
    window = raw["sliding_window"] if "sliding_window" in raw else 4096
    types = list(raw.get("layer_types") or ["sliding_attention" if window is not None else "full_attention"]
                 * num_layers)
    if len(types) < num_layers or any(t not in LAYER_TYPES for t in types[:num_layers]):
        raise ValueError(f"unsupported layer_types {types!r} for Ministral ({', '.join(LAYER_TYPES)})")
    return [window if t == "sliding_attention" else None for t in types[:num_layers]]


class MinistralDecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return Attention(cfg, backend_cls, rotary, sliding_window=ministral_windows(cfg.raw, cfg.num_layers)[index])


class MinistralForCausalLM(LlamaForCausalLM):
    decoder_layer = MinistralDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, "Ministral")
        ministral_windows(cfg.raw, cfg.num_layers)  # (a bad config fails here, once)
        # (transformers' Ministral has no attention biases, whatever a config says)
        cfg = dataclasses.replace(cfg, attention_bias=False, o_proj_bias=False)
        super().__init__(cfg, backend_cls, max_positions)

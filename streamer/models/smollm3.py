"""Hugging Face's SmolLM3 (SmolLM3ForCausalLM): the Llama decoder with NoPE layers. The layers whose
`no_rope_layers` entry is 0 (by default every `no_rope_layer_interval`-th, 4) do not rotate q and k (as Llama 4's
NoPE layers, without their temperature tuning); with `use_sliding_window`, the layers `layer_types` marks
"sliding_attention" (by default the NoPE ones) attend within `sliding_window`. The LM head is tied by default.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM, rope_layers


def sliding_layers(cfg: ModelConfig) -> list[bool]:
    """Which layers attend within the sliding window (none unless use_sliding_window: ModelConfig's window is then
    None), as transformers derives `layer_types`."""
    raw: dict[str, Any] = cfg.raw
    rope = rope_layers(raw, cfg.num_layers)
    types = raw.get("layer_types") or ["full_attention" if r else "sliding_attention" for r in rope]
    if len(types) < cfg.num_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"unsupported layer_types {types!r} for SmolLM3 (sliding_attention, full_attention)")
    return [cfg.sliding_window is not None and t == "sliding_attention" for t in types[:cfg.num_layers]]


class SmolLM3DecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        window: Optional[int] = cfg.sliding_window if sliding_layers(cfg)[index] else None
        return Attention(cfg, backend_cls, rotary, sliding_window=window,
                         use_rope=rope_layers(cfg.raw, cfg.num_layers)[index])


class SmolLM3ForCausalLM(LlamaForCausalLM):
    decoder_layer = SmolLM3DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        for key, ok in (("hidden_act", "silu"), ("mlp_bias", False)):
            if cfg.raw.get(key, ok) != ok:
                raise ValueError(f"SmolLM3 with {key}={cfg.raw[key]!r} is not supported ({ok!r} is)")
        sliding_layers(cfg)  # (a bad config fails here, once)
        super().__init__(cfg, backend_cls, max_positions)

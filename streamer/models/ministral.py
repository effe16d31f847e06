"""Mistral's Ministral (MinistralForCausalLM: Ministral-8B-Instruct-2410 as transformers converts it), and
Ministral 3 (Ministral3ForCausalLM, below). Mistral's
decoder (Llama's, without attention biases) whose layers may differ in attention: `layer_types` marks
"sliding_attention" layers, which attend within `sliding_window`, and "full_attention" layers, which attend
globally (by default every layer slides when the config has a window, as transformers' MinistralConfig derives it;
its window defaults to 4096 when config.json leaves the key out). Nothing else differs from Mistral.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
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


def llama4_scaling(raw: dict[str, Any]) -> Optional[tuple[float, float]]:
    """Ministral 3's query scaling, (beta, original length) from its rope parameters' `llama_4_scaling_beta` and
    `original_max_position_embeddings` (None: no scaling)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    if not beta:
        return None
    original = rope.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if not original or original <= 0:
        raise ValueError("llama_4_scaling_beta needs a positive original_max_position_embeddings in the rope "
                         f"parameters (got {original!r})")
    return float(beta), float(original)


class Ministral3Attention(Attention):
    """Mistral's attention with Llama 4's position-dependent query scale after the rotary: q * (1 + beta *
    log(1 + floor(p / original))), p the token's 0-based position (transformers' get_llama_4_attn_scale). It is 1
    within the pretraining length, so short prompts attend exactly as Mistral's."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        super().__init__(cfg, backend_cls, rotary)
        self.scaling = llama4_scaling(cfg.raw)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rotary(positions, q, k)
        if self.scaling is not None:
            beta, original = self.scaling
            scale = 1.0 + beta * torch.log1p(torch.floor(positions.float() / original))
            q = q * scale.to(q.dtype).view(-1, 1, 1)  # (cast first, as transformers multiplies)
        return self.attend(q, k, v, kv_cache, decode)


class Ministral3DecoderLayer(DecoderLayer):
    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        return Ministral3Attention(cfg, backend_cls, rotary)


class Ministral3ForCausalLM(LlamaForCausalLM):
    """Ministral 3 (Ministral3ForCausalLM, and the text model of the Ministral 3 / Mistral-Small-3.x-style
    Mistral3ForConditionalGeneration checkpoints whose text_config is "ministral3"): Mistral's decoder (no
    attention biases; one sliding window for every layer when the config gives one), YaRN rotary, and Llama 4's
    query scale for positions past the pretraining length (`Ministral3Attention`)."""

    decoder_layer = Ministral3DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        require_silu(cfg.raw, "Ministral 3")
        llama4_scaling(cfg.raw)  # (a bad config fails here, once)
        super().__init__(dataclasses.replace(cfg, attention_bias=False, o_proj_bias=False), backend_cls,
                         max_positions)

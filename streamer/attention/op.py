"""Attention + KV write as one opaque custom op, so torch.compile captures the rest of the model whole.

The op mutates the layer's KV cache; its fake implementation only says what shape comes out. Backends are
registered per layer at model construction and the step's metadata comes from the forward context.
"""
from __future__ import annotations

from typing import Optional

import torch

from streamer.attention.base import AttentionBackend, current_metadata

_layers: list[AttentionBackend] = []


def register_layer(backend: AttentionBackend) -> int:
    _layers.append(backend)
    return len(_layers) - 1


@torch.library.custom_op("streamer::paged_attention", mutates_args=("kv_cache",))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _layers[layer].forward(q, k, v, kv_cache, current_metadata(), sinks)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
      sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.empty_like(q)

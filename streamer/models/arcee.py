"""Arcee's AFM (ArceeForCausalLM: AFM-4.5B, AFM-4.5B-Base). The Llama decoder whose MLP has no gate: down(act(up(x)))
with ReLU² (relu(x) ** 2, transformers' "relu2"), as Nemotron's; `mlp_bias` puts biases on up and down,
`attention_bias` on q, k, v and o (Llama's). `UpMLP` (the gateless MLP, its activation given) is also Apertus's
(models/apertus.py). The checkpoint's up_proj is a plain column-parallel layer here (no gate to pack it with), so
tensor parallelism splits it as Llama's gate/up.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import DecoderLayer, LlamaForCausalLM


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class UpMLP(nn.Module):
    """down(act(up(x))): an MLP without a gate (Arcee's ReLU², Apertus's xIELU)."""

    def __init__(self, cfg: ModelConfig, act: nn.Module, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], bias=bias)
        self.act_fn = act
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


# The checkpoint's q/k/v go into the fused qkv_proj; up_proj stays itself (Llama packs it with gate_proj).
UNGATED_PACKED = {k: v for k, v in LlamaForCausalLM.packed.items() if k in ("q_proj", "k_proj", "v_proj")}


class ArceeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp = UpMLP(cfg, ReLUSquared(), bias=bool(cfg.raw.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ArceeForCausalLM(LlamaForCausalLM):
    decoder_layer = ArceeDecoderLayer
    packed = UNGATED_PACKED

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        act = cfg.raw.get("hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"Arcee with hidden_act={act!r} is not supported (relu2 is)")
        super().__init__(cfg, backend_cls, max_positions)

"""Qwen3.5 (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, and the text models of Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration, which every released Qwen3.5 checkpoint is): Qwen3-Next's hybrid of Gated
DeltaNet and gated full attention (models/qwen3_next.py), with

- the Gated DeltaNet's input projections stored apart and in plain order: `in_proj_qkv` ([q; k; v], each head after
  head), `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3-Next packs them per key head into in_proj_qkvz / in_proj_ba);
- a dense SwiGLU MLP in every layer (Qwen3.5), or Qwen3-Next's sparse MoE with its gated shared expert in every
  layer (Qwen3.5-MoE; the router always renormalises its top-k weights);
- interleaved M-RoPE over the rotary quarter of each head (Qwen3-VL's, models/vlm.py): text positions rotate as
  plain rotary, images' take their (t, h, w) positions.

The vision side is Qwen3-VL's encoder without DeepStack (models/vlm.py Qwen3VLMixin, models/qwen_vision.py).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from streamer.models.layers import ColumnParallelLinear
from streamer.models.mamba import PartsLinear, split_parts
from streamer.models.moe import unstack_experts
from streamer.models.qwen3_next import GatedDeltaNet, Qwen3NextDecoderLayer, Qwen3NextForCausalLM


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's Gated DeltaNet with Qwen3.5's four input projections. Under tensor parallelism in_proj_qkv
    splits by its parts (this rank's key heads' q and k, their value heads' v), the others by rows."""

    def make_projections(self, hidden_size: int, key: int, value: int, v_heads: int) -> None:
        self.in_proj_qkv = PartsLinear(hidden_size, split_parts([key, key, value]))
        self.in_proj_z = ColumnParallelLinear(hidden_size, [value])
        self.in_proj_b = ColumnParallelLinear(hidden_size, [v_heads])
        self.in_proj_a = ColumnParallelLinear(hidden_size, [v_heads])

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Qwen35DecoderLayer(Qwen3NextDecoderLayer):
    linear_attention_cls = Qwen35GatedDeltaNet


class Qwen35ForCausalLM(Qwen3NextForCausalLM):
    decoder_layer = Qwen35DecoderLayer

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-Next's (the `mtp.*` head skipped), experts stacked per layer as each expert's."""
        return unstack_experts(super().rename_weights(weights), self.cfg)



"""NVIDIA's Nemotron (NemotronForCausalLM: Nemotron-4 / Nemotron-3 8B, Minitron-4B / 8B-Base, Nemotron-Mini-4B-Instruct;
not the hybrid Nemotron-H, models/nemotron_h.py). Llama's decoder (GQA, Llama's names), with Nemotron's differences:

- LayerNorm1P where Llama has RMSNorm: a LayerNorm with a bias whose stored weight is the scale less one (it applies
  1 + weight; eps `norm_eps`), two a layer and a final one;
- the MLP has no gate: down(relu(up(x)) ** 2) (transformers' "relu2", models/arcee.py UpMLP); `mlp_bias` puts biases
  on up and down, `attention_bias` on q, k, v and o (Llama's);
- partial rotary: only the first `partial_rotary_factor` (0.5 by default) of each head rotates, Llama's
  rotate-halves layout within that part;
- the LM head untied by default.
"""
from __future__ import annotations

from typing import Callable

import torch

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.arcee import UNGATED_PACKED, ArceeDecoderLayer
from streamer.models.config import ModelConfig
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import LlamaForCausalLM


class LayerNorm1P(LayerNorm):
    """LayerNorm applying 1 + its stored weight (transformers' NemotronLayerNorm1P)."""

    def scale(self) -> torch.Tensor:
        return self.weight + 1.0  # type: ignore[operator]


class NemotronDecoderLayer(ArceeDecoderLayer):
    """Arcee's layer (Llama's, its MLP the gateless ReLU² one) with LayerNorm1P for RMSNorm."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, backend_cls, rotary, index)
        self.input_layernorm = LayerNorm1P(cfg.hidden_size, cfg.rms_norm_eps)  # (rms_norm_eps: the config's norm_eps)
        self.post_attention_layernorm = LayerNorm1P(cfg.hidden_size, cfg.rms_norm_eps)


class NemotronForCausalLM(LlamaForCausalLM):
    decoder_layer = NemotronDecoderLayer
    packed = UNGATED_PACKED

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        act = cfg.raw.get("hidden_act") or "relu2"
        if act != "relu2":
            raise ValueError(f"Nemotron with hidden_act {act!r} is not supported (relu2 is)")
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm1P(cfg.hidden_size, cfg.rms_norm_eps)

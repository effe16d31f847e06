"""Gemma 1 (GemmaForCausalLM: gemma-2b, gemma-7b, gemma-1.1-*, CodeGemma 2b / 7b / 7b-it, and other checkpoints of
that architecture). The Llama decoder (two norms a layer, global attention, one rotary table) with Gemma's
differences, the parts models/gemma3.py builds Gemma 2 and 3 from:

- RMSNorm scales by (1 + w), computed in fp32 before the cast (gemma3.GemmaRMSNorm);
- embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype first, as transformers does;
- the MLP gates with tanh-approximated GELU (`hidden_act`; transformers reads the released configs' legacy "gelu"
  as that too, and older transformers' `hidden_activation` defaulted to it);
- `head_dim` is its own setting (256 in every release, where hidden_size / num_heads is 192 for gemma-7b);
- the LM head is tied to the embeddings.
No q/k norms, no sliding window, no soft-capping: those came with Gemma 2.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import Gemma3ForCausalLM, GemmaMLP, GemmaRMSNorm
from streamer.models.layers import ColumnParallelLinear, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import DecoderLayer, LlamaForCausalLM

# The activations transformers runs as tanh-approximated GELU in a Gemma 1 MLP ("gelu": GemmaConfig converts it).
_TANH_GELU = ("gelu_pytorch_tanh", "gelu")


class Gemma1MLP(GemmaMLP):
    """gemma3.GemmaMLP (gelu-tanh(gate) * up, then down), with Gemma 1's activation setting: `hidden_act`."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        act = cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _TANH_GELU:
            raise ValueError(f"Gemma with hidden_act {act!r} is not supported (gelu_pytorch_tanh is)")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                 shard_names=["gate", "up"])
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)


class GemmaDecoderLayer(DecoderLayer):
    """Llama's layer (pre-norms, the residual add fused into the next norm) with (1 + w) norms and the GELU MLP."""

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp: nn.Module = Gemma1MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.raw.get("use_bidirectional_attention"):
            raise ValueError("Gemma with bidirectional attention is not supported")
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = float(cfg.hidden_size) ** 0.5

    embed = Gemma3ForCausalLM.embed  # x * sqrt(hidden), the scale rounded to the dtype first

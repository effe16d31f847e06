"""StarCoder2 (Starcoder2ForCausalLM: bigcode/starcoder2-3b, -7b, -15b and their instruct tunes). Mistral's decoder
(pre-norms, GQA, Llama's rotary halves, a sliding window when the config sets one) with StarCoder2's differences:

- LayerNorm with a bias (nn.LayerNorm, eps `norm_epsilon`), not RMSNorm;
- the MLP is two biased linears with GELU between them (`c_fc`, `c_proj`; `hidden_act`, tanh-approximated in the
  released models), no gate;
- biases on q, k, v and o_proj and on both MLP linears (`use_bias`, on by default);
- the LM head is tied to the embeddings unless the config says not.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import ColumnParallelLinear, LayerNorm, RotaryEmbedding, RowParallelLinear
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM

# hidden_act -> F.gelu's `approximate`, as transformers' ACT2FN computes them
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def _use_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("use_bias", True))


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        act = cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU:
            raise ValueError(f"StarCoder2 with hidden_act {act!r} is not supported ({', '.join(_GELU)} are)")
        self.approximate = _GELU[act]
        bias = _use_bias(cfg)
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], bias=bias)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Starcoder2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp: nn.Module = Starcoder2MLP(cfg)
        eps = starcoder2_eps(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, eps)

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        """Biases on q/k/v and o_proj with `use_bias` (the config's attention_bias plays no part)."""
        bias = _use_bias(cfg)
        return Attention(dataclasses.replace(cfg, attention_bias=bias, o_proj_bias=bias), backend_cls, rotary)


def starcoder2_eps(cfg: ModelConfig) -> float:
    return float(cfg.raw.get("norm_epsilon") or 1e-5)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Starcoder2DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, starcoder2_eps(cfg))

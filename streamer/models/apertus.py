"""The Swiss AI Initiative's Apertus (ApertusForCausalLM: Apertus-8B, Apertus-70B, -Instruct-2509). The Llama
decoder with Apertus's differences:

- the MLP has no gate: down(xIELU(up(x))) (models/arcee.py's UpMLP). xIELU (arXiv 2411.13010) has learned scalars
  per layer, stored in the checkpoint as mlp.act_fn.alpha_p / alpha_n (pre-softplus) beside its constants beta and
  eps: with a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n),
  xielu(x) = a_p x^2 + beta x for x > 0, else (expm1(min(x, eps)) - x) a_n + beta x
  (computed in the weights' dtype, as transformers' Python path; beta and eps default to 0.5 and -1e-6 when a
  checkpoint leaves them out);
- per-head q/k RMSNorms before rotary (as Qwen3's);
- the two pre-norms are named attention_layernorm and feedforward_layernorm;
- Llama-3 rope scaling in the released configs (as Llama's), no biases by default (`attention_bias` on q/k/v/o).
Tensor parallelism splits up_proj by rows as Llama's gate/up; the xIELU scalars are whole on every rank.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.arcee import UNGATED_PACKED, ReLUSquared, UpMLP
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM, add_and_norm

XIELU_CONSTANTS = ("act_fn.beta", "act_fn.eps")  # (optional in a checkpoint: their defaults below)


class XIELU(nn.Module):
    def __init__(self, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(beta), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(eps), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


def apertus_activation(cfg: ModelConfig) -> nn.Module:
    act = cfg.raw.get("hidden_act", "xielu")
    if act == "xielu":
        return XIELU()
    if act == "relu2":
        return ReLUSquared()
    raise ValueError(f"Apertus with hidden_act={act!r} is not supported (xielu, relu2 are)")


class ApertusDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend_cls, rotary, qk_norm_cls=RMSNorm)
        self.mlp = UpMLP(cfg, apertus_activation(cfg))
        self.attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        h, residual = add_and_norm(self.attention_layernorm, x, residual)
        h = self.self_attn(positions, h, kv_cache, decode)
        h, residual = self.feedforward_layernorm(h, residual)
        return self.mlp(h), residual


class ApertusForCausalLM(LlamaForCausalLM):
    decoder_layer = ApertusDecoderLayer
    packed = UNGATED_PACKED

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        apertus_activation(cfg)  # (an unsupported activation fails before anything is built)
        super().__init__(cfg, backend_cls, max_positions)

    def expected_weights(self) -> set[str]:
        return {n for n in super().expected_weights() if not n.endswith(XIELU_CONSTANTS)}

"""Tencent's Hunyuan MoE (HunYuanMoEV1ForCausalLM, as transformers implements it: Hunyuan-A13B-Instruct's
architecture name). Llama's pre-norm decoder, with Hunyuan's differences:

- per-head q/k RMSNorms (`query_layernorm` / `key_layernorm`) applied *after* rotary, not before as Qwen3's;
- `attention_bias` puts biases on q/k/v and o_proj;
- rope scaling "dynamic" with a fixed `alpha` is NTK-alpha: plain rotary over the base theta * alpha ** (d / (d - 2))
  (d the head size), the same at every length;
- every MLP is sparse (models/moe.py) plus a shared dense SwiGLU (`shared_mlp`), both `intermediate_size` wide: the
  router (`gate.wg`, kept in fp32 as transformers builds it) softmaxes all experts in fp32, keeps the top `moe_topk`
  (an int, or one per layer), always renormalised, and scales the experts' outputs by those fp32 weights.

The attention and the NTK-alpha rotary are Hunyuan dense's (models/hunyuan_dense.py). Checkpoint names as transformers
writes them: `mlp.experts.E.{gate,up,down}_proj` (transformers 5's fused
`mlp.experts.gate_up_proj` / `down_proj` load too), `mlp.gate.wg.weight`, `mlp.shared_mlp.*`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.hunyuan_dense import HunYuanAttention, ntk_alpha_rope
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unfuse_experts


class HunyuanMoE(SparseMoE):
    """Softmax top-k routing in fp32, renormalised, plus the shared MLP."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        raw = cfg.raw
        experts = raw.get("num_experts", raw.get("num_local_experts", 1))
        top_k = raw.get("moe_topk", 1)
        if not isinstance(experts, int):
            raise ValueError(f"a per-layer num_experts ({experts!r}) is not supported (nor by transformers)")
        top_k = int(top_k if isinstance(top_k, int) else top_k[index])
        super().__init__(cfg.hidden_size, cfg.intermediate_size, experts, top_k, norm_topk_prob=True,
                         fp32_weights=True)
        self.gate.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size, dtype=torch.float32),
                                        requires_grad=False)
        self.shared_mlp = MLP(cfg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x.float(), self.gate.weight).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:  # (always, in transformers' Hunyuan)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_mlp(x)


class HunyuanDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = HunYuanAttention(cfg, backend_cls, rotary)
        self.mlp = HunyuanMoE(cfg, index)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HunYuanMoEV1ForCausalLM(LlamaForCausalLM):
    decoder_layer = HunyuanDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(ntk_alpha_rope(cfg), backend_cls, max_positions)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in unfuse_experts(weights):
            yield name.replace(".mlp.gate.wg.", ".mlp.gate."), t

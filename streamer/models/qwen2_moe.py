"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B and their -Chat / -Instruct versions). Qwen2's
decoder (q/k/v biases, `qkv_bias`, never on o_proj) with sparse MLPs (models/moe.py):

- the router softmaxes its logits over all `num_experts` and keeps the top `num_experts_per_tok`, renormalised only
  with `norm_topk_prob` (off in the released models), the weights cast to the model's dtype before they scale the
  experts' outputs;
- beside the routed experts every sparse layer has a shared expert (a SwiGLU of `shared_expert_intermediate_size`)
  whose output is scaled by sigmoid(shared_expert_gate(x)), one gate value per token;
- a layer is sparse when (index + 1) % `decoder_sparse_step` == 0 and it is not in `mlp_only_layers`; the others
  keep a dense MLP of `intermediate_size`;
- a sliding window applies only with `use_sliding_window`, on the `sliding_attention` layers of `layer_types` (by
  default the even layers below `max_window_layers`), as transformers does.

The Hub's checkpoints store one tensor per expert (`mlp.experts.E.{gate,up,down}_proj`); transformers 5's fused
layout (`mlp.experts.gate_up_proj` / `down_proj`) loads too (models/moe.unfuse_experts).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import RMSNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unfuse_experts


def qwen2_moe_sparse(raw: dict[str, Any], index: int) -> bool:
    """Whether layer `index` is sparse (transformers' Qwen2MoeDecoderLayer's rule, with its config's defaults)."""
    experts = int(raw.get("num_experts", 60) or 0)
    step = int(raw.get("decoder_sparse_step") or 1)
    return experts > 0 and index not in (raw.get("mlp_only_layers") or []) and (index + 1) % step == 0


def qwen2_moe_window(raw: dict[str, Any], index: int) -> Optional[int]:
    """Layer `index`'s sliding window: none unless `use_sliding_window`; then on `layer_types`' sliding layers."""
    if not raw.get("use_sliding_window"):
        return None
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 and i < int(raw.get("max_window_layers", 28)) else "full_attention"
        for i in range(index + 1)]
    return int(raw.get("sliding_window") or 4096) if types[index] == "sliding_attention" else None


class Qwen2MoeSparseMoE(SparseMoE):
    """Softmax top-k routing (renormalised with norm_topk_prob) plus a shared expert scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        super().__init__(cfg.hidden_size, int(raw.get("moe_intermediate_size", 1408)), int(raw.get("num_experts", 60)),
                         int(raw.get("num_experts_per_tok", 4)), bool(raw.get("norm_topk_prob", False)))
        self.shared_expert = MLP(cfg, int(raw.get("shared_expert_intermediate_size", 5632)))
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # (whole on every rank)
        self.shared_expert_gate.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Attention(cfg, backend_cls, rotary, sliding_window=qwen2_moe_window(cfg.raw, index))
        self.mlp: nn.Module = Qwen2MoeSparseMoE(cfg) if qwen2_moe_sparse(cfg.raw, index) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen2MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        # q/k/v biases unless qkv_bias says otherwise (older configs do not say: always), never on o_proj
        cfg = replace(cfg, attention_bias=bool(cfg.raw.get("qkv_bias", True)), o_proj_bias=False)
        super().__init__(cfg, backend_cls, max_positions)

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return unfuse_experts(weights)

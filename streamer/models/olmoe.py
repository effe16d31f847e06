"""AI2's OLMoE (OlmoeForCausalLM: OLMoE-1B-7B-0924, OLMoE-1B-7B-0125 and their -Instruct versions). Llama's
pre-norm decoder, with OLMoE's differences:

- q and k are RMS-normalised over the whole projection (all heads at once: q_norm of num_heads * head_dim, k_norm of
  num_kv_heads * head_dim), before rotary, as OLMo 2's are, but with Llama's norm (cast back, then the weight); so
  tensor parallelism, which splits the heads, is refused; with `clip_qkv` the normed q, k and v are clamped to
  [-clip_qkv, clip_qkv];
- `attention_bias` puts biases on q/k/v and o_proj;
- every MLP is sparse (models/moe.py): softmax over all `num_experts` router logits, top `num_experts_per_tok`,
  *not* renormalised (`norm_topk_prob` false in the released models), the weights cast to the model's dtype;
- rms_norm_eps defaults to 1e-5 (its registry entry's `defaults`, models/registry.py).

The Hub's checkpoints store one tensor per expert (`mlp.experts.E.{gate,up,down}_proj`); transformers 5's fused
layout loads too (models/moe.unfuse_experts).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.models.layers import ParallelContext, RMSNorm, RotaryEmbedding
from streamer.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unfuse_experts


class FlatRMSNorm(nn.Module):
    """RMSNorm of a [T, heads, head_dim] projection over all its heads at once (normalised in fp32, cast back, then
    scaled by the weight: transformers' OlmoeRMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * flat.to(x.dtype)).view(x.shape)


class OlmoeAttention(Attention):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding) -> None:
        if ParallelContext.size > 1:
            raise ValueError(f"OLMoE does not support tensor parallelism: "
                             f"{registry.entry('OlmoeForCausalLM').no_tensor_parallel}")
        super().__init__(cfg, backend_cls, rotary)
        self.q_norm = FlatRMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = FlatRMSNorm(self.kv_size, cfg.rms_norm_eps)
        clip = cfg.raw.get("clip_qkv")
        self.clip_qkv: Optional[float] = None if clip is None else float(clip)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                decode: Optional[DecodeBatch] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = self.rotary(positions, q, k)
        return self.attend(q, k, v, kv_cache, decode)


class OlmoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        raw = cfg.raw
        self.self_attn = OlmoeAttention(cfg, backend_cls, rotary)
        self.mlp = SparseMoE(cfg.hidden_size, cfg.intermediate_size, int(raw.get("num_experts", 64)),
                             int(raw.get("num_experts_per_tok", 8)), bool(raw.get("norm_topk_prob", False)))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class OlmoeForCausalLM(LlamaForCausalLM):
    decoder_layer = OlmoeDecoderLayer

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return unfuse_experts(weights)

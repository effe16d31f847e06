"""Microsoft's Phi-3.5-MoE (PhimoeForCausalLM: Phi-3.5-MoE-instruct), as transformers implements it. Llama's
decoder, with Phi-MoE's differences:

- LayerNorms (weight and bias, eps `rms_norm_eps`) where Llama has RMSNorms, the final norm included;
- `attention_bias` puts biases on q/k/v and o_proj, `lm_head_bias` one on the LM head (both set in Phi-3.5-MoE);
- rotary: with a "longrope" scaling, transformers' PhimoeRotaryEmbedding always rotates by the *short* factors,
  scaled by `short_mscale` (by `long_mscale` once a forward pass reaches past the original length: the released
  config gives both the same value; different ones are refused, since no per-sequence rule matches a per-batch one);
  so no LongRoPE switching here;
- every MLP is sparse (models/moe.py), routed by *sparsemixer* (eval mode) over the router's logits s, top 2 only:
  the first expert is argmax s, weighted by its softmax over the experts whose logit is within a relative
  2 * `router_jitter_noise` of the max (max - s_i <= 2 eps * max(|s_i|, max)); the second is the argmax of s with
  the first masked out, weighted the same way against that second max; weights in the model's dtype.

Checkpoint names: the Hub's `block_sparse_moe.gate` (router) and `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up,
down), as Mixtral's; transformers 5's `mlp.router.weight` and fused `mlp.experts.gate_up_proj` / `down_proj` too.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.config import ModelConfig
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import DecoderLayer, LlamaForCausalLM
from streamer.models.moe import SparseMoE, unfuse_experts


def sparsemixer_top2(scores: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' sparsemixer in eval mode: (weights [T, 2] in the scores' dtype, expert ids [T, 2])."""
    def pick(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        far = ((top - scores) / factor) > (2 * eps)
        return masked.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, idx), idx

    w1, first = pick(scores)
    w2, second = pick(scores.scatter(-1, first, float("-inf")))
    return torch.cat([w1, w2], dim=-1), torch.cat([first, second], dim=-1)


class PhimoeMoE(SparseMoE):
    def __init__(self, cfg: ModelConfig) -> None:
        raw = cfg.raw
        top_k = int(raw.get("num_experts_per_tok", 2))
        if top_k != 2:
            raise ValueError(f"PhimoeForCausalLM's sparsemixer routes to 2 experts (num_experts_per_tok {top_k})")
        super().__init__(cfg.hidden_size, cfg.intermediate_size, int(raw.get("num_local_experts", 16)), top_k,
                         norm_topk_prob=False)
        self.jitter_eps = float(raw.get("router_jitter_noise", 0.01))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sparsemixer_top2(F.linear(x, self.gate.weight), self.jitter_eps)


class PhimoeDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp = PhimoeMoE(cfg)
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)


def phimoe_rotary_table(cfg: ModelConfig, max_positions: int) -> Optional[torch.Tensor]:
    """The [max_positions, rotary_dim] cos/sin table transformers' PhimoeRotaryEmbedding rotates by under a longrope
    scaling (short factors, short_mscale); None without one."""
    s = cfg.rope_scaling
    if s is None:
        return None
    if s["rope_type"] not in ("longrope", "su"):
        raise ValueError(f"PhimoeForCausalLM with rope scaling {s['rope_type']!r} is not supported (longrope is)")
    short, long = float(s["short_mscale"]), float(s["long_mscale"])
    if short != long:
        raise ValueError(f"PhimoeForCausalLM with short_mscale {short} != long_mscale {long} is not supported")
    dim = cfg.rotary_dim
    factors = torch.tensor(s["short_factor"], dtype=torch.float32)
    if factors.numel() != dim // 2:
        raise ValueError(f"longrope short_factor has {factors.numel()} entries, expected {dim // 2}")
    inv_freq = 1.0 / (factors * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * short


class PhimoeForCausalLM(LlamaForCausalLM):
    decoder_layer = PhimoeDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        table = phimoe_rotary_table(cfg, max_positions)
        head_bias = bool(cfg.raw.get("lm_head_bias", False))
        if head_bias and cfg.tie_word_embeddings:
            raise ValueError("PhimoeForCausalLM with lm_head_bias and a tied LM head is not supported")
        super().__init__(replace(cfg, rope_scaling=None), backend_cls, max_positions)
        self.cfg = cfg
        if table is not None:  # (one rotary, shared by every layer)
            self.own_layers()[0].self_attn.rotary.cos_sin_cache.copy_(table)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if head_bias and self.lm_head is not None:  # (loaded as the checkpoint's lm_head.bias, whole on every rank)
            self.lm_head.bias = nn.Parameter(torch.zeros(cfg.vocab_size), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        bias = getattr(self.lm_head, "bias", None)
        return logits if bias is None else logits + bias.float()

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in unfuse_experts(weights):
            yield name.replace(".mlp.router.", ".mlp.gate."), t

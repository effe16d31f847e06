"""Gemma 3 (text: Gemma3ForCausalLM, e.g. gemma-3-1b-it) and Gemma 2 (Gemma2ForCausalLM, a subclass that flips
Gemma 3's class-level switches). The Llama decoder's parts, with Gemma's differences:

- RMSNorm scales by (1 + w), computed in fp32 before the cast, and there are four per layer: the attention and
  MLP outputs are normalised again before they join the residual stream;
- q and k are RMS-normalised per head (Gemma 3 only); scores are scaled by query_pre_attn_scalar ** -0.5 and,
  with `attn_logit_softcapping` (Gemma 2), soft-capped: tanh(s / cap) * cap before the softmax;
- layers alternate: most attend within a sliding window, every sixth (Gemma 3) or every second (Gemma 2) attends
  globally (`layer_types` when the config has them); Gemma 3's sliding layers rotate with base
  `rope_local_base_freq`, its global ones with `rope_theta` (and the rope scaling, if any); Gemma 2 has one
  rotary table for all layers;
- embeddings are multiplied by sqrt(hidden_size) (rounded to the weights' dtype, as transformers does); the MLP
  gates with tanh-approximated GELU; the LM head is tied; final logits may be soft-capped;
- `use_bidirectional_attention` (EmbeddingGemma, `Gemma3TextModel`): an encoder, every token seeing its whole
  prompt and the sliding layers a window either way (|distance| <= sliding_window // 2); it embeds, with the
  sentence-transformers Dense modules of its checkpoint after the pooling (pooling.DenseProjection).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig, rope_scaling
from streamer.models.layers import ColumnParallelLinear, RotaryEmbedding, RowParallelLinear, VocabEmbedding
from streamer.models.llama import Attention, LlamaForCausalLM, add_and_norm


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32, then cast (Llama's norm casts before scaling). With `residual`, adds it
    first and returns (normed, sum), as the Llama decoder's fused add-and-norm does."""

    offset = 1.0  # (OLMo 2's norm is this one with a plain weight: models/olmo2.py)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((size,), 1.0 - self.offset), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (self.offset + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


def gemma_layer_types(raw: dict[str, Any], num_layers: int, default_pattern: int) -> list[str]:
    """Each layer's kind: the config's `layer_types`, else every `pattern`-th layer global (the 1st is sliding)."""
    types = raw.get("layer_types")
    if types:
        return list(types)
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or default_pattern
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _rope_params(raw: dict[str, Any], default_theta: float) -> tuple[float, Optional[dict[str, Any]], float]:
    """(global theta, global scaling, local theta), from transformers-5 `rope_parameters` (per layer type, or one
    set for all layers as Gemma 2's) or the older keys."""
    params = raw.get("rope_parameters") or {}
    per_type = "full_attention" in params or "sliding_attention" in params
    full = dict((params.get("full_attention") if per_type else params) or {})
    local = params.get("sliding_attention") or {}
    theta = float(full.get("rope_theta", raw.get("rope_theta", default_theta)))
    local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))
    scaling = rope_scaling(raw.get("rope_scaling"), full)
    if scaling is not None:
        scaling.pop("rope_theta", None)
    return theta, scaling, local_theta


class GemmaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        act = cfg.raw.get("hidden_activation") or cfg.raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma with hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                 shard_names=["gate", "up"])
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, sliding_window: Optional[int], qk_norm: bool,
                 two_sided: bool = False) -> None:
        """`two_sided`: the window reaches both ways (EmbeddingGemma's bidirectional sliding layers)."""
        super().__init__()
        scale = float(cfg.raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        self.self_attn = Attention(cfg, backend_cls, rotary, scale=scale, sliding_window=sliding_window,
                                   qk_norm_cls=GemmaRMSNorm if qk_norm else None,
                                   logit_softcap=cfg.raw.get("attn_logit_softcapping") or None,
                                   two_sided_window=two_sided and sliding_window is not None)
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Returns (branch, stream), not yet added: the next norm adds them.
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, kv_cache, decode))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    # What Gemma 2 (the subclass below) sets differently.
    qk_norm = True  # per-head q/k RMSNorms
    default_pattern = 6  # without `layer_types`, every 6th layer is global
    default_theta = 1_000_000.0
    local_rope = True  # sliding layers have their own rotary base (rope_local_base_freq)

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        raw = cfg.raw
        # EmbeddingGemma: an encoder (models/bert.py says how one is served), its sliding layers' windows both ways
        self.bidirectional = bool(raw.get("use_bidirectional_attention"))
        theta, scaling, local_theta = _rope_params(raw, self.default_theta)
        full = RotaryEmbedding(cfg.rotary_dim, max_positions, theta, scaling)
        local = RotaryEmbedding(cfg.rotary_dim, max_positions, local_theta, None) if self.local_rope else full
        window = raw.get("sliding_window")
        if self.bidirectional and window:  # (config.json's is the span both ways: keys within window // 2 either way,
            window = window // 2 + 1       # as transformers' Gemma3TextConfig reads it)
        types = gemma_layer_types(raw, cfg.num_layers, self.default_pattern)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, backend_cls, local if t == "sliding_attention" else full,
                              window if t == "sliding_attention" else None, self.qk_norm, self.bidirectional)
            for t in types)
        self.two_sided_window = window if self.bidirectional and "sliding_attention" in types else 0
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.softcap = raw.get("final_logit_softcapping")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the dtype first, as transformers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: no q/k norms, every other layer global (the first slides), one rotary table; its attention
    soft-capping comes from the config (`attn_logit_softcapping`, read for Gemma 3 too)."""

    qk_norm = False
    default_pattern = 2
    default_theta = 10_000.0
    local_rope = False

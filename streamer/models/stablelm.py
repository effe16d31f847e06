"""StableLM (StableLmForCausalLM: stabilityai/stablelm-3b-4e1t, stablelm-2-1_6b, stablelm-2-12b, stablelm-zephyr-3b
and their chat tunes). Llama's decoder (GQA, the SiLU-gated MLP, an untied head, Llama's names), with StableLM's
differences:

- LayerNorm with a bias (eps `layer_norm_eps`), not RMSNorm;
- partial rotary: only the first `partial_rotary_factor` (0.25 by default) of each head rotates, Llama's
  rotate-halves layout within that part;
- `use_qkv_bias` (StableLM 2 1.6B): biases on q, k and v; o_proj never has one;
- `qk_layernorm` (StableLM 2 12B): q and k LayerNorm-ed per head before rotary, each head its own weight and no
  bias (checkpoint `q_layernorm.norms.{h}.weight`, stacked here into [heads, head_dim], split over
  tensor-parallel ranks with the heads);
- `use_parallel_residual` (StableLM 2 12B): x + attn(ln(x)) + mlp(ln(x)), one norm a layer
  (models/gpt_neox.py ParallelResidualLayer); off, Llama's sequential order with two norms.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec
from streamer.models.cohere import head_rows_loader
from streamer.models.config import ModelConfig
from streamer.models.gpt_neox import ParallelResidualLayer, layer_norm_eps
from streamer.models.layers import LayerNorm, RotaryEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM


class PerHeadLayerNorm(nn.Module):
    """LayerNorm over each head's dims of [T, heads, size], each head its own weight ([heads, size]), no bias."""

    def __init__(self, size: int, heads: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, size), requires_grad=False)
        self.weight.weight_loader = head_rows_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], None, None, self.eps) * self.weight


class StableLmDecoderLayer(ParallelResidualLayer):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        act = cfg.raw.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"StableLM with hidden_act {act!r} is not supported (silu is)")
        raw, eps = cfg.raw, layer_norm_eps(cfg)
        bias = bool(raw.get("use_qkv_bias", False))
        self.self_attn = Attention(dataclasses.replace(cfg, attention_bias=bias, o_proj_bias=False, qk_norm=False),
                                   backend_cls, rotary)
        if raw.get("qk_layernorm"):
            attn = self.self_attn
            attn.q_norm = PerHeadLayerNorm(cfg.head_dim, attn.num_heads, eps)
            attn.k_norm = PerHeadLayerNorm(cfg.head_dim, attn.num_kv_heads, eps)
        self.mlp = MLP(cfg)
        self.parallel = bool(raw.get("use_parallel_residual", False))
        self.input_layernorm = LayerNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = None if self.parallel else LayerNorm(cfg.hidden_size, eps)


_HEAD_NORM = re.compile(r"(.*\.self_attn)\.([qk])_layernorm\.norms\.(\d+)\.weight$")


class StableLmForCausalLM(LlamaForCausalLM):
    decoder_layer = StableLmDecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.head_dim * cfg.num_heads != cfg.hidden_size:  # (as transformers computes it)
            raise ValueError(f"StableLM head_dim {cfg.head_dim} is not hidden_size / num_attention_heads")
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, layer_norm_eps(cfg))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The per-head q/k norm weights (one tensor per head) stacked into one [heads, head_dim] tensor per layer,
        yielded once every head's has come (a head missing leaves the layer's norm missing: the load fails)."""
        pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, t in weights:
            m = _HEAD_NORM.match(name)
            if m is None:
                yield name, t
                continue
            prefix, kind, head = m.group(1), m.group(2), int(m.group(3))
            heads = self.cfg.num_heads if kind == "q" else self.cfg.num_kv_heads
            got = pending.setdefault((prefix, kind), {})
            got[head] = t
            if len(got) == heads:
                del pending[(prefix, kind)]
                ordered = [got[h] for h in range(heads)] if set(got) == set(range(heads)) else None
                if ordered is None:
                    raise ValueError(f"{prefix}.{kind}_layernorm: head indices {sorted(got)} (expected 0..{heads - 1})")
                stacked = ordered[0] if not isinstance(ordered[0], torch.Tensor) else torch.stack(ordered)
                yield f"{prefix}.{kind}_norm.weight", stacked

    def checkpoint_name(self, internal: str) -> str:
        name = super().checkpoint_name(internal)
        return re.sub(r"\.self_attn\.([qk])_norm\.weight$", r".self_attn.\1_layernorm.norms.*.weight", name)

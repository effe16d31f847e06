"""Cohere's Command models: CohereForCausalLM (Command-R, Command-R+, Aya-23, Aya Expanse) and Cohere2ForCausalLM
(Command R7B, Command A, Aya Vision's text model). The Llama decoder's parts, with Cohere's differences:

- LayerNorm (mean subtracted, a weight and no bias, in fp32 before the cast), not RMSNorm; eps `layer_norm_eps`;
- one norm a layer: attention and the (SiLU-gated) MLP both read it, in parallel, and both outputs join the residual
  stream (x + attn(ln(x)) + mlp(ln(x)));
- rotary in GPT-J's interleaved layout (dims 2i and 2i + 1 rotate together);
- logits are multiplied by `logit_scale` (0.0625 by default); the LM head is tied to the embeddings;
- Cohere with `use_qk_norm` (Command-R+): q and k are LayerNorm-ed per head before rotary, with a weight per head
  ([heads, head_dim]: split over tensor-parallel ranks with the heads);
- Cohere2: layers are sliding-window layers (rotary) or global layers without any position encoding (NoPE), by
  `layer_types`, else every `sliding_window_pattern`-th (4) layer global; no q/k norms; head_dim is always
  hidden_size / num_heads.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from streamer.attention.base import AttentionBackend, AttentionSpec, DecodeBatch
from streamer.models.config import ModelConfig
from streamer.models.gemma3 import gemma_layer_types
from streamer.models.layers import ParallelContext, RotaryEmbedding
from streamer.models.llama import MLP, Attention, LlamaForCausalLM, add_and_norm


def head_rows_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard: Any = None) -> None:
    """This rank's heads of a per-head [heads, head_dim] weight: a slice of the checkpoint's heads, or, when there
    are fewer heads than ranks (replicated kv heads, as the k/v projections), the one head this rank holds."""
    local, total = param.shape[0], loaded.shape[0]
    tp, rank = ParallelContext.size, ParallelContext.rank
    split = total == local * tp
    if loaded.shape[1:] != param.shape[1:] or not (split or (local == 1 and total and tp % total == 0)):
        raise ValueError(f"tensor {name!r} has shape {tuple(loaded.shape)}, expected "
                         f"{(local * tp, *param.shape[1:])}")
    first = rank * local if split else rank // (tp // total)
    param.data.copy_(loaded[first:first + local])


class CohereLayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * w over the last dim, in fp32, then cast; no bias. `heads`: a weight per head
    ([heads, size], for [T, heads, size] inputs: Cohere's q/k norms). With `residual`, adds it first and returns
    (normed, sum), as the Llama decoder's fused add-and-norm does."""

    def __init__(self, size: int, eps: float, heads: Optional[int] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size if heads is None else (heads, size)), requires_grad=False)
        if heads is not None:
            self.weight.weight_loader = head_rows_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        out = (self.weight.float() * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)
        return out if residual is None else (out, residual)


def layer_norm_eps(cfg: ModelConfig) -> float:
    return float(cfg.raw.get("layer_norm_eps") or 1e-5)


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        act = cfg.raw.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"{cfg.architecture} with hidden_act {act!r} is not supported (silu is)")
        self.self_attn = self.make_attention(cfg, backend_cls, rotary, index)
        self.mlp = MLP(cfg)
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, layer_norm_eps(cfg))

    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        attn = Attention(cfg, backend_cls, rotary)
        if cfg.raw.get("use_qk_norm"):  # per-head LayerNorms (each head its own weight) before rotary
            attn.q_norm = CohereLayerNorm(cfg.head_dim, layer_norm_eps(cfg), heads=attn.num_heads)
            attn.k_norm = CohereLayerNorm(cfg.head_dim, layer_norm_eps(cfg), heads=attn.num_kv_heads)
        return attn

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, decode: Optional[DecodeBatch] = None):
        # Returns (branch, stream), not yet added: the next norm adds them, (stream + attn) + mlp as transformers.
        h, residual = add_and_norm(self.input_layernorm, x, residual)
        attn = self.self_attn(positions, h, kv_cache, decode)
        return self.mlp(h), residual + attn


class CohereForCausalLM(LlamaForCausalLM):
    decoder_layer: type[nn.Module] = CohereDecoderLayer
    rope_is_neox = False  # GPT-J's interleaved pairs

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        self.norm = CohereLayerNorm(cfg.hidden_size, layer_norm_eps(cfg))
        scale = cfg.raw.get("logit_scale", 0.0625)
        self.logit_scale = 1.0 if scale is None else float(scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale


class Cohere2DecoderLayer(CohereDecoderLayer):
    def make_attention(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                       rotary: RotaryEmbedding, index: int) -> Attention:
        """Sliding-window layers rotate q and k; global layers attend to everything, without rotary."""
        sliding = cohere2_layer_types(cfg)[index] == "sliding_attention"
        window = cohere2_window(cfg)
        return Attention(cfg, backend_cls, rotary, sliding_window=window if sliding else None, use_rope=sliding)


def cohere2_window(cfg: ModelConfig) -> int:
    window = cfg.raw.get("sliding_window", 4096)  # (Cohere2Config's default)
    if window is None:
        raise ValueError("Cohere2 without a sliding_window is not supported")
    return int(window)


def cohere2_layer_types(cfg: ModelConfig) -> list[str]:
    types = gemma_layer_types(cfg.raw, cfg.num_layers, default_pattern=4)
    if len(types) < cfg.num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"Cohere2 layer_types must give sliding_attention or full_attention for each of the "
                         f"{cfg.num_layers} layers (got {types})")
    return types[:cfg.num_layers]


class Cohere2ForCausalLM(CohereForCausalLM):
    decoder_layer = Cohere2DecoderLayer

    def __init__(self, cfg: ModelConfig, backend_cls: Callable[[AttentionSpec], AttentionBackend],
                 max_positions: int) -> None:
        if cfg.head_dim != cfg.hidden_size // cfg.num_heads:  # (Cohere2Config sets it so, whatever config.json says)
            raise ValueError(f"Cohere2 head_dim {cfg.head_dim} is not hidden_size / num_attention_heads "
                             f"({cfg.hidden_size // cfg.num_heads}), as transformers computes it")
        cohere2_window(cfg)
        super().__init__(cfg, backend_cls, max_positions)

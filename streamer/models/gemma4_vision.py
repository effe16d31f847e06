"""Gemma 4's vision encoder (transformers' Gemma4VisionModel) and its projection into the text model (embed_vision).

An image comes as patches at its own size (streamer/multimodal/processors/gemma4_image_processor.py). Each patch's pixels (rescaled to
[-1, 1]) are projected, plus learned x and y position embeddings; encoder layers as Gemma 4's text layers (plain-w
RMSNorms, four a layer, q / k / v norms, unscaled scores) attend over the whole image, their q and k rotated in two
halves: the first by the patch's column, the second by its row. The pooler averages each k x k square of patches into
one token, times sqrt(hidden), optionally standardized; embed_vision normalizes (no weight) and projects.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.gemma4 import Gemma4RMSNorm, rms_norm_unscaled
from streamer.models.vision import copy_into_params


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [N, H, D] by cos / sin [N, D] (whole width: each half's angle repeated)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output may be clamped to ranges stored with the checkpoint."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name, value in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                setattr(self, name, nn.Parameter(torch.tensor(value * float("inf")), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


class VisionLayer(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 clipped: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        attn = nn.Module()
        attn.q_proj = ClippableLinear(hidden, heads * head_dim, clipped)
        attn.k_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        attn.v_proj = ClippableLinear(hidden, kv_heads * head_dim, clipped)
        attn.o_proj = ClippableLinear(heads * head_dim, hidden, clipped)
        attn.q_norm = Gemma4RMSNorm(head_dim, eps)
        attn.k_norm = Gemma4RMSNorm(head_dim, eps)
        self.self_attn = attn
        mlp = nn.Module()
        mlp.gate_proj = ClippableLinear(hidden, inter, clipped)
        mlp.up_proj = ClippableLinear(hidden, inter, clipped)
        mlp.down_proj = ClippableLinear(inter, hidden, clipped)
        self.mlp = mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(hidden, eps))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, n = self.self_attn, x.shape[0]
        q = a.q_norm(a.q_proj(x).view(n, self.heads, self.head_dim))
        k = a.k_norm(a.k_proj(x).view(n, self.kv_heads, self.head_dim))
        v = rms_norm_unscaled(a.v_proj(x).view(n, self.kv_heads, self.head_dim), self.eps)
        half = self.head_dim // 2  # (the first half turns with the column, the second with the row)
        q = torch.cat([_rotate_halves(part, c, s) for part, c, s in zip(q.split(half, -1), cos, sin)], dim=-1)
        k = torch.cat([_rotate_halves(part, c, s) for part, c, s in zip(k.split(half, -1), cos, sin)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0,
                                             enable_gqa=self.heads != self.kv_heads)
        return a.o_proj(out.transpose(0, 1).reshape(n, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.attention(self.input_layernorm(x), cos, sin))
        m = self.mlp
        h = self.pre_feedforward_layernorm(x)
        h = m.down_proj(F.gelu(m.gate_proj(h), approximate="tanh") * m.up_proj(h))
        return x + self.post_feedforward_layernorm(h)


class Gemma4VisionTower(nn.Module):
    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        act = vc.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"Gemma 4's vision encoder with hidden_activation {act!r} is not supported")
        self.hidden = int(vc.get("hidden_size", 768))
        self.intermediate = int(vc.get("intermediate_size", 3072))
        heads = int(vc.get("num_attention_heads", 12))
        head_dim = int(vc.get("head_dim") or self.hidden // heads)
        self.patch = int(vc.get("patch_size", 16))
        self.pool = int(vc.get("pooling_kernel_size", 3))
        self.eps = float(vc.get("rms_norm_eps", 1e-6))
        rope = vc.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4's vision encoder supports axial rotary only, got {rope.get('rope_type')!r}")
        theta = float(rope.get("rope_theta", 100.0))
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** quarter, persistent=False)
        self.patch_embedder = nn.Module()
        self.patch_embedder.input_proj = nn.Linear(3 * self.patch ** 2, self.hidden, bias=False)
        self.patch_embedder.position_embedding_table = nn.Parameter(
            torch.empty(2, int(vc.get("position_embedding_size", 10240)), self.hidden), requires_grad=False)
        clipped = bool(vc.get("use_clipped_linears", False))
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            VisionLayer(self.hidden, self.intermediate, heads, int(vc.get("num_key_value_heads") or heads), head_dim,
                        self.eps, clipped) for _ in range(int(vc.get("num_hidden_layers", 16))))
        self.standardize = bool(vc.get("standardize", False))
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(self.hidden), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(self.hidden), requires_grad=False)
        self.requires_grad_(False)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [rows * cols, patch^2 * 3] -> its tokens [rows * cols / pool^2, hidden] (row by row
        of the pooled grid), in the weights' dtype."""
        _, rows, cols = grid
        dtype, dev = self.patch_embedder.input_proj.weight.dtype, patches.device
        y, x = torch.meshgrid(torch.arange(rows, device=dev), torch.arange(cols, device=dev), indexing="ij")
        x, y = x.reshape(-1), y.reshape(-1)
        table = self.patch_embedder.position_embedding_table
        h = self.patch_embedder.input_proj((2 * (patches - 0.5)).to(dtype)) + table[0][x] + table[1][y]
        cos, sin = [], []
        for pos in (x, y):  # (angles in fp32, then the activations' dtype, as transformers)
            freqs = pos[:, None].float() * self.inv_freq
            angles = torch.cat([freqs, freqs], dim=-1)
            cos.append(angles.cos().to(dtype))
            sin.append(angles.sin().to(dtype))
        for layer in self.encoder.layers:
            h = layer(h, cos, sin)
        k = self.pool
        grid_h = h.view(rows, cols, -1).permute(2, 0, 1).float()
        pooled = F.avg_pool2d(grid_h, k, k).flatten(1).T.to(h.dtype)  # [tokens, hidden]
        pooled = pooled.float() * self.hidden ** 0.5
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_into_params(dict(self.named_parameters()), weights, "model.vision_tower.")


class Gemma4VisionEmbedder(nn.Module):
    """embed_vision: the encoder's tokens RMS-normalized (no weight), projected to the text model's width."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, _: Optional[Any] = None) -> torch.Tensor:
        return self.embedding_projection(rms_norm_unscaled(x, self.eps))

"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision encoders, as transformers' Qwen2VisionTransformerPretrainedModel /
Qwen2_5_VisionTransformerPretrainedModel / Qwen3VLVisionModel compute them, up to the merged embeddings (their
pooler_output, what get_image_features hands the language model).

Images come at their own resolution: the image processor cuts each one into patches (already flattened, in
merge-block order) and reports its grid (t, h, w) in patches. The tower embeds the patches, runs ViT blocks with a
2-D rotary embedding (row and column of each patch) and merges each merge_size x merge_size block of patches into
one token. Attention never crosses an image (or a video frame). Qwen2.5-VL runs most blocks on windows of
window_size pixels instead: its sequence is permuted so that each window is contiguous (window_index), and put
back in image order after the merger. Qwen3-VL adds a learned absolute position embedding (a square table,
bilinearly resampled to each image's grid) to the patch embeddings, uses LayerNorm blocks with a plain MLP and no
windows, and taps some blocks' outputs (deepstack_visual_indexes) through patch mergers of their own: those
DeepStack features follow the merged embeddings on each output row (models/vlm.py adds them to the language
model's hidden states at the image tokens after its first decoder layers).

Attention runs as SDPA over segments (images, frames or windows): segments of equal length are stacked into one
batched call, so a big image costs a handful of calls per layer, never one per window, and no mask is built.
Like streamer/models/vision.py, the linears are plain modules, not PackableLinear.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.vision import ACTIVATIONS, MLP, LayerNorm, Linear, _copy, _holder, _param

VERSIONS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# transformers' Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults: real configs leave fields out.
# tests/test_qwen_vision.py checks these against the config classes. (Checkpoints spell the channel count
# "in_chans", which transformers ignores: in_channels stays 3.)
QWEN_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu", mlp_ratio=4, num_heads=16,
                     in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=4,
                       window_size=112, out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31)),
    "qwen3_vl": dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                     in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                     num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
}
ROPE_THETA = 10000.0  # the vision configs' rope_parameters["rope_theta"] default
_ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}  # transformers' attribute_map


@dataclass(frozen=True)
class QwenVisionSpec:
    """The tower's shape, from a vision_config dict completed with QWEN_VISION_DEFAULTS."""

    version: str
    width: int  # the ViT's hidden size (Qwen2-VL: embed_dim; 2.5: hidden_size)
    out_hidden: int  # the merger's output (Qwen2-VL: hidden_size; 2.5: out_hidden_size)
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int  # pixels; 2.5 only
    fullatt_blocks: frozenset[int]  # 2.5 only: the blocks attending to the whole image
    rope_theta: float
    num_position_embeddings: int = 0  # Qwen3-VL: the learned position table's rows (a square grid)
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: deepstack_visual_indexes, the block each DeepStack merger reads

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_config(cls, vision_config: dict[str, Any], version: str) -> QwenVisionSpec:
        if version not in VERSIONS:
            raise ValueError(f"unsupported Qwen vision version {version!r}; supported: {VERSIONS}")
        given = {_ALIASES.get(k, k): v for k, v in vision_config.items() if v is not None}
        c = {**QWEN_VISION_DEFAULTS[version], **given}
        qwen2, qwen3 = version == "qwen2_vl", version == "qwen3_vl"
        width = c["embed_dim"] if qwen2 else c["hidden_size"]
        for key in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
            if not isinstance(c[key], int):
                raise ValueError(f"vision {key} must be an int, got {c[key]!r}")
        if c["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {c['hidden_act']!r}; supported: {sorted(ACTIVATIONS)}")
        if width % c["num_heads"] or (width // c["num_heads"]) % 4:
            raise ValueError(f"vision width {width} with {c['num_heads']} heads: the head dim must be a multiple "
                             "of 4 (the rotary embedding splits it between rows and columns)")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"unsupported vision rope_type {rope.get('rope_type')!r} (only axial)")
        # (as transformers: a merger per entry; an entry naming no block, or a block named twice, taps nothing more)
        deepstack = tuple(int(i) for i in c.get("deepstack_visual_indexes", ())) if qwen3 else ()
        side = math.isqrt(c["num_position_embeddings"]) if qwen3 else 0
        if qwen3 and (side < 2 or side * side != c["num_position_embeddings"]):
            raise ValueError(f"num_position_embeddings {c['num_position_embeddings']} must be a square (of a side "
                             "of 2 or more)")
        return cls(
            version=version, width=width, out_hidden=c["hidden_size"] if qwen2 else c["out_hidden_size"],
            depth=c["depth"], num_heads=c["num_heads"],
            mlp_hidden=int(width * c["mlp_ratio"]) if qwen2 else c["intermediate_size"],
            act=c["hidden_act"], in_channels=c["in_channels"], patch_size=c["patch_size"],
            temporal_patch_size=c["temporal_patch_size"], merge_size=c["spatial_merge_size"],
            window_size=c["window_size"] if version == "qwen2_5_vl" else 0,
            fullatt_blocks=frozenset(c["fullatt_block_indexes"]) if version == "qwen2_5_vl" else frozenset(),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", ROPE_THETA))),
            num_position_embeddings=c["num_position_embeddings"] if qwen3 else 0, deepstack=deepstack,
        )


class RMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm: normalised in fp32, cast back, then scaled (in that order, for the same rounding)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(spec: QwenVisionSpec, size: int) -> nn.Module:
    return RMSNorm(size) if spec.version == "qwen2_5_vl" else LayerNorm(size, 1e-6)


class _Segments:
    """Where attention may look: the sequence cut at cu_seqlens, each piece attending to itself only. Pieces of
    equal length are gathered into one batched SDPA call."""

    def __init__(self, cu_seqlens: list[int], device: torch.device) -> None:
        by_length: dict[int, list[int]] = {}
        for start, end in itertools.pairwise(cu_seqlens):
            if end > start:
                by_length.setdefault(end - start, []).append(start)
        self.whole = len(by_length) == 1 and len(next(iter(by_length.values()))) == 1  # one piece: no gather
        self.groups = [torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
                       for length, starts in by_length.items()]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q, k, v [N, heads, head_dim] -> [N, heads, head_dim]."""
        if self.whole:
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), scale=scale)
            return out[0].transpose(0, 1)
        out = torch.empty_like(q)
        for idx in self.groups:  # idx [pieces, length]
            o = F.scaled_dot_product_attention(*(t[idx].transpose(1, 2) for t in (q, k, v)), scale=scale)
            out[idx] = o.transpose(1, 2)
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # transformers' apply_rotary_pos_emb_vision: in fp32 whatever the model dtype, cast back after.
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.qkv = Linear(spec.width, 3 * spec.width)
        self.proj = Linear(spec.width, spec.width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        out = segments.attend(_rope(q, cos, sin), _rope(k, cos, sin), v, self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.gate_proj = Linear(spec.width, spec.mlp_hidden)
        self.up_proj = Linear(spec.width, spec.mlp_hidden)
        self.down_proj = Linear(spec.mlp_hidden, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MLP(nn.Module):
    """Qwen3-VL's linear_fc2(act(linear_fc1(x))), with biases."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.linear_fc1 = Linear(spec.width, spec.mlp_hidden)
        self.linear_fc2 = Linear(spec.mlp_hidden, spec.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.norm1 = _norm(spec, spec.width)
        self.norm2 = _norm(spec, spec.width)
        self.attn = Attention(spec)
        self.mlp = MLP(spec.width, spec.mlp_hidden, spec.act) if spec.version == "qwen2_vl" else \
            GatedMLP(spec) if spec.version == "qwen2_5_vl" else Qwen3MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then each merge block's merge_size**2 consecutive patches concatenated and sent through a 2-layer MLP
    (exact GELU). mlp is a Sequential so that its linears are named mlp.0 / mlp.2, as in the checkpoint."""

    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.merged = spec.width * spec.merge_size ** 2
        self.ln_q = _norm(spec, spec.width)
        self.mlp = nn.Sequential(Linear(self.merged, self.merged), nn.GELU(), Linear(self.merged, spec.out_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm over each patch (the main merger) or over the merge block's concatenated
    patches (postshuffle: the DeepStack mergers), then linear_fc1, exact GELU, linear_fc2."""

    def __init__(self, spec: QwenVisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.merged = spec.width * spec.merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = LayerNorm(self.merged if postshuffle else spec.width, 1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged)
        self.linear_fc2 = Linear(self.merged, spec.out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, spec: QwenVisionSpec) -> None:
        super().__init__()
        self.proj = nn.Module()  # holds the checkpoint's Conv3d weight (and Qwen3-VL's bias), in its shape
        self.proj.register_parameter("weight", _param(spec.width, spec.in_channels, spec.temporal_patch_size,
                                                      spec.patch_size, spec.patch_size))
        self.proj.register_parameter("bias", _param(spec.width) if spec.version == "qwen3_vl" else None)
        self.conv: bool | None = None  # None: by device (tests force either path)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w, b = self.proj.weight, self.proj.bias
        patches = patches.to(device=w.device, dtype=w.dtype)
        # The conv's stride is its kernel, so it is one matmul over the flattened patch. On the CPU the Conv3d is
        # kept: it gives transformers' bits. Elsewhere the linear (the same sum, rounded differently): cuDNN's
        # Conv3d is slow at this shape.
        if self.conv if self.conv is not None else w.device.type == "cpu":
            x = patches.view(-1, *w.shape[1:])
            return F.conv3d(x, w, b, stride=w.shape[2:]).view(x.shape[0], -1)
        return F.linear(patches, w.flatten(1), b)


class QwenVisionTower(nn.Module):
    def __init__(self, vision_config: dict[str, Any], version: str) -> None:
        super().__init__()
        spec = QwenVisionSpec.from_config(vision_config, version)
        self.spec = spec
        self.spatial_merge_size = spec.merge_size
        self.patch_embed = _PatchEmbed(spec)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.depth))
        if spec.version == "qwen3_vl":
            self.pos_embed = _holder(_param(spec.num_position_embeddings, spec.width))
            self.merger: nn.Module = Qwen3PatchMerger(spec, postshuffle=False)
            self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(spec, postshuffle=True)
                                                       for _ in spec.deepstack)
        else:
            self.merger = PatchMerger(spec)
        # Rotary frequencies as transformers computes them (fp32, on the CPU); not a buffer, so not a weight.
        quarter = spec.head_dim // 2
        self._inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    @property
    def out_hidden(self) -> int:
        return self.spec.out_hidden

    @property
    def num_deepstack(self) -> int:
        """Qwen3-VL: the DeepStack feature sets that follow the merged embeddings on each output row."""
        return len({i for i in self.spec.deepstack if 0 <= i < self.spec.depth})

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [total_patches, C * T * P * P] (all images' patches, concatenated), grid_thw [N, 3]
        -> [total_patches // merge_size**2, out_hidden], the images' merged tokens in order. Qwen3-VL:
        [.., out_hidden * (1 + num_deepstack)], each row its merged embedding then its DeepStack features in
        deepstack order (what the language model adds after its decoder layers 0, 1, ...)."""
        grid = self._check(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        device = x.device
        if self.spec.version == "qwen3_vl":
            return self._forward_qwen3(x, grid)
        cos, sin = self._rotary(grid, device)
        frames = _Segments(_cumsum([h * w for t, h, w in grid for _ in range(t)]), device)
        windows, window_index = frames, None
        if self.spec.version == "qwen2_5_vl":
            window_index, cu_windows = self._window_index(grid)
            window_index = window_index.to(device)
            x, cos, sin = (self._to_windows(a, window_index) for a in (x, cos, sin))
            windows = _Segments(cu_windows, device)
        for i, block in enumerate(self.blocks):
            full = self.spec.version == "qwen2_vl" or i in self.spec.fullatt_blocks
            x = block(x, cos, sin, frames if full else windows)
        x = self.merger(x)
        if window_index is not None:  # back to image order: the inverse permutation
            inverse = torch.empty_like(window_index)
            inverse[window_index] = torch.arange(len(window_index), device=device)
            x = x[inverse]
        return x

    def _forward_qwen3(self, x: torch.Tensor, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        idx, weights = self._position_taps(grid, x.device)
        pos = (F.embedding(idx, self.pos_embed.weight) * weights[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self._rotary(grid, x.device)
        frames = _Segments(_cumsum([h * w for t, h, w in grid for _ in range(t)]), x.device)
        taps: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.spec.deepstack:  # (in block order, as transformers collects them)
                taps.append(self.deepstack_merger_list[self.spec.deepstack.index(i)](x))
        return torch.cat([self.merger(x), *taps], dim=-1)

    def _patch_positions(self, grid: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """[total_patches, 2] each patch's (row, column) in its image, in merge-block order, repeated per frame."""
        m = self.spec.merge_size
        positions = []
        for t, h, w in grid:
            rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            block = (h // m, m, w // m, m)
            pos = torch.stack([rows.reshape(block).transpose(1, 2).flatten(),
                               cols.reshape(block).transpose(1, 2).flatten()], dim=-1)
            positions.append(pos.repeat(t, 1))
        return torch.cat(positions)

    def _position_taps(self, grid: list[tuple[int, int, int]],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3-VL: the learned side x side position table bilinearly resampled (align_corners) to each image's
        h x w patch grid, as 4 table rows and weights per patch ([total_patches, 4] each), computed as
        transformers' get_vision_interpolation_indices_and_weights does (fp32, the same operations) so that the
        weighted sum has its bits."""
        side = math.isqrt(self.spec.num_position_embeddings)
        pos = self._patch_positions(grid, device)
        sizes = torch.tensor([[h, w] for _, h, w in grid], device=device).repeat_interleave(
            torch.tensor([t * h * w for t, h, w in grid], device=device), dim=0)
        offsets = torch.arange(0, 2, device=device)
        axes = []
        for a in range(2):  # rows, then columns
            src = pos[:, a].to(torch.float32) * (side - 1) / torch.clamp(sizes[:, a] - 1, min=1)
            floor = torch.floor(src)
            taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
            weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
            axes.append((taps, weights))
        (h_taps, h_w), (w_taps, w_w) = axes
        return (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4), \
            (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)

    def _check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [num_images, 3], got shape {tuple(grid_thw.shape)}")
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        m = self.spec.merge_size
        if any(t < 1 or h < 1 or w < 1 or h % m or w % m for t, h, w in grid):
            raise ValueError(f"grid_thw {grid}: every t, h, w must be positive and h, w multiples of "
                             f"spatial_merge_size {m}")
        total = sum(t * h * w for t, h, w in grid)
        if tuple(pixel_values.shape) != (total, self.spec.patch_dim):
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)}; grid_thw {grid} needs "
                             f"[{total}, {self.spec.patch_dim}]")
        return grid

    def _rotary(self, grid: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [total_patches, 1, head_dim]: each patch's row angles then column angles, the pair twice
        (rotate_half's halves), in the patches' merge-block order."""
        freqs = self._patch_positions(grid, device)[..., None].float() * self._inv_freq.to(device)  # [N, 2, hd / 4]
        halves = freqs.flatten(1)  # rows' angles, then columns'
        angles = torch.cat([halves, halves], dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def _window_index(self, grid: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """transformers' get_vision_window_index: the merge blocks in window order (each image's windows row by
        row, each window's blocks row by row) and the windows' cumulative patch counts. A dimension that divides
        evenly still gets a whole window of padding, which yields empty windows: dropped, as its
        unique_consecutive drops them."""
        m = self.spec.merge_size
        size = self.spec.window_size // m // self.spec.patch_size  # a window's side, in merge blocks
        if size < 1:
            raise ValueError(f"window_size {self.spec.window_size} is smaller than a merge block "
                             f"({m} x {self.spec.patch_size} pixels)")
        index, cu, offset = [], [0], 0
        for t, h, w in grid:
            gh, gw = h // m, w // m
            pad_h, pad_w = size - gh % size, size - gw % size
            nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
            blocks = F.pad(torch.arange(t * gh * gw).reshape(t, gh, gw), (0, pad_w, 0, pad_h), value=-1)
            blocks = blocks.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
            counts = (blocks >= 0).sum(-1).flatten()
            blocks = blocks.flatten()
            index.append(blocks[blocks >= 0] + offset)
            cu.extend((counts.cumsum(0) * m * m + cu[-1]).tolist())
            offset += t * gh * gw
        return torch.cat(index), [c for i, c in enumerate(cu) if i == 0 or c != cu[i - 1]]

    def _to_windows(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        unit = self.spec.merge_size ** 2  # a merge block's patches move together
        return x.reshape(x.shape[0] // unit, unit, *x.shape[1:])[window_index].reshape(x.shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names relative to the tower, as transformers spells them under `visual.`)
        into the parameters, cast to their dtype. Returns the names of the parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_pos_emb.inv_freq"):
                continue  # recomputed, as transformers does (a non-persistent buffer there)
            if name not in params:
                raise ValueError(f"unexpected vision tower tensor {name!r}")
            _copy(name, params[name].data, tensor)
            loaded.add(name)
        return loaded


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out

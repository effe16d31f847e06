"""Pixtral's vision encoder and Mistral 3's projector, as transformers' PixtralVisionModel and
Mistral3MultiModalProjector compute them (Mistral3ForConditionalGeneration: Mistral-Small-3.1 / 3.2).

Images come at their own resolution (the image processor keeps each one's aspect ratio, both sides multiples of
patch_size * spatial_merge_size: streamer/multimodal/processors/pixtral_image_processor.py). Each image goes through the patch conv on
its own; the patches of all images are then one sequence, RMS-normed (ln_pre), through blocks of RMSNorm,
attention with a 2-D rotary embedding (a patch's row angles on one half of each head's frequencies, its column's
on the other) and a SiLU/GELU-gated MLP. Attention never crosses an image (transformers' block-diagonal mask): SDPA
over each image's patches, images of equal size batched in one call (qwen_vision._Segments).

The projector: RMSNorm, the patch merger (each spatial_merge_size x spatial_merge_size block of an image's patch
grid unfolded into one vector, then a linear), linear, activation, linear. An image of rows x cols merged tokens
then takes rows * (cols + 1) prompt positions: each row ends with [IMG_BREAK], the last with [IMG_END]
(streamer/multimodal/inputs.py), whose embeddings stay the tokens' own.
Like streamer/models/vision.py, the linears are plain modules, not PackableLinear.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.qwen_vision import RMSNorm, _cumsum, _rotate_half, _Segments
from streamer.models.vision import ACTIVATIONS, _copy, _param

# transformers' PixtralVisionConfig defaults (a vision_config dict leaving fields out gets these) and
# Mistral3Config's vision_config when config.json has none. tests/test_mistral3.py checks both.
PIXTRAL_DEFAULTS: dict[str, Any] = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                        num_attention_heads=16, num_channels=3, image_size=1024, patch_size=16,
                                        hidden_act="gelu")
MISTRAL3_VISION_CONFIG: dict[str, Any] = dict(model_type="pixtral", intermediate_size=4096, hidden_size=1024,
                                              patch_size=14, image_size=1540, num_hidden_layers=24,
                                              num_attention_heads=16, hidden_act="gelu")
ROPE_THETA = 10000.0
NORM_EPS = 1e-5  # PixtralRMSNorm's, fixed in transformers (not from the config)


@dataclass(frozen=True)
class PixtralSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_config(cls, vision_config: dict[str, Any]) -> PixtralSpec:
        model_type = vision_config.get("model_type", "pixtral")
        if model_type != "pixtral":
            raise ValueError(f"unsupported vision model_type {model_type!r} (Pixtral's encoder: 'pixtral')")
        c = {**PIXTRAL_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        for key in ("image_size", "patch_size"):
            if not isinstance(c[key], int):
                raise ValueError(f"only square images and patches are supported, got {key} {c[key]!r}")
        if c["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {c['hidden_act']!r}; supported: {sorted(ACTIVATIONS)}")
        if c["hidden_size"] % c["num_attention_heads"] or (c["hidden_size"] // c["num_attention_heads"]) % 4:
            raise ValueError(f"vision hidden_size {c['hidden_size']} with {c['num_attention_heads']} heads: the head "
                             "dim must be a multiple of 4 (the rotary embedding splits it between rows and columns)")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"unsupported vision rope_type {rope.get('rope_type')!r} (only axial)")
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c["num_channels"], c["image_size"], c["patch_size"], c["hidden_act"],
                   float(rope.get("rope_theta", c.get("rope_theta", ROPE_THETA))))


class _Linear(nn.Module):
    """A linear without a bias (every one of Pixtral's)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Attention(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_Linear(spec.hidden_size, spec.hidden_size)
                                                              for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        # transformers' apply_rotary_pos_emb, in the model's dtype (cos and sin were cast to it)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return self.o_proj(segments.attend(q, k, v, self.head_dim ** -0.5).reshape(n, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.gate_proj = _Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = _Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = _Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, spec: PixtralSpec) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size, NORM_EPS)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden_size, NORM_EPS)
        self.feed_forward = FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: _Segments) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, spec: PixtralSpec, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(spec) for _ in range(num_layers))


class PixtralVisionTower(nn.Module):
    def __init__(self, vision_config: dict[str, Any], feature_layer: int | list[int] = -1) -> None:
        """feature_layer: Mistral 3's vision_feature_layer, an index into the encoder's hidden states (0: ln_pre's
        output, i: layer i's; negative from the end), or a list of one (transformers' projector normalises
        hidden_size-wide features: several layers concatenated cannot go through it). Layers past it are not
        built."""
        super().__init__()
        spec = PixtralSpec.from_config(vision_config)
        self.spec = spec
        layers = list(feature_layer) if isinstance(feature_layer, (list, tuple)) else [feature_layer]
        if len(layers) != 1 or not isinstance(layers[0], int):
            raise ValueError(f"vision_feature_layer {feature_layer!r}: Mistral 3 reads one layer (its projector "
                             "takes hidden_size-wide features)")
        n = spec.num_layers + 1
        if not -n <= layers[0] < n:
            raise ValueError(f"vision_feature_layer {layers[0]} is out of range for {spec.num_layers} layers")
        self.feature_layer = layers[0] % n  # as a count of layers run
        self.patch_conv = nn.Module()  # holds the checkpoint's Conv2d weight (no bias)
        self.patch_conv.register_parameter("weight", _param(spec.hidden_size, spec.num_channels, spec.patch_size,
                                                            spec.patch_size))
        self.ln_pre = RMSNorm(spec.hidden_size, NORM_EPS)
        self.transformer = Transformer(spec, self.feature_layer)
        # transformers' PixtralVisionRotaryEmbedding: the even frequencies turn with the row, the odd ones with the
        # column (fp32, on the CPU; not a buffer, so not a weight)
        dim = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self._inv_freq = (inv_freq[0::2], inv_freq[1::2])

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    def forward(self, pixel_values: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Each image's pixels [C, H, W] (sizes may differ) -> (the selected layer's states for all images' patches
        [sum of h * w, hidden], row-major per image, in order; each image's patch grid (h, w))."""
        w = self.patch_conv.weight
        p, channels = self.spec.patch_size, self.spec.num_channels
        embeds = []
        for px in pixel_values:
            if px.dim() != 3 or px.shape[0] != channels or px.shape[1] < p or px.shape[2] < p:
                raise ValueError(f"pixel_values of shape {tuple(px.shape)}: each image must be [{channels}, H, W] "
                                 f"with H, W >= patch_size {p}")
            embeds.append(F.conv2d(px.to(device=w.device, dtype=w.dtype)[None], w, stride=p)[0])
        grids = [(e.shape[1], e.shape[2]) for e in embeds]
        x = self.ln_pre(torch.cat([e.flatten(1).T for e in embeds]))
        cos, sin = self._rotary(grids, x)
        segments = _Segments(_cumsum([h * w for h, w in grids]), x.device)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, segments)
        return x, grids

    def _rotary(self, grids: list[tuple[int, int]], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, 1, head_dim] in x's dtype: per patch, its row's angles then its column's, twice
        (rotate_half's halves), computed in fp32 as transformers does."""
        rows, cols = [], []
        for h, w in grids:
            r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            rows.append(r.flatten())
            cols.append(c.flatten())
        inv_h, inv_w = self._inv_freq
        half = torch.cat([torch.cat(rows)[:, None].float() * inv_h, torch.cat(cols)[:, None].float() * inv_w], -1)
        angles = torch.cat([half, half], dim=-1).to(x.device)[:, None]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names relative to the tower, as transformers spells them under
        `vision_tower.`) into the parameters, cast to their dtype; layers past the one read are skipped. Returns
        the names of the parameters filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            parts = name.split(".")
            if name.startswith("transformer.layers.") and len(parts) > 2 and parts[2].isdigit() \
                    and int(parts[2]) >= len(self.transformer.layers) and int(parts[2]) < self.spec.num_layers:
                continue  # a layer past the one read
            if name.endswith("inv_freq"):
                continue  # recomputed (a non-persistent buffer in transformers)
            if name not in params:
                raise ValueError(f"unexpected vision tower tensor {name!r}")
            _copy(name, params[name].data, tensor)
            loaded.add(name)
        return loaded


class PatchMerger(nn.Module):
    """Mistral3PatchMerger: each image's merge x merge blocks of patches unfolded (F.unfold's order: channel-major,
    then the block's rows and columns) into one vector, then a linear without bias."""

    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = _Linear(hidden * merge ** 2, hidden)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        d, m = x.shape[-1], self.merge
        blocks = []
        for tokens, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            grid = tokens.view(h, w, d).permute(2, 0, 1)[None]
            blocks.append(F.unfold(grid, kernel_size=m, stride=m).view(d * m * m, -1).t())
        return self.merging_layer(torch.cat(blocks))


class Mistral3Projector(nn.Module):
    """Mistral3MultiModalProjector: RMSNorm (the text model's eps), patch merger, linear, activation, linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, act: str, bias: bool, eps: float) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        if merge < 1:
            raise ValueError(f"spatial_merge_size must be positive, got {merge}")
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[sum of h * w, vision hidden] (the tower's output, with its grids) -> [sum of (h // merge) *
        (w // merge), text hidden], row-major per image."""
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), grids))))

"""InternVL 3 / 3.5's vision encoder (InternViT) and projector, as transformers' InternVLVisionModel and
InternVLMultiModalProjector compute them (InternVLForConditionalGeneration: the "-hf" checkpoints such as
OpenGVLab/InternVL3-1B-hf, InternVL3_5-*-HF).

An image comes as tiles of the config's image_size (streamer/multimodal/processors/internvl_image_processor.py: up to max_patches
tiles by the closest aspect ratio, plus a thumbnail), each encoded on its own: the patch conv, a class token, the
learned position embeddings (the whole table: tiles are always at image_size, so transformers never interpolates
it), then layers of norm -> attention (q/k/v, optional RMSNorm over all heads' q and k: `use_qk_norm`) scaled by
lambda_1, norm -> MLP scaled by lambda_2, each added to the residual stream; LayerNorm or RMSNorm per `norm_type`.
`vision_feature_layer` -1 reads the last layer's output (through the final LayerNorm where the config has one:
use_mean_pooling false), any other index that hidden state (0: the embeddings); the "default" strategy drops the
class token. The projector: pixel shuffle (each 2x2 block of the patch grid, at downsample_ratio 0.5, folded into
one vector of 4x the width, in transformers' order), LayerNorm, linear, activation, linear: a tile of 448 pixels
with 14-pixel patches takes (32 * 0.5)^2 = 256 tokens.
Like streamer/models/vision.py, the linears are plain modules, not PackableLinear.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.qwen_vision import RMSNorm
from streamer.models.vision import ACTIVATIONS, LayerNorm, Linear, _copy, _holder, _param

# transformers' InternVLVisionConfig defaults (InternViT-300M at 448 pixels); tests/test_internvl.py checks them.
INTERNVL_VISION_DEFAULTS: dict[str, Any] = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                attention_bias=False, use_qk_norm=False, intermediate_size=4096,
                                                hidden_act="gelu", norm_type="layer_norm", layer_norm_eps=1e-6,
                                                image_size=448, patch_size=14, num_channels=3,
                                                use_absolute_position_embeddings=True, use_mean_pooling=True)
QK_NORM_EPS = 1e-6  # InternVLVisionRMSNorm's default: the q/k norms do not take the config's eps
PROJECTOR_NORM_EPS = 1e-5  # nn.LayerNorm's default (the projector's LayerNorm is built without one)


def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"only square {name}s are supported, got {value!r}")
        value = value[0]
    if not isinstance(value, int):
        raise ValueError(f"vision {name} must be an int or a square pair, got {value!r}")
    return value


@dataclass(frozen=True)
class InternVisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    act: str
    eps: float
    rms_norm: bool  # norm_type "rms_norm" (else LayerNorm)
    qk_norm: bool
    attention_bias: bool
    final_norm: bool  # use_mean_pooling false: last_hidden_state goes through a LayerNorm

    @property
    def side(self) -> int:
        """Patches along each side of a tile."""
        return self.image_size // self.patch_size

    @classmethod
    def from_config(cls, vision_config: dict[str, Any]) -> InternVisionSpec:
        model_type = vision_config.get("model_type", "internvl_vision")
        if model_type != "internvl_vision":
            raise ValueError(f"unsupported vision model_type {model_type!r} (InternVL's encoder: 'internvl_vision')")
        c = {**INTERNVL_VISION_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        image, patch = _square(c["image_size"], "image_size"), _square(c["patch_size"], "patch_size")
        if image % patch:
            raise ValueError(f"vision image_size {image} is not a multiple of patch_size {patch}")
        if c["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {c['hidden_act']!r}; supported: {sorted(ACTIVATIONS)}")
        if c["norm_type"] not in ("layer_norm", "rms_norm"):
            raise ValueError(f"unsupported vision norm_type {c['norm_type']!r} (layer_norm or rms_norm)")
        if c["hidden_size"] % c["num_attention_heads"]:
            raise ValueError(f"vision hidden_size {c['hidden_size']} is not divisible by "
                             f"num_attention_heads {c['num_attention_heads']}")
        if not c["use_absolute_position_embeddings"]:
            raise ValueError("InternVL vision configs without absolute position embeddings are not supported")
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"],
                   c["num_channels"], image, patch, c["hidden_act"], float(c["layer_norm_eps"]),
                   c["norm_type"] == "rms_norm", bool(c["use_qk_norm"]), bool(c["attention_bias"]),
                   not c["use_mean_pooling"])


def _norm(spec: InternVisionSpec) -> nn.Module:
    return RMSNorm(spec.hidden_size, spec.eps) if spec.rms_norm else LayerNorm(spec.hidden_size, spec.eps)


class _Proj(nn.Module):
    """A linear with an optional bias (q/k/v: attention_bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, spec: InternVisionSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, h // spec.num_heads
        self.q_proj, self.k_proj, self.v_proj = (_Proj(h, h, spec.attention_bias) for _ in range(3))
        self.projection_layer = Linear(h, h)
        # (over all heads at once, before the heads are split)
        self.q_norm = RMSNorm(h, QK_NORM_EPS) if spec.qk_norm else None
        self.k_norm = RMSNorm(h, QK_NORM_EPS) if spec.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q, k, v = (y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.projection_layer(out.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self, spec: InternVisionSpec) -> None:
        super().__init__()
        self.act = ACTIVATIONS[spec.act]
        self.fc1 = Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, spec: InternVisionSpec) -> None:
        super().__init__()
        self.layernorm_before = _norm(spec)
        self.attention = Attention(spec)
        self.layernorm_after = _norm(spec)
        self.mlp = MLP(spec)
        self.lambda_1 = _param(spec.hidden_size)
        self.lambda_2 = _param(spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lambda_1 * self.attention(self.layernorm_before(x)) + x
        return self.lambda_2 * self.mlp(self.layernorm_after(x)) + x


class Encoder(nn.Module):
    def __init__(self, spec: InternVisionSpec, num_layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(spec) for _ in range(num_layers))  # (sic: transformers' name)


class Embeddings(nn.Module):
    def __init__(self, spec: InternVisionSpec) -> None:
        super().__init__()
        p = spec.patch_size
        self.patch_size = p
        self.cls_token = _param(1, 1, spec.hidden_size)
        self.patch_embeddings = nn.Module()
        self.patch_embeddings.projection = _holder(_param(spec.hidden_size, spec.num_channels, p, p),
                                                   _param(spec.hidden_size))
        self.position_embeddings = _param(1, spec.side ** 2 + 1, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        conv = self.patch_embeddings.projection
        x = F.conv2d(pixel_values, conv.weight, conv.bias, stride=self.patch_size).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.position_embeddings


# Checkpoint tensors never used (relative to the tower)
_UNUSED = ("embeddings.mask_token",)


class InternVisionTower(nn.Module):
    def __init__(self, vision_config: dict[str, Any], feature_layer: int = -1, strategy: str = "default") -> None:
        """feature_layer: vision_feature_layer, -1 (the last layer's output, final norm included) or an index into
        the hidden states (0: the embeddings, i: layer i's output; negative from the end). strategy:
        vision_feature_select_strategy, "default" only (the class token dropped: the projector's pixel shuffle
        needs a square grid)."""
        super().__init__()
        spec = InternVisionSpec.from_config(vision_config)
        if isinstance(feature_layer, (list, tuple)):
            raise ValueError("InternVL reads one vision_feature_layer, not a list")
        if strategy != "default":
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r} for InternVL (only "
                             "'default': the class token dropped)")
        n = spec.num_layers + 1
        if not -n <= feature_layer < n:
            raise ValueError(f"vision_feature_layer {feature_layer} is out of range for {spec.num_layers} layers")
        self.spec = spec
        self.read_last = feature_layer == -1
        depth = spec.num_layers if self.read_last else feature_layer % n  # layers run
        self.embeddings = Embeddings(spec)
        self.encoder = Encoder(spec, depth)
        self.layernorm = LayerNorm(spec.hidden_size, spec.eps) if spec.final_norm and self.read_last else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] tiles at the config's image_size -> [N, side^2, hidden] (the class token dropped)."""
        size, channels = self.spec.image_size, self.spec.num_channels
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (channels, size, size):
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)}; the vision tower expects "
                             f"[N, {channels}, {size}, {size}] (image_size {size})")
        w = self.embeddings.patch_embeddings.projection.weight
        x = self.embeddings(pixel_values.to(device=w.device, dtype=w.dtype))
        for layer in self.encoder.layer:
            x = layer(x)
        if self.layernorm is not None:
            x = self.layernorm(x)
        return x[:, 1:]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names relative to the tower, transformers' spelling) into the parameters;
        tensors of parts not built (layers past the one read, the final norm where it is not read) are skipped."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith(_UNUSED):
                continue
            parts = name.split(".")
            if name.startswith("encoder.layer.") and len(parts) > 2 and parts[2].isdigit() \
                    and int(parts[2]) >= len(self.encoder.layer):
                continue
            if name.startswith("layernorm.") and self.layernorm is None:
                continue
            if name not in params:
                raise ValueError(f"unexpected vision tower tensor {name!r}")
            _copy(name, params[name].data, tensor)
            loaded.add(name)
        return loaded


def pixel_shuffle(x: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' InternVLModel.pixel_shuffle, op for op: [N, S, S, C] -> [N, S*scale, S*scale, C/scale^2]."""
    n, width, height, channels = x.shape
    x = x.view(n, width, int(height * scale), int(channels / scale))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(height * scale), int(width * scale), int(channels / (scale ** 2)))
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLProjector(nn.Module):
    """Pixel shuffle, then LayerNorm -> linear -> activation -> linear (InternVLMultiModalProjector)."""

    def __init__(self, vision_hidden: int, text_hidden: int, side: int, downsample_ratio: float, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        factor = int(1 / downsample_ratio)
        if factor < 1 or side * downsample_ratio != int(side * downsample_ratio) or \
                (vision_hidden / downsample_ratio) != int(vision_hidden / downsample_ratio):
            raise ValueError(f"downsample_ratio {downsample_ratio} does not divide the {side}x{side} patch grid")
        self.scale = downsample_ratio
        self.side = side
        self.tokens = int(side * downsample_ratio) ** 2  # per tile
        width = vision_hidden * factor ** 2
        if int(vision_hidden / downsample_ratio ** 2) != width:
            raise ValueError(f"downsample_ratio {downsample_ratio} is not supported (the projector's width would be "
                             f"{width}, the shuffled features' {int(vision_hidden / downsample_ratio ** 2)})")
        self.layer_norm = LayerNorm(width, PROJECTOR_NORM_EPS)
        self.linear_1 = Linear(width, text_hidden)
        self.linear_2 = Linear(text_hidden, text_hidden)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, side^2, vision hidden] -> [N, tokens, text hidden]."""
        n = x.shape[0]
        x = pixel_shuffle(x.reshape(n, self.side, self.side, -1), self.scale).reshape(n, self.tokens, -1)
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))

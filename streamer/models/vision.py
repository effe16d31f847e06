"""The vision encoders LLaVA puts in front of its language model (LLaVA-NeXT too, on each tile of an image): CLIP's
and SigLIP's ViT, as transformers' CLIPVisionModel / SiglipVisionModel compute them, up to the hidden states LLaVA
reads.

LLaVA takes the hidden states of one encoder layer (`vision_feature_layer`, usually -2) or of several
(concatenated along the hidden dim), never the pooled output: post_layernorm, SigLIP's pooling head and the
layers past the deepest one read are not built. Images always come at the config's image_size (the image
processor resizes them), so attention is plain non-causal SDPA over a fixed token count, with no paging.
The tower's linears are plain nn.Linear-like modules, not PackableLinear: the decoder's oneDNN packing,
FP8 and LoRA passes must leave them alone.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# What transformers' CLIPVisionConfig / SiglipVisionConfig default to: real configs (llava-1.5's vision_config)
# leave fields out. tests/test_vision.py checks these against the config classes.
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, layer_norm_eps=1e-5, hidden_act="quick_gelu",
                              num_channels=3),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                num_attention_heads=12, image_size=224, patch_size=16, layer_norm_eps=1e-6,
                                hidden_act="gelu_pytorch_tanh", num_channels=3),
}

STRATEGIES = ("default", "full")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # Written as transformers' NewGELUActivation (not F.gelu's tanh kernel) so that the rounding is the same.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "silu": F.silu,  # (Qwen2.5-VL's encoder)
    "relu": F.relu,
}


@dataclass(frozen=True)
class VisionSpec:
    """The encoder's shape, from a vision_config dict completed with VISION_DEFAULTS."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    eps: float
    act: str
    num_channels: int

    @property
    def is_clip(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.is_clip)  # CLIP's class token has a position of its own

    @classmethod
    def from_config(cls, vision_config: dict[str, Any]) -> VisionSpec:
        model_type = vision_config.get("model_type")
        if model_type not in VISION_DEFAULTS:
            raise ValueError(f"unsupported vision model_type {model_type!r}; supported: {sorted(VISION_DEFAULTS)}")
        c = {**VISION_DEFAULTS[model_type], **{k: v for k, v in vision_config.items() if v is not None}}
        if not isinstance(c["image_size"], int) or not isinstance(c["patch_size"], int):
            raise ValueError(f"only square images and patches are supported, got image_size {c['image_size']!r}, "
                             f"patch_size {c['patch_size']!r}")
        if c["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {c['hidden_act']!r}; supported: {sorted(ACTIVATIONS)}")
        if c["hidden_size"] % c["num_attention_heads"]:
            raise ValueError(f"vision hidden_size {c['hidden_size']} is not divisible by "
                             f"num_attention_heads {c['num_attention_heads']}")
        return cls(model_type, c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                   c["num_attention_heads"], c["image_size"], c["patch_size"], float(c["layer_norm_eps"]),
                   c["hidden_act"], c["num_channels"])


def _param(*shape: int) -> nn.Parameter:
    # torch.empty: the loader fills every parameter, so an initialisation would only cost time.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _holder(weight: nn.Parameter, bias: nn.Parameter | None = None) -> nn.Module:
    """A module that only holds parameters, so that their names are the checkpoint's (`patch_embedding.weight`)."""
    m = nn.Module()
    m.register_parameter("weight", weight)
    m.register_parameter("bias", bias)
    return m


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size)
        self.bias = _param(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    """Patch convolution (+ CLIP's class token) + learned position embeddings."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.patch_size = spec.patch_size
        p = spec.patch_size
        # CLIP's conv has no bias, SigLIP's has one
        self.patch_embedding = _holder(_param(spec.hidden_size, spec.num_channels, p, p),
                                       None if spec.is_clip else _param(spec.hidden_size))
        self.class_embedding = _param(spec.hidden_size) if spec.is_clip else None
        self.position_embedding = _holder(_param(spec.num_positions, spec.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.patch_embedding.weight
        x = F.conv2d(pixel_values, w, self.patch_embedding.bias, stride=self.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight  # positions are 0..T-1: the whole table, in order


class Attention(nn.Module):
    """Non-causal self-attention; q/k/v fused into one matmul (the checkpoint's q_proj/k_proj/v_proj are its
    row blocks, in that order)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.head_dim = spec.hidden_size // spec.num_heads
        self.qkv_proj = Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.out_proj = Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv_proj(x).view(n, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    """fc1 -> act -> fc2 (CLIP's, SigLIP's and Qwen2-VL's encoders)."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.fc1 = Linear(width, hidden)
        self.fc2 = Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(spec.hidden_size, spec.eps)
        self.self_attn = Attention(spec)
        self.layer_norm2 = LayerNorm(spec.hidden_size, spec.eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, spec.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, spec: VisionSpec, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(num_layers))


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
# Checkpoint tensors LLaVA never uses (prefixes, relative to the tower); layers past the deepest read are too.
_UNUSED = ("post_layernorm.", "head.", "embeddings.position_ids")


class VisionTower(nn.Module):
    def __init__(self, vision_config: dict[str, Any], feature_layers: int | list[int], strategy: str,
                 post_norm: bool = False) -> None:
        """feature_layers: LLaVA's vision_feature_layer, an index into the encoder's hidden states (0: the
        embeddings, i: the output of layer i; negative from the end), or a list of them whose states are
        concatenated. strategy: vision_feature_select_strategy, "default" (drop the first token: CLIP's class
        token) or "full". post_norm: the encoder's last_hidden_state instead (after post_layernorm; Gemma 3's):
        feature_layers must then be -1."""
        super().__init__()
        spec = VisionSpec.from_config(vision_config)
        if strategy not in STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: {STRATEGIES}")
        self.spec, self.strategy = spec, strategy
        layers = list(feature_layers) if isinstance(feature_layers, (list, tuple)) else [feature_layers]
        self.feature_layers = [self._resolve(i) for i in layers]  # as counts of layers run
        if not self.feature_layers:
            raise ValueError("vision_feature_layer is an empty list")
        self.embeddings = Embeddings(spec)
        self.pre_layrnorm = LayerNorm(spec.hidden_size, spec.eps) if spec.is_clip else None  # (sic: CLIP's name)
        self.encoder = Encoder(spec, max(self.feature_layers))
        self.post_layernorm = None
        if post_norm:
            if self.feature_layers != [spec.num_layers]:
                raise ValueError("post_norm reads the last layer's output: feature_layers must be -1")
            self.post_layernorm = LayerNorm(spec.hidden_size, spec.eps)

    def _resolve(self, index: int) -> int:
        """The hidden state `index` refers to, as a count of layers run (hidden_states has num_layers + 1)."""
        n = self.spec.num_layers + 1
        if not -n <= index < n:
            raise ValueError(f"vision_feature_layer {index} is out of range for {self.spec.num_layers} layers")
        return index % n

    @property
    def num_tokens(self) -> int:
        # "default" drops the first token whatever it is (as transformers' LlavaModel does, SigLIP included).
        return self.spec.num_positions - int(self.strategy == "default")

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size * len(self.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] at the config's image_size -> [N, num_tokens, hidden_size]."""
        size, channels = self.spec.image_size, self.spec.num_channels
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (channels, size, size):
            raise ValueError(f"pixel_values have shape {tuple(pixel_values.shape)}; the vision tower expects "
                             f"[N, {channels}, {size}, {size}] (image_size {size})")
        w = self.embeddings.patch_embedding.weight
        x = self.embeddings(pixel_values.to(device=w.device, dtype=w.dtype))
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}  # only the states read: the rest would hold N x tokens x hidden per layer
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in self.feature_layers:
                states[i] = x
        picked = [states[i] for i in self.feature_layers]
        if self.post_layernorm is not None:
            picked = [self.post_layernorm(picked[0])]
        if self.strategy == "default":
            picked = [s[:, 1:] for s in picked]
        return torch.cat(picked, dim=-1) if len(picked) > 1 else picked[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (names relative to the tower, transformers' spelling; a leading "vision_model."
        is dropped) into the parameters, cast to their dtype. Tensors of parts not built are skipped. Returns the
        names of the parameters filled (the fused qkv only once all of q, k and v came)."""
        return load_fused(dict(self.named_parameters()), ((n.removeprefix("vision_model."), t) for n, t in weights),
                          self._target, "vision tower")

    def _target(self, name: str) -> tuple[str | None, int | None]:
        """(our parameter name, q/k/v block) for a checkpoint name; (None, None) for one to skip."""
        if name.startswith(_UNUSED) and not (name.startswith("post_layernorm.") and self.post_layernorm is not None):
            return None, None
        parts = name.split(".")
        if name.startswith("encoder.layers.") and len(parts) > 2 and parts[2].isdigit():
            if int(parts[2]) >= len(self.encoder.layers):
                return None, None  # a layer past the deepest one read
            if len(parts) == 6 and parts[3] == "self_attn" and parts[4] in _QKV:
                return ".".join(parts[:4] + ["qkv_proj", parts[5]]), _QKV[parts[4]]
        return name, None


def copy_into_params(params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]],
                     shown_prefix: str = "") -> set[str]:
    """Copy each (name, tensor) into the parameter of that name and shape (cast to its dtype); ValueError for any
    other (named with `shown_prefix`, the checkpoint's spelling). Returns the names filled."""
    loaded = set()
    for name, t in weights:
        param = params.get(name)
        if param is None or param.shape != t.shape:
            raise ValueError(f"unexpected tensor '{shown_prefix}{name}' {tuple(t.shape)} in the checkpoint")
        param.data.copy_(t)
        loaded.add(name)
    return loaded


def load_fused(params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
               target: Callable[[str], tuple[str | None, int | None]], what: str) -> set[str]:
    """Copy checkpoint tensors into `params`: `target` names each one's parameter and, for a fused q/k/v linear,
    its row block (0, 1, 2), or None to skip it. Returns the names of the parameters filled (a fused one once all
    three blocks came)."""
    loaded: set[str] = set()
    qkv_parts: dict[str, set[int]] = {}
    for name, tensor in weights:
        dest, part = target(name)
        if dest is None:
            continue
        if dest not in params:
            raise ValueError(f"unexpected {what} tensor {name!r}")
        param = params[dest]
        if part is None:
            _copy(name, param.data, tensor)
            loaded.add(dest)
            continue
        rows = param.shape[0] // 3
        _copy(name, param.data[part * rows:(part + 1) * rows], tensor)
        qkv_parts.setdefault(dest, set()).add(part)
        if len(qkv_parts[dest]) == 3:
            loaded.add(dest)
    return loaded


def _copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)

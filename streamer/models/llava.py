"""LLaVA (LlavaForConditionalGeneration): a CLIP or SigLIP vision encoder and a two-layer projector in front of a
text model of one of the supported families.

The text model is the family's own class: `llava_class` subclasses it with `LlavaMixin`, which adds the encoder
and projector, reads LLaVA's checkpoint names and turns pixels into features (`encode_images`). The features
replace the image placeholders' embeddings (ModelRunner, streamer/multimodal.py); from there on the decoder runs
as for text. As in transformers, attention stays causal over image tokens too.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models.vision import VisionTower

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu,
                "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


# LlavaConfig's encoder for a config that names none: CLIP ViT-L/14 at 336 pixels (LLaVA-1.5's).
DEFAULT_VISION_CONFIG = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                         "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14}


class Projector(nn.Module):
    """Vision features -> the text model's hidden size: linear, activation, linear (LlavaMultiModalProjector)."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaMixin(nn.Module):
    """Mixed in before a text model class (see `llava_class`)."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]  # the text model
        mm = cfg.multimodal
        self.vision_tower = VisionTower(mm.get("vision_config") or DEFAULT_VISION_CONFIG,
                                        mm.get("vision_feature_layer", -2),
                                        mm.get("vision_feature_select_strategy", "default"))
        self.multi_modal_projector = Projector(self.vision_tower.hidden_size, cfg.hidden_size,
                                               mm.get("projector_hidden_act", "gelu"),
                                               bool(mm.get("multimodal_projector_bias", True)))

    @property
    def tokens_per_image(self) -> int:
        return self.vision_tower.num_tokens

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, hidden]: what each image's placeholders read as embeddings."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """LLaVA's names (both transformers 4's `language_model.model.*` and 5's `model.language_model.*`) as the
        text model's, the encoder's under `vision_tower.` (without CLIPVisionModel's `vision_model.`)."""
        for name, t in weights:
            name = name.removeprefix("model.") if name.startswith("model.language_model.") or \
                name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) else name
            if name.startswith("language_model."):
                name = name.removeprefix("language_model.")
                if not name.startswith(("model.", "lm_head.")):  # (transformers 5 in memory: language_model.layers)
                    name = "model." + name
            elif name.startswith("vision_tower."):
                name = "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith("vision_tower."):
                    vision.append((name.removeprefix("vision_tower."), t))
                elif name.startswith("multi_modal_projector."):
                    projector.append((name, t))
                else:
                    yield name, t

        loaded = super().load_weights(text())  # type: ignore[misc]
        loaded |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}
        params = dict(self.named_parameters())
        for name, t in projector:
            param = params.get(name)
            if param is None or param.shape != t.shape:
                raise ValueError(f"unexpected tensor {name!r} {tuple(t.shape)} in checkpoint for LLaVA")
            param.data.copy_(t)
            loaded.add(name)
        return loaded


@functools.cache
def llava_class(text_cls: type) -> type:
    """The text family's model class with LLaVA's vision encoder and projector."""
    return type(f"Llava{text_cls.__name__}", (LlavaMixin, text_cls), {})

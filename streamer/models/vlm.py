"""Vision-language models: a vision encoder and a projector in front of a text model of one of the supported
families. LLaVA (LlavaForConditionalGeneration: CLIP or SigLIP, a two-layer MLP projector), LLaVA-NeXT
(LlavaNextForConditionalGeneration: LLaVA's on "anyres" tiles, unpadded, a learned newline after each row), Gemma 3
(Gemma3ForConditionalGeneration: SigLIP, pooled to 256 tokens, RMSNorm, one projection), Qwen2-VL / Qwen2.5-VL /
Qwen3-VL, Mistral 3 (Mistral3ForConditionalGeneration: Pixtral, RMSNorm, a patch merger, a two-layer MLP) and
InternVL 3 / 3.5 (InternVLForConditionalGeneration: InternViT on 448-pixel tiles, a pixel shuffle, LayerNorm, a
two-layer MLP); and one audio-language model, Qwen2-Audio (Qwen2AudioForConditionalGeneration: Whisper's encoder
with an average pool, one linear projection), whose clips ride the images' path (streamer/multimodal/audio_prompts.py).

The text model is the family's own class: `vlm_class` subclasses it with the architecture's mixin, which adds the
encoder and projector, reads the checkpoint's names and turns pixels into features (`encode_images`). The features
replace the image placeholders' embeddings (ModelRunner, streamer/multimodal/inputs.py); from there on the decoder runs
as for text (with Gemma 3's image tokens attending to each other both ways: `bidirectional_images`), except
Qwen3-VL's DeepStack: more feature sets of each image token, added to the residual stream after the first decoder
layers (`Qwen3VLMixin`).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamer.models import registry
from streamer.models.gemma3 import GemmaRMSNorm
from streamer.models.vision import ACTIVATIONS, VisionTower, copy_into_params

if TYPE_CHECKING:
    from streamer.multimodal.inputs import ImageInput

# LlavaConfig's encoder for a config that names none: CLIP ViT-L/14 at 336 pixels (LLaVA-1.5's).
DEFAULT_VISION_CONFIG = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                         "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14}


class Projector(nn.Module):
    """Vision features -> the text model's hidden size: linear, activation, linear (LlavaMultiModalProjector)."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Gemma3Projector(nn.Module):
    """Gemma 3's: the patch grid average-pooled to mm_tokens_per_image, Gemma's RMSNorm, one projection."""

    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_image: int,
                 eps: float) -> None:
        super().__init__()
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} does not pool a {patches_per_side}x"
                             f"{patches_per_side} patch grid")
        self.kernel = patches_per_side // side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, h = x.shape
        side = math.isqrt(p)
        grid = x.transpose(1, 2).reshape(n, h, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class VisionLanguageMixin(nn.Module):
    """Mixed in before a text model class (see `vlm_class`): what every vision-language model shares."""

    vision_tower: VisionTower
    multi_modal_projector: nn.Module
    bidirectional_images = False  # image tokens attend to each other both ways (Gemma 3)
    tower_name = "vision_tower"  # the encoder's attribute, and its checkpoint names' prefix

    @property
    def tokens_per_image(self) -> Optional[int]:
        """Tokens every image takes (None: each image's own, by its size)."""
        raise NotImplementedError

    def encoder_bytes(self, max_tokens: int) -> int:
        """A bound on the encoder's activations for a step of `max_tokens` tokens: the most images it can touch
        (its budget's worth, and one more cut by a chunk boundary), a few hidden-size buffers per patch."""
        s = self.vision_tower.spec
        per_image = (s.image_size // s.patch_size) ** 2 * (s.hidden_size * 16 + s.intermediate_size * 6)
        return per_image * (-(-max_tokens // self.tokens_per_image) + 1)  # type: ignore[operator]

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens_per_image, hidden]: what each image's placeholders read as embeddings."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def place_image_features(self, embeds: torch.Tensor, idx: torch.Tensor, feats: torch.Tensor) -> dict[str, Any]:
        """Put the step's image feature rows (`feats`, one per image token, as `encode` made them) at their tokens'
        rows `idx` of the embeddings, in place; returns what else the forward of this step takes (keyword
        arguments: Qwen3-VL's DeepStack)."""
        embeds[idx] = feats.to(embeds.dtype)
        return {}

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each image's features [its tokens, hidden], encoded in one batch."""
        pixels = torch.stack([im.pixel_values for im in images]).to(device, non_blocking=True)
        return list(self.encode_images(pixels))

    # ------------------------------------------------------------------ weights
    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's names (both transformers 4's `language_model.model.*` and 5's `model.language_model.*`)
        as the text model's, the encoder's under `vision_tower.` (without the vision model's `vision_model.`); then
        the text model's own renames (Qwen3.5's skip its `mtp.*` head)."""
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                name = name.removeprefix("model.") if name.startswith("model.language_model.") or \
                    name.startswith(("model.vision_tower.", "model.audio_tower.", "model.multi_modal_projector.")) \
                    else name
                if name.startswith("language_model."):
                    name = name.removeprefix("language_model.")
                    if not name.startswith(("model.", "lm_head.")):  # (transformers 5 in memory: language_model.*)
                        name = "model." + name
                elif name.startswith("vision_tower."):
                    name = "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
                yield name, t
        return super().rename_weights(renamed())  # type: ignore[misc]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tower: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []
        prefix = f"{self.tower_name}."

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith(prefix):
                    tower.append((name.removeprefix(prefix), t))
                elif name.startswith("multi_modal_projector."):
                    projector.append((name, t))
                else:
                    yield name, t

        loaded = super().load_weights(text())  # type: ignore[misc]  # the text model's
        loaded |= {prefix + n for n in getattr(self, self.tower_name).load_weights(tower)}
        return loaded | copy_into_params(dict(self.named_parameters()), projector)


class LlavaMixin(VisionLanguageMixin):
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


# LlavaNextConfig's image_grid_pinpoints for a config that names none (llava-v1.6's)
DEFAULT_GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


class LlavaNextMixin(LlavaMixin):
    """LLaVA-NeXT (llava-v1.6): LLaVA's encoder and projector on each image's tiles (streamer/
    llava_next_image_processor.py: the base image, then the image fitted into the best of `image_grid_pinpoints`,
    cut into tiles of the encoder's size). An image's features are the base tile's, then the tiles' laid out as
    one grid, cropped back to the image's aspect ratio and with `image_newline` after each row (transformers'
    pack_image_features); their number depends on the image's size (`ImageInput.size`)."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)
        from streamer.multimodal.processors.llava_next_image_processor import as_pinpoints
        spec = self.vision_tower.spec
        self.side = spec.image_size // spec.patch_size
        if self.vision_tower.num_tokens != self.side ** 2:  # (transformers could not lay the tiles out either)
            raise ValueError(f"vision_feature_select_strategy {self.vision_tower.strategy!r} leaves "
                             f"{self.vision_tower.num_tokens} features a tile of this {spec.model_type} encoder, "
                             f"not its {self.side}x{self.side} patch grid (CLIP takes \"default\", SigLIP \"full\")")
        self.grid_pinpoints = as_pinpoints(cfg.multimodal.get("image_grid_pinpoints") or DEFAULT_GRID_PINPOINTS,
                                           spec.image_size)
        # (held by a module of its own: parameter names are module.attribute throughout the loader)
        self.image_newline = nn.Module()
        self.image_newline.register_parameter("weight", nn.Parameter(torch.empty(cfg.hidden_size),
                                                                     requires_grad=False))

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    @property
    def tile_size(self) -> int:
        return self.vision_tower.spec.image_size

    def encoder_bytes(self, max_tokens: int) -> int:
        # An image takes at least a tile's worth of tokens (its base tile's), so a step touches at most
        # max_tokens / side^2 images, plus two cut by the chunk's ends, each encoded whole (its largest grid + 1)
        s = self.vision_tower.spec
        tiles = (-(-max_tokens // self.side ** 2) + 2) * (max(h * w for h, w in self.grid_pinpoints)
                                                         // self.tile_size ** 2 + 1)
        return tiles * s.num_positions * (s.hidden_size * 16 + s.intermediate_size * 6)

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each image's features [its tokens, hidden]: all images' tiles through the encoder in one batch."""
        pixels = torch.cat([im.pixel_values for im in images]).to(device, non_blocking=True)
        feats = self.multi_modal_projector(self.vision_tower(pixels))
        tiles = feats.split([im.pixel_values.shape[0] for im in images])
        return [self.pack(f, im.size) for f, im in zip(tiles, images)]  # type: ignore[arg-type]

    def pack(self, feats: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tile features [1 + rows * cols, side^2, hidden] (base tile first) -> its token rows: the
        base tile's, then the grid's unpadded rows, each followed by the newline."""
        from streamer.multimodal.processors.llava_next_image_processor import feature_grid, unpadded
        rows, cols = feature_grid(*size, self.grid_pinpoints, self.tile_size)
        if feats.shape[0] != 1 + rows * cols:
            raise ValueError(f"an image of {size[1]}x{size[0]} (WxH) has {feats.shape[0]} tiles; the model's "
                             f"image_grid_pinpoints make it 1 + {rows}x{cols}")
        s = self.side
        grid = feats[1:].view(rows, cols, s, s, -1).permute(0, 2, 1, 3, 4).reshape(rows * s, cols * s, -1)
        (r0, r1), (c0, c1) = unpadded(*size, rows * s, cols * s)
        grid = grid[r0:r1, c0:c1]
        newline = self.image_newline.weight.to(grid.dtype).expand(grid.shape[0], 1, -1)
        return torch.cat([feats[0], torch.cat([grid, newline], dim=1).flatten(0, 1)])

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """LLaVA's names, and the newline's (`image_newline`; transformers 5's `model.image_newline`) as
        `image_newline.weight`."""
        for name, t in super().rename_weights(weights):
            yield ("image_newline.weight" if name in ("image_newline", "model.image_newline") else name), t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        newline: list[torch.Tensor] = []

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name == "image_newline.weight":
                    newline.append(t)
                else:
                    yield name, t

        loaded = super().load_weights(others())
        param = self.image_newline.weight
        for t in newline:
            if t.shape != param.shape:
                raise ValueError(f"unexpected tensor 'image_newline' {tuple(t.shape)} in the checkpoint")
            param.data.copy_(t)
            loaded.add("image_newline.weight")
        return loaded

    def checkpoint_name(self, internal: str) -> str:
        if internal == "image_newline.weight":
            return "image_newline"
        return super().checkpoint_name(internal)  # type: ignore[misc]


# Gemma3Config's encoder for a config that names none (SiglipVisionConfig's defaults otherwise).
GEMMA3_VISION_CONFIG = {"model_type": "siglip_vision_model"}


class Gemma3VisionMixin(VisionLanguageMixin):
    bidirectional_images = True

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        mm = cfg.multimodal
        self.vision_tower = VisionTower(mm.get("vision_config") or GEMMA3_VISION_CONFIG, -1, "full", post_norm=True)
        spec = self.vision_tower.spec
        self.mm_tokens = int(mm.get("mm_tokens_per_image", 256))
        self.multi_modal_projector = Gemma3Projector(spec.hidden_size, cfg.hidden_size,
                                                     spec.image_size // spec.patch_size, self.mm_tokens, spec.eps)

    @property
    def tokens_per_image(self) -> int:
        return self.mm_tokens


class QwenVLMixin(VisionLanguageMixin):
    """Qwen2-VL / Qwen2.5-VL: the encoder (streamer/models/qwen_vision.py) ends in its own patch merger, which
    projects to the text model's width; images take as many tokens as their size asks, at M-RoPE positions
    (ModelConfig.mrope_section, streamer/multimodal/inputs.py). Videos go through the same encoder (as transformers'
    get_video_features): their grids have t > 1, each temporal slice attending to itself."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        from streamer.models.qwen_vision import QwenVisionTower
        arch = cfg.multimodal_architecture
        version = "qwen2_5_vl" if arch.startswith("Qwen2_5") else "qwen3_vl" if arch.startswith("Qwen3") \
            else "qwen2_vl"
        vision = dict(cfg.multimodal.get("vision_config") or {})
        if arch.startswith("Qwen3_5"):  # (Qwen3-VL's encoder without DeepStack)
            vision["deepstack_visual_indexes"] = []
        self.vision_tower = QwenVisionTower(vision, version)
        self.multi_modal_projector = nn.Identity()

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    def encoder_bytes(self, max_tokens: int) -> int:
        # A step's image tokens come from at most max_tokens * merge^2 patches (and one more image's worth at a
        # chunk boundary: counted twice over, a bound); a few buffers of the encoder's width per patch.
        spec = self.vision_tower.spec
        patches = 2 * max_tokens * spec.merge_size ** 2
        return patches * (spec.width * 16 + spec.mlp_hidden * 6)

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        pixels = torch.cat([im.pixel_values for im in images]).to(device, non_blocking=True)
        grid = torch.tensor([im.grid for im in images], dtype=torch.int64)
        return list(self.vision_tower(pixels, grid).split([im.length for im in images]))

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The encoder sits under `visual.` (transformers 4) or `model.visual.` (5)."""
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                for prefix in ("model.visual.", "visual."):
                    if name.startswith(prefix):
                        name = "vision_tower." + name.removeprefix(prefix)
                        break
                yield name, t
        return super().rename_weights(renamed())


class Qwen3VLMixin(QwenVLMixin):
    """Qwen3-VL: Qwen2-VL's way with images (its tower's Qwen3-VL version) over a Qwen3 text model with interleaved
    M-RoPE, plus DeepStack. The encoder's row for an image token holds its embedding and then k more feature sets
    (the taps of k vision blocks, `QwenVisionTower.num_deepstack`), cached together by the encoder cache and cut
    by chunked prefill like the embedding. `place_image_features` puts the embedding in place and hands the rest
    to the forward as `deepstack`: after decoder layer i < k, feature set i is added to the residual stream at the
    image tokens (transformers' Qwen3VLTextModel._deepstack_process). Only steps with image tokens carry it, and
    they run eagerly; every other step (decode, the compiled and captured graphs) is the text model's own.
    Videos take the same path: each temporal grid step is an image of one step (streamer/multimodal/inputs.py), whose
    rows carry DeepStack features as an image's do (transformers adds them at video tokens too).
    Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration) is the same over a Qwen3-MoE text model, whose checkpoint
    stacks each layer's experts in two tensors (`rename_weights` cuts them into the per-expert names)."""

    def place_image_features(self, embeds: torch.Tensor, idx: torch.Tensor, feats: torch.Tensor) -> dict[str, Any]:
        hidden = embeds.shape[-1]
        embeds[idx] = feats[:, :hidden].to(embeds.dtype)
        k = self.vision_tower.num_deepstack
        if not k or not len(idx):
            return {}
        return {"deepstack": (idx, feats[:, hidden:].unflatten(-1, (k, hidden)).to(embeds.dtype))}

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3-VL-MoE's experts, stacked per layer, as each expert's (models/moe.py unstack_experts)."""
        from streamer.models.moe import unstack_experts
        return unstack_experts(super().rename_weights(weights), self.cfg)  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Any = None, inputs_embeds: Optional[torch.Tensor] = None,
                deepstack: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """The text model's forward; `deepstack` (the image tokens' rows [M] of the step and their features
        [M, k, hidden]) adds feature set i to the residual stream at those rows after decoder layer i."""
        if deepstack is None:
            return super().forward(input_ids, positions, kv_caches, decode, inputs_embeds)  # type: ignore[misc]
        idx, feats = deepstack

        def add_features(i: int, x: torch.Tensor, residual: Optional[torch.Tensor]):
            if i >= feats.shape[1]:
                return x, residual
            x = x if residual is None else x + residual  # the stream made whole, as the next norm would
            x[idx] = x[idx] + feats[:, i]
            return x, None

        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # type: ignore[attr-defined]
        return self.run_layers(positions, x, kv_caches, decode, add_features)  # type: ignore[attr-defined]


class Mistral3Mixin(VisionLanguageMixin):
    """Mistral 3 (Mistral-Small-3.1 / 3.2): Pixtral's encoder at each image's own resolution, then RMSNorm, a
    patch merger and a two-layer MLP (streamer/models/pixtral.py). An image of rows x cols merged tokens sits in
    the prompt as rows of [IMG] tokens, each row closed by [IMG_BREAK] and the last by [IMG_END]: only the [IMG]
    positions take features (`ImageInput.feature_mask`, streamer/multimodal/inputs.py)."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        from streamer.models.pixtral import MISTRAL3_VISION_CONFIG, Mistral3Projector, PixtralVisionTower
        mm = cfg.multimodal
        self.vision_tower = PixtralVisionTower(mm.get("vision_config") or MISTRAL3_VISION_CONFIG,
                                               mm.get("vision_feature_layer", -1))
        self.spatial_merge_size = int(mm.get("spatial_merge_size", 2))
        self.multi_modal_projector = Mistral3Projector(self.vision_tower.hidden_size, cfg.hidden_size,
                                                       self.spatial_merge_size, mm.get("projector_hidden_act", "gelu"),
                                                       bool(mm.get("multimodal_projector_bias", False)),
                                                       cfg.rms_norm_eps)

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    @property
    def image_patch(self) -> int:
        """The side in pixels of one merged token: the image processor makes both sides multiples of it."""
        return self.vision_tower.spec.patch_size * self.spatial_merge_size

    def encoder_bytes(self, max_tokens: int) -> int:
        # As Qwen2-VL's: at most max_tokens * merge^2 patches a step (twice, for an image cut by a chunk boundary)
        spec = self.vision_tower.spec
        patches = 2 * max_tokens * self.spatial_merge_size ** 2
        return patches * (spec.hidden_size * 16 + spec.intermediate_size * 6)

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each image's features [its [IMG] tokens, hidden]; all images through the encoder in one sequence (each
        attending to itself only) and the projector, as transformers runs a prompt's images."""
        states, grids = self.vision_tower([im.pixel_values.to(device, non_blocking=True) for im in images])
        feats = self.multi_modal_projector(states, grids)
        m = self.spatial_merge_size
        return list(feats.split([(h // m) * (w // m) for h, w in grids]))


class InternVLMixin(VisionLanguageMixin):
    """InternVL 3 / 3.5: each image cut into tiles of the encoder's image_size (streamer/multimodal/processors/internvl_image_processor.py),
    each tile through InternViT and the pixel-shuffle projector (streamer/models/internvl.py) on its own; an image
    of P tiles takes P * `tile_tokens` image tokens between <img> and </img> (streamer/multimodal/inputs.py)."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        from streamer.models.internvl import InternVisionTower, InternVLProjector
        mm = cfg.multimodal
        self.vision_tower = InternVisionTower(mm.get("vision_config") or {}, mm.get("vision_feature_layer", -1),
                                              mm.get("vision_feature_select_strategy", "default"))
        spec = self.vision_tower.spec
        self.multi_modal_projector = InternVLProjector(spec.hidden_size, cfg.hidden_size, spec.side,
                                                       float(mm.get("downsample_ratio", 0.5)),
                                                       mm.get("projector_hidden_act", "gelu"))

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    @property
    def tile_tokens(self) -> int:
        """The image tokens one tile takes."""
        return self.multi_modal_projector.tokens

    @property
    def tile_size(self) -> int:
        return self.vision_tower.spec.image_size

    def encoder_bytes(self, max_tokens: int) -> int:
        # A step's image tokens come from at most max_tokens / tile_tokens tiles, plus two images cut by the chunk's
        # ends, each encoded whole (up to 13 tiles each at the processors' default max_patches, 12, + a thumbnail)
        s = self.vision_tower.spec
        tiles = -(-max_tokens // self.tile_tokens) + 2 * 13
        return tiles * (s.side ** 2 + 1) * (s.hidden_size * 16 + s.intermediate_size * 6)

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each image's features [its tiles * tile_tokens, hidden]: all images' tiles in one batch."""
        pixels = torch.cat([im.pixel_values for im in images]).to(device, non_blocking=True)
        feats = self.multi_modal_projector(self.vision_tower(pixels))
        return list(feats.flatten(0, 1).split([im.pixel_values.shape[0] * self.tile_tokens for im in images]))



class Gemma4VisionMixin(VisionLanguageMixin):
    """Gemma 4 (Gemma4ForConditionalGeneration; models/gemma4_vision.py): each image at its own size, a token per
    pooled square of patches, between <|image> and <image|>. Image tokens take the pad token's per-layer
    embeddings (the text model's `per_layer_ids`); with `use_bidirectional_attention: "vision"` (the larger models)
    they see their whole image in the sliding layers, the global layers staying causal (AttentionSpec.causal_only).
    Its audio encoder and videos are not supported (their weights are skipped)."""

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        from streamer.models.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
        mm = cfg.multimodal
        self.vision_tower = Gemma4VisionTower(mm.get("vision_config") or {})
        self.multi_modal_projector = Gemma4VisionEmbedder(self.vision_tower.hidden, cfg.hidden_size,
                                                          self.vision_tower.eps)
        self.bidirectional_images = cfg.raw.get("use_bidirectional_attention") == "vision"
        self.image_token = int(mm.get("image_token_id", 258_880))
        self.pad_token = int(cfg.raw.get("pad_token_id") or 0)

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    def encoder_bytes(self, max_tokens: int) -> int:
        # Images are encoded one at a time: one image's activations at the largest budget (1,120 tokens of pool^2
        # patches each; a few buffers of the encoder's width per patch), plus the step's feature rows (and one
        # image's more, cut by a chunk boundary) at both widths.
        t = self.vision_tower
        per_image = 1120 * t.pool ** 2 * (t.hidden * 16 + t.intermediate * 6)
        return per_image + (max_tokens + 1120) * (t.hidden + self.cfg.hidden_size) * 4

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each image's features [its tokens, hidden], an image at a time (their sizes differ)."""
        return [self.multi_modal_projector(self.vision_tower(im.pixel_values.to(device, non_blocking=True),
                                                             im.grid))  # type: ignore[arg-type]
                for im in images]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                decode: Any = None, inputs_embeds: Optional[torch.Tensor] = None, **kw: Any) -> torch.Tensor:
        if inputs_embeds is not None and self.ple:  # (image tokens' per-layer embeddings are the pad token's)
            kw["per_layer_ids"] = torch.where(input_ids == self.image_token, self.pad_token, input_ids)
        return super().forward(input_ids, positions, kv_caches, decode, inputs_embeds, **kw)  # type: ignore[misc]

    def rename_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`model.embed_vision.*` as the projector's; the audio encoder's and its projection's skipped."""
        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith(("model.audio_tower.", "model.embed_audio.")):
                    continue
                if name.startswith("model.embed_vision."):
                    name = "multi_modal_projector." + name.removeprefix("model.embed_vision.")
                yield name, t
        return super().rename_weights(renamed())


class Qwen2AudioMixin(VisionLanguageMixin):
    """Qwen2-Audio (Qwen2AudioForConditionalGeneration): Whisper's encoder with an average pool of 2 (streamer/
    models/audio_tower.py) and one linear projection in front of Qwen2. Its "images" are audio clips
    (streamer/multimodal/audio_prompts.py): an `ImageInput` whose pixel_values are the clip's log-mel features, padded to 30 s,
    and whose `frames` says how many of them hold the clip; it takes one <|AUDIO|> token per feature row."""

    tower_name = "audio_tower"

    def __init__(self, cfg: Any, backend_cls: Any, max_positions: int) -> None:
        super().__init__(cfg, backend_cls, max_positions)  # type: ignore[call-arg]
        from streamer.models.audio_tower import AudioTower
        self.audio_tower = AudioTower(dict(cfg.multimodal.get("audio_config") or {}))
        self.multi_modal_projector = nn.Module()  # (holds `linear`, as the checkpoint names it)
        self.multi_modal_projector.linear = nn.Linear(self.audio_tower.width, cfg.hidden_size, bias=True)
        self.multi_modal_projector.requires_grad_(False)

    @property
    def tokens_per_image(self) -> Optional[int]:
        return None

    def encoder_bytes(self, max_tokens: int) -> int:
        """Clips are encoded one at a time: one clip's activations (its 1,500 positions, a few width- and
        ffn-sized buffers each, and the attention scores), plus the step's feature rows."""
        t = self.audio_tower
        per_clip = t.positions * (t.width * 16 + t.ffn * 6) + t.heads * t.positions ** 2 * 4
        return per_clip + (max_tokens + t.positions) * (t.width + self.cfg.hidden_size) * 4

    def encode(self, images: list["ImageInput"], device: torch.device) -> list[torch.Tensor]:
        """Each clip's features [its tokens, hidden], a clip at a time (their lengths differ)."""
        out = []
        for clip in images:
            assert clip.frames is not None
            feats = self.audio_tower(clip.pixel_values.to(device, non_blocking=True), clip.frames)
            out.append(self.multi_modal_projector.linear(feats))
        return out


@functools.cache
def vlm_class(architecture: str, text_cls: type) -> type:
    """The text family's model class with the vision-language architecture's encoder and projector (its mixin: the
    registry's `VisionLanguage.mixin`)."""
    mixin = registry.VISION_LANGUAGE[architecture].mixin_class()
    return type(f"{architecture.removesuffix('ForConditionalGeneration')}{text_cls.__name__}", (mixin, text_cls), {})

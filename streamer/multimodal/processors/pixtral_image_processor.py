"""Images -> pixel_values for Pixtral's encoder (Mistral 3), as transformers' PixtralImageProcessor computes them
with its PIL backend (PixtralImageProcessorPil), called by PixtralProcessor.

Each image keeps its aspect ratio and (about) its size: one longer than size["longest_edge"] is scaled down to fit
(both sides floored), then both sides are rounded up to multiples of the patch, which PixtralProcessor sets to the
encoder's patch_size * spatial_merge_size (one merged token), whatever the image processor's config says. After
RGB conversion, a bicubic PIL resize on uint8, rescale and normalize (one lookup per uint8 value and channel, as in
streamer/multimodal/processors/image_processor.py, so the bits are transformers'), each image is [3, H, W] at its own size:
transformers pads a batch to its largest image, which the encoder then crops away, so no padding is made here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from streamer.multimodal.processors.image_processor import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    read_processor_config,
    to_rgb,
)
from streamer.multimodal.processors.qwen_image_processor import value_table

KINDS = ("PixtralImageProcessor", "PixtralImageProcessorFast", "PixtralImageProcessorPil")
# The class defaults (transformers' PixtralImageProcessorPil); a field left out of the config, or null, takes these.
PIXTRAL_IMAGE_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"longest_edge": 1024}, resample=3, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
    patch_size={"height": 16, "width": 16}, do_center_crop=False)


def resize_output_size(height: int, width: int, max_height: int, max_width: int, patch: int) -> tuple[int, int]:
    """transformers' pixtral get_resize_output_image_size: scaled down (floored) to fit max_height x max_width,
    then each side rounded up to a multiple of patch."""
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    if height < 1 or width < 1:
        raise ValueError(f"an image this thin ({width}x{height} WxH once fitted into {max_width}x{max_height}) "
                         "has a side of no pixels")
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


@dataclass
class PixtralImageProcessor:
    do_convert_rgb: bool
    do_resize: bool
    max_size: tuple[int, int]  # (height, width) an image is fitted into: longest_edge twice, or height and width
    resample: int  # a PIL resampling filter (3: bicubic)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    patch: int  # output sides are multiples of this (patch_size * spatial_merge_size, as PixtralProcessor sets it)
    _table: np.ndarray = field(init=False, repr=False, compare=False)  # [3, 256] float32: channel, uint8 -> output

    def __post_init__(self) -> None:
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean/image_std need 3 values, got {self.image_mean}, {self.image_std}")
        if self.patch < 1 or min(self.max_size) < 1:
            raise ValueError(f"patch {self.patch} and size {self.max_size} must be positive")
        self._table = value_table(self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                                  self.image_std)

    @classmethod
    def from_config(cls, config: dict[str, Any], patch: int) -> PixtralImageProcessor:
        """patch: the model's patch_size * spatial_merge_size (the config's own patch_size is PixtralProcessor's
        to override, and it does)."""
        kind = config.get("image_processor_type")
        if kind not in KINDS:
            raise ValueError(f"unsupported image processor {kind!r} for Mistral 3; supported: {KINDS}")
        c = {**PIXTRAL_IMAGE_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        if c["do_center_crop"]:
            raise ValueError(f"{kind} with do_center_crop is not supported")
        size = c["size"]
        if isinstance(size, int):
            size = {"longest_edge": size}
        if not isinstance(size, dict) or not (size.get("longest_edge") or (size.get("height") and size.get("width"))):
            raise ValueError(f"cannot read the image processor's size {c['size']!r} (longest_edge, or height and "
                             "width)")
        max_size = (size["longest_edge"],) * 2 if size.get("longest_edge") else (size["height"], size["width"])
        mean, std = c["image_mean"], c["image_std"]
        return cls(
            do_convert_rgb=bool(c["do_convert_rgb"]), do_resize=bool(c["do_resize"]),
            max_size=(int(max_size[0]), int(max_size[1])), resample=int(c["resample"]),
            do_rescale=bool(c["do_rescale"]), rescale_factor=float(c["rescale_factor"]),
            do_normalize=bool(c["do_normalize"]),
            image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
            image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3, patch=int(patch))

    @classmethod
    def from_folder(cls, folder: Path, patch: int) -> PixtralImageProcessor:
        """From preprocessor_config.json, or processor_config.json's "image_processor" entry."""
        return cls.from_config(read_processor_config(folder), patch)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of that size is processed at."""
        if not self.do_resize:
            return height, width
        return resize_output_size(height, width, *self.max_size, self.patch)

    def __call__(self, images: Sequence[Image.Image]) -> list[torch.Tensor]:
        """Each image's pixel values [3, H, W] float32, at its own size."""
        if not images:
            raise ValueError("no images to process")
        return [self._one(image) for image in images]

    def _one(self, image: Image.Image) -> torch.Tensor:
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"image mode {image.mode!r} with do_convert_rgb false: the vision tower needs RGB")
        height, width = self.output_size(image.height, image.width)
        if height < self.patch or width < self.patch:
            raise ValueError(f"image of size {width}x{height} (WxH) without resizing: both sides must be at least "
                             f"{self.patch} pixels (one merged patch)")
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image)
        out = np.empty((3, height, width), dtype=np.float32)
        for c in range(3):
            out[c] = self._table[c][array[..., c]]
        return torch.from_numpy(out)

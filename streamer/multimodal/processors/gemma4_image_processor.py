"""Images -> Gemma 4's vision input, as transformers' Gemma4ImageProcessorPil computes it: RGB, a bicubic resize that
keeps the aspect ratio within a patch budget (`max_soft_tokens` * pooling_kernel_size^2 patches of `patch_size`,
each side a multiple of pooling_kernel_size * patch_size), rescale (and normalize, off by default), then patches.

Each image keeps its own size: it becomes [patches, patch_size^2 * 3] (each patch's rows, columns, channels, in
that order, patches row by row) and (1, rows, columns) of patches; the encoder pools pooling_kernel_size^2 patches
into each of its tokens. (transformers pads every image to the budget and masks the padding out; here no padding.)
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

from streamer.multimodal.processors.image_processor import as_rgb, read_processor_config, value_table

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
_DEFAULTS = dict(do_convert_rgb=True, do_resize=True, resample=3, do_rescale=True, rescale_factor=1 / 255,
                 do_normalize=False, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0), patch_size=16,
                 max_soft_tokens=280, pooling_kernel_size=3)
KINDS = ("Gemma4ImageProcessor", "Gemma4ImageProcessorPil", "Gemma4ImageProcessorFast")


def target_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """The largest (height, width) of at most `max_patches` patches, each side a multiple of pool * patch, keeping
    the aspect ratio (transformers' get_aspect_ratio_preserving_size, line for line)."""
    target_px = max_patches * patch ** 2
    factor = math.sqrt(target_px / (height * width))
    side = pool * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"an image of {width}x{height} (WxH) is too small to resize to a multiple of {side} pixels")
    longest = (max_patches // pool ** 2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > target_px:
        raise ValueError(f"resizing {width}x{height} to {w}x{h} exceeds {max_patches} patches of {patch}")
    return h, w


@dataclass
class Gemma4ImageProcessor:
    do_convert_rgb: bool
    do_resize: bool
    resample: int
    patch_size: int
    max_soft_tokens: int
    pooling_kernel_size: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}")
        self._table = value_table(self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                                  self.image_std)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Gemma4ImageProcessor":
        kind = config.get("image_processor_type")
        if kind not in KINDS:
            raise ValueError(f"unsupported image processor {kind!r} for Gemma 4; supported: {', '.join(KINDS)}")
        c = {**_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        mean, std = c["image_mean"], c["image_std"]
        return cls(bool(c["do_convert_rgb"]), bool(c["do_resize"]), int(c["resample"]), int(c["patch_size"]),
                   int(c["max_soft_tokens"]), int(c["pooling_kernel_size"]), bool(c["do_rescale"]),
                   float(c["rescale_factor"]), bool(c["do_normalize"]),
                   tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
                   tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3)

    @classmethod
    def from_folder(cls, folder: Path) -> "Gemma4ImageProcessor":
        return cls.from_config(read_processor_config(folder))

    def process(self, images: Sequence[Image.Image]) -> list[tuple[torch.Tensor, int, tuple[int, int, int]]]:
        """Each image's (patches [N, patch^2 * 3] float32, its tokens N / pool^2, its patch grid (1, rows, cols))."""
        out = []
        p, k = self.patch_size, self.pooling_kernel_size
        for image in images:
            array = self._geometry(image)
            h, w = array.shape[:2]
            if h % (p * k) or w % (p * k):
                raise ValueError(f"an image of {w}x{h} (WxH) is not a multiple of {p * k} pixels a side "
                                 "(do_resize false?)")
            values = np.empty(array.shape, dtype=np.float32)
            for c in range(3):
                values[..., c] = self._table[c][array[..., c]]
            rows, cols = h // p, w // p
            patches = values.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
            out.append((torch.from_numpy(np.ascontiguousarray(patches)), rows * cols // k ** 2, (1, rows, cols)))
        return out

    def _geometry(self, image: Image.Image) -> np.ndarray:
        """RGB and the resize, on uint8 [H, W, 3] (PIL's bicubic, as transformers' PIL backend)."""
        image = as_rgb(image, self.do_convert_rgb)
        if self.do_resize:
            h, w = target_size(image.height, image.width, self.patch_size,
                               self.max_soft_tokens * self.pooling_kernel_size ** 2, self.pooling_kernel_size)
            if (h, w) != (image.height, image.width):
                image = image.resize((w, h), resample=self.resample)
        return np.asarray(image)

"""Images -> (pixel_values, image_grid_thw) for Qwen2-VL, Qwen2.5-VL and Qwen3-VL, as transformers'
Qwen2VLImageProcessor computes them with its PIL backend (Qwen2VLImageProcessorPil; Qwen2.5-VL and Qwen3-VL use the
same class, Qwen3-VL's config asking for 16-pixel patches, a mean and std of 0.5 and its own min/max pixels).

Each image keeps (about) its own aspect ratio and size: smart_resize picks the nearest height and width that are
multiples of patch_size * merge_size with a pixel count within [min_pixels, max_pixels]. After RGB conversion,
a bicubic PIL resize on uint8, rescale and normalize (one lookup per uint8 value and channel, as in
streamer/multimodal/processors/image_processor.py, so the bits are transformers'), the image is cut into patch_size squares listed in
merge-block order (each merge_size x merge_size block's patches consecutive), each patch duplicated
temporal_patch_size times (a still image is a video of identical frames) and flattened as (C, T, P, P).
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

KINDS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
# The class defaults (transformers' Qwen2VLImageProcessorPil); a field left out of the config, or null, takes these.
# size's shortest_edge / longest_edge are pixel counts (min_pixels / max_pixels, the older spelling, override them).
QWEN_IMAGE_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN,
    image_std=OPENAI_CLIP_STD, patch_size=14, temporal_patch_size=2, merge_size=2)
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize, line for line: (height, width) multiples of factor, the pixel count brought
    into [min_pixels, max_pixels] (rounded to the nearest multiple first; floored or ceiled when out of range)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def value_table(do_rescale: bool, rescale_factor: float, do_normalize: bool, mean: Sequence[float],
                std: Sequence[float]) -> np.ndarray:
    """[3, 256] float32: what rescale (float64, cast to float32) + normalize (float32) make of each uint8 value in
    each channel, with transformers' numpy operations and dtypes, so that a lookup gives its bits."""
    x = np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)
    if do_rescale:
        x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
        x = (x - np.array(mean, dtype=x.dtype)) / np.array(std, dtype=x.dtype)
    return np.ascontiguousarray(x.astype(np.float32).T)


def common_fields(c: dict[str, Any], what: str) -> dict[str, Any]:
    """The image and video processors' shared fields from a config merged over its class defaults (`what`: which
    processor, for errors). min_pixels / max_pixels override size, as transformers' __init__ has it."""
    size = dict(c["size"]) if isinstance(c["size"], dict) else None
    if size is None:
        raise ValueError(f"cannot read the {what} processor's size {c['size']!r} (a dict with shortest_edge and "
                         "longest_edge, in pixels)")
    size["shortest_edge"] = c.get("min_pixels", size.get("shortest_edge"))
    size["longest_edge"] = c.get("max_pixels", size.get("longest_edge"))
    if c["do_resize"] and (not size.get("shortest_edge") or not size.get("longest_edge")):
        raise ValueError(f"the {what} processor's size must have shortest_edge and longest_edge (or min_pixels and "
                         f"max_pixels), got {c['size']}")
    mean, std = c["image_mean"], c["image_std"]
    return dict(
        do_convert_rgb=bool(c["do_convert_rgb"]), do_resize=bool(c["do_resize"]),
        min_pixels=int(size["shortest_edge"] or 0), max_pixels=int(size["longest_edge"] or 0),
        resample=int(c["resample"]), do_rescale=bool(c["do_rescale"]), rescale_factor=float(c["rescale_factor"]),
        do_normalize=bool(c["do_normalize"]),
        image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
        image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3,
        patch_size=int(c["patch_size"]), temporal_patch_size=int(c["temporal_patch_size"]),
        merge_size=int(c["merge_size"]))


@dataclass
class QwenImageProcessor:
    do_convert_rgb: bool
    do_resize: bool
    min_pixels: int
    max_pixels: int
    resample: int  # a PIL resampling filter (3: bicubic)
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    _table: np.ndarray = field(init=False, repr=False, compare=False)  # [3, 256] float32: channel, uint8 -> output

    def __post_init__(self) -> None:
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean/image_std need 3 values, got {self.image_mean}, {self.image_std}")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError(f"patch_size {self.patch_size}, temporal_patch_size {self.temporal_patch_size} and "
                             f"merge_size {self.merge_size} must be positive")
        if self.do_resize and not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} / max_pixels {self.max_pixels}: need "
                             "0 < min_pixels <= max_pixels")
        self._table = value_table(self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean,
                                  self.image_std)

    @property
    def factor(self) -> int:
        """Output sides are multiples of this: one merge block, in pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QwenImageProcessor:
        kind = config.get("image_processor_type")
        if kind not in KINDS:
            raise ValueError(f"unsupported image processor {kind!r} for Qwen2-VL; supported: {KINDS}")
        # A null field takes the class default, as transformers' _set_attributes does.
        return cls(**common_fields({**QWEN_IMAGE_DEFAULTS, **{k: v for k, v in config.items() if v is not None}},
                                   "image"))

    @classmethod
    def from_folder(cls, folder: Path) -> QwenImageProcessor:
        """From preprocessor_config.json, or processor_config.json's "image_processor" entry."""
        return cls.from_config(read_processor_config(folder))

    def __call__(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [total_patches, 3 * temporal_patch_size * patch_size**2] float32, image_grid_thw int64
        [len(images), 3]); image i's patches are the next t * h * w rows."""
        if not images:
            raise ValueError("no images to process")
        patches, grids = [], []
        for image in images:
            p, grid = self._patches(self._geometry(image)[None])  # (a video of one frame)
            patches.append(p)
            grids.append(grid)
        return torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.int64)

    def num_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """The merged tokens (language-model positions) of each image."""
        return [int(t * h * w) // self.merge_size ** 2 for t, h, w in grid_thw.tolist()]

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of that size is processed at."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def _geometry(self, image: Image.Image) -> np.ndarray:
        """RGB conversion and resize, on uint8 -> [H, W, 3]."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"image mode {image.mode!r} with do_convert_rgb false: the vision tower needs RGB")
        height, width = self.output_size(image.height, image.width)
        if height % self.factor or width % self.factor:
            raise ValueError(f"image of size {width}x{height} (WxH) without resizing: both sides must be "
                             f"multiples of patch_size * merge_size = {self.factor}")
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.resample)
        return np.asarray(image)

    def _patches(self, frames: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """uint8 [T, H, W, 3] -> (normalized patches [gt * gh * gw, 3 * tp * P * P], [gt, gh, gw]): transformers'
        patchify (frames padded with the last one, then the same view and permute)."""
        t, h, w, _ = frames.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -t % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
            t += pad
        gt, gh, gw = t // tp, h // p, w // p
        video = np.empty((t, 3, h, w), dtype=np.float32)
        for c in range(3):
            video[:, c] = self._table[c][frames[..., c]]
        blocks = video.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(blocks).reshape(gt * gh * gw, 3 * tp * p * p), [gt, gh, gw]

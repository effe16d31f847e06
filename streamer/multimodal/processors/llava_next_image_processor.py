"""Images -> LLaVA-NeXT's "anyres" tiles, as transformers' LlavaNextImageProcessor computes them with its PIL backend
(LlavaNextImageProcessorPil), and the number of image tokens LlavaNextProcessor writes for each.

An image is resized, keeping its aspect ratio (each side ceil-rounded, as get_patch_output_size does), into the
best of the `image_grid_pinpoints` resolutions (`select_best_resolution`: the most of its pixels kept, then the
least area wasted), centred on a black canvas of that resolution (zero uint8 pixels, before normalization) and cut
into tiles of the encoder's size, row by row. The whole image, squashed to one tile (the base image), comes first.
Every tile then goes through the CLIP-style resize, center crop, rescale and normalize (streamer/multimodal/processors/image_processor.py:
the same PIL calls on uint8 and value table, so the bits are the PIL backend's; at the usual configs the resize and
crop leave the tiles as they are). The torchvision backend (the default where torchvision is installed) resizes
with its own kernels, so its pixels are close to these but not equal.

The model (models/vlm.py `LlavaNextMixin`) lays the tiles' patch features out as one grid, crops it back to the
image's aspect ratio (`unpadded`, transformers' unpad_image) and closes each row with its image_newline vector,
after the base tile's features: `num_image_tokens` counts them, as LlavaNextProcessor._get_number_of_features does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from streamer.multimodal.processors.image_processor import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageProcessor,
    read_processor_config,
    resize_output_size,
    size_dict,
    to_rgb,
)

Pinpoints = tuple[tuple[int, int], ...]  # (height, width) resolutions

# LlavaNextImageProcessorPil's class defaults (a field left out of the config, or null there, takes these);
# tests/test_llava_next.py checks them.
LLAVA_NEXT_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
    crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
    image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
    image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])
KINDS = ("LlavaNextImageProcessor", "LlavaNextImageProcessorFast", "LlavaNextImageProcessorPil")


def as_pinpoints(pinpoints: Any, tile: int, name: str = "image_grid_pinpoints") -> Pinpoints:
    """A config's image_grid_pinpoints as (height, width) pairs, each a whole number of tiles (transformers counts
    a partial tile in the pixels but not in the features' grid)."""
    if not isinstance(pinpoints, (list, tuple)) or not pinpoints:
        raise ValueError(f"{name} must be a non-empty list of [height, width], got {pinpoints!r}")
    out = []
    for p in pinpoints:
        if not isinstance(p, (list, tuple)) or len(p) != 2 or not all(isinstance(x, int) and x > 0 for x in p):
            raise ValueError(f"{name} entry {p!r} is not [height, width]")
        if p[0] % tile or p[1] % tile:
            raise ValueError(f"{name} entry {list(p)} is not a whole number of {tile}-pixel tiles")
        out.append((int(p[0]), int(p[1])))
    return tuple(out)


def select_best_resolution(height: int, width: int, pinpoints: Pinpoints) -> tuple[int, int]:
    """The (height, width) among `pinpoints` an image is fitted into: transformers' select_best_resolution (the
    first one wins any tie, and an image too thin to keep a pixel anywhere gets the first)."""
    best, best_kept, best_wasted = pinpoints[0], -1, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (h, w), kept, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image resized into `target` with its aspect ratio: get_patch_output_size."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def unpadded(height: int, width: int, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns ([start, end) each) of a rows x cols feature grid of an image of height x width that
    its padding does not cover: transformers' unpad_image (its rounding and arithmetic, in that order)."""
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        pad = (rows - new_rows) // 2
        return (pad, rows - pad), (0, cols)
    new_cols = int(round(width * (rows / height), 7))
    pad = (cols - new_cols) // 2
    return (0, rows), (pad, cols - pad)


def feature_grid(height: int, width: int, pinpoints: Pinpoints, tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles an image of height x width is cut into (the base tile not counted)."""
    h, w = select_best_resolution(height, width, pinpoints)
    return h // tile, w // tile


def num_image_tokens(height: int, width: int, pinpoints: Pinpoints, tile: int, side: int) -> int:
    """The image tokens of an image of height x width whose tiles make side x side features each: the base tile's,
    then the unpadded grid's rows, each closed by a newline."""
    rows, cols = feature_grid(height, width, pinpoints, tile)
    (r0, r1), (c0, c1) = unpadded(height, width, rows * side, cols * side)
    return side * side + (r1 - r0) * (c1 - c0 + 1)


class LlavaNextImageProcessor:
    def __init__(self, config: dict[str, Any], tile: int, side: int, pinpoints: Pinpoints) -> None:
        """config: the image processor's settings (preprocessor_config.json); tile: the encoder's image_size, which
        its tiles must come at; side: the encoder's patches per tile side; pinpoints: the model's
        image_grid_pinpoints (config.json), which the processor's must equal (transformers would otherwise count
        other tokens than the model makes)."""
        kind = config.get("image_processor_type")
        if kind not in KINDS:
            raise ValueError(f"unsupported image processor {kind!r} for LLaVA-NeXT; supported: {list(KINDS)}")
        c = {**LLAVA_NEXT_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        size = size_dict(c["size"], False, "size")
        crop = size_dict(c["crop_size"], True, "crop_size") if c["crop_size"] else {}
        # (as _preprocess reads them: the base image's size, and the tiles' cut, from size or crop_size)
        if "height" in size and "width" in size:
            self.base = (size["height"], size["width"])
        elif "shortest_edge" in size:
            self.base = (size["shortest_edge"], size["shortest_edge"])
        else:
            raise ValueError(f"unsupported LLaVA-NeXT image processor size {size}")
        cut = crop.get("height") or size.get("height") or size["shortest_edge"]
        if cut != tile:
            raise ValueError(f"the image processor cuts {cut}-pixel tiles, not the vision encoder's image_size {tile}")
        self.pinpoints = as_pinpoints(c["image_grid_pinpoints"], tile, "the image processor's image_grid_pinpoints")
        if self.pinpoints != pinpoints:
            raise ValueError(f"the image processor's image_grid_pinpoints {[list(p) for p in self.pinpoints]} are "
                             f"not the model's {[list(p) for p in pinpoints]}")
        mean, std = c["image_mean"], c["image_std"]
        # Each tile's own resize / crop / rescale / normalize. `size` resizes the tiles (squares) and the base image
        # (a square too, or already at size's height x width) to one size: given as that size, the batch is fixed
        out = resize_output_size(tile, tile, size)
        self.tiles = ImageProcessor(
            do_convert_rgb=False, do_resize=bool(c["do_resize"]), size={"height": out[0], "width": out[1]},
            resample=int(c["resample"]), do_center_crop=bool(c["do_center_crop"]), crop_size=crop or None,
            do_rescale=bool(c["do_rescale"]),
            rescale_factor=float(c["rescale_factor"]), do_normalize=bool(c["do_normalize"]),
            image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
            image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3)
        if self.tiles.output_size != (tile, tile):
            raise ValueError(f"the image processor makes {self.tiles.output_size} tiles, not the vision encoder's "
                             f"{tile}x{tile}")
        self.tile, self.side = tile, side
        self.resample = int(c["resample"])
        self.do_convert_rgb = bool(c["do_convert_rgb"])

    @classmethod
    def from_folder(cls, folder: Path, tile: int, side: int, pinpoints: Pinpoints) -> LlavaNextImageProcessor:
        return cls(read_processor_config(folder), tile, side, pinpoints)

    def num_tokens(self, height: int, width: int) -> int:
        """The image tokens an image of height x width takes (LlavaNextProcessor's count)."""
        return num_image_tokens(height, width, self.pinpoints, self.tile, self.side)

    def __call__(self, images: Sequence[Image.Image]) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """Each image's tiles [1 + rows * cols, 3, tile, tile] float32 (the base image first) and its (height,
        width), which its features' layout reads."""
        out = []
        for image in images:
            if self.do_convert_rgb:
                image = to_rgb(image)
            elif image.mode != "RGB":
                raise ValueError(f"image mode {image.mode!r} with do_convert_rgb false: the vision tower needs RGB")
            out.append((self.tiles(self._tiles(image)), (image.height, image.width)))
        return out

    def _tiles(self, image: Image.Image) -> list[Image.Image]:
        """The base image and the tiles of the padded, resized image, row by row (uint8 RGB)."""
        target = select_best_resolution(image.height, image.width, self.pinpoints)
        h, w = fitted_size(image.height, image.width, target)
        canvas = np.zeros((*target, 3), dtype=np.uint8)
        top, left = (target[0] - h) // 2, (target[1] - w) // 2  # (the odd pixel of padding goes after)
        canvas[top:top + h, left:left + w] = np.asarray(image.resize((w, h), resample=self.resample))
        t = self.tile
        tiles = [canvas[r:r + t, c:c + t] for r in range(0, target[0], t) for c in range(0, target[1], t)]
        base = image.resize((self.base[1], self.base[0]), resample=self.resample)
        return [base] + [Image.fromarray(np.ascontiguousarray(x)) for x in tiles]

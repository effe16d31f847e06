"""Images -> InternVL's tiles, as transformers' InternVLProcessor has GotOcr2ImageProcessorPil compute them.

InternVLProcessor always asks for `crop_to_patches` (whatever the image processor's config says): an image is
resized to the grid of columns x rows tiles (min_patches <= tiles <= max_patches) whose aspect ratio is closest
to its own (ties go to the larger grid while the image's area exceeds half of it: get_optimal_tiled_canvas), cut
into those tiles row by row, and, where there is more than one, followed by a thumbnail (the whole image resized
to one tile). Every tile is then rescaled and normalized. With max_patches 1 the image is just resized to one tile.

The result is bit-for-bit the PIL backend's: the resizes are the same PIL calls on uint8 RGB images, and rescale
+ normalize come from the value table streamer/multimodal/processors/image_processor.py builds with transformers' numpy operations. The
torchvision backend (GotOcr2ImageProcessorFast, transformers' default where torchvision is installed) resizes
with its own kernels, so its pixels are close to PIL's but not equal; such checkpoints get the PIL backend's here.
"""
from __future__ import annotations

import functools
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
    size_dict,
    to_rgb,
)

# GotOcr2ImageProcessorPil's class defaults (a field left out of the config, or null there, takes these);
# tests/test_internvl.py checks them.
GOT_OCR2_DEFAULTS: dict[str, Any] = dict(do_convert_rgb=True, do_resize=True, size={"height": 384, "width": 384},
                                         resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                         image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, min_patches=1,
                                         max_patches=12)
_KINDS = ("GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", "GotOcr2ImageProcessorPil")


@functools.cache
def _aspect_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) of every grid of min_tiles..max_tiles tiles, fewest tiles first (a stable sort, as
    transformers' get_all_supported_aspect_ratios)."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
             if min_tiles <= w * h <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) for an image of height x width: transformers' get_optimal_tiled_canvas, line for line."""
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in _aspect_ratios(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


class InternVLImageProcessor:
    def __init__(self, config: dict[str, Any], tile: int) -> None:
        """config: the image processor's settings (preprocessor_config.json); tile: the encoder's image_size,
        which the config's size must equal (transformers would otherwise interpolate the position embeddings)."""
        kind = config.get("image_processor_type")
        if kind not in _KINDS:
            raise ValueError(f"unsupported image processor {kind!r} for InternVL; supported: {list(_KINDS)}")
        c = {**GOT_OCR2_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        size = size_dict(c["size"], True, "size")
        if size != {"height": tile, "width": tile}:
            raise ValueError(f"the image processor's size {size} is not the vision encoder's image_size {tile}: "
                             "tiles must come at the encoder's size")
        if not c["do_resize"] and int(c["max_patches"]) <= 1:
            raise ValueError("an InternVL image processor with do_resize false and max_patches 1 would not bring "
                             "images to the tile size")
        mean, std = c["image_mean"], c["image_std"]
        # (the value table and the RGB conversion of the CLIP-style processor: the same numpy ops per value)
        self._values = ImageProcessor(
            do_convert_rgb=bool(c["do_convert_rgb"]), do_resize=True, size=size, resample=int(c["resample"]),
            do_center_crop=False, crop_size=None, do_rescale=bool(c["do_rescale"]),
            rescale_factor=float(c["rescale_factor"]), do_normalize=bool(c["do_normalize"]),
            image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
            image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3)
        self.tile = tile
        self.resample = int(c["resample"])
        self.do_convert_rgb = bool(c["do_convert_rgb"])
        self.min_patches, self.max_patches = int(c["min_patches"]), int(c["max_patches"])
        if self.min_patches < 1 or self.max_patches < self.min_patches:
            raise ValueError(f"min_patches {self.min_patches} / max_patches {self.max_patches}: need "
                             "1 <= min_patches <= max_patches")

    @classmethod
    def from_folder(cls, folder: Path, tile: int) -> InternVLImageProcessor:
        return cls(read_processor_config(folder), tile)

    def num_tiles(self, height: int, width: int) -> int:
        """The tiles an image of height x width becomes (the thumbnail included)."""
        if self.max_patches <= 1:
            return 1
        cols, rows = tile_grid(height, width, self.tile, self.min_patches, self.max_patches)
        return 1 if cols * rows == 1 else cols * rows + 1

    def __call__(self, images: Sequence[Image.Image]) -> list[torch.Tensor]:
        """Each image's tiles, [tiles, 3, tile, tile] float32."""
        out = []
        for image in images:
            tiles = self._tiles(image)
            batch = np.stack(tiles)
            px = np.empty((len(tiles), 3, self.tile, self.tile), dtype=np.float32)
            for c in range(3):
                px[:, c] = self._values._table[c][batch[..., c]]
            out.append(torch.from_numpy(px))
        return out

    def _tiles(self, image: Image.Image) -> list[np.ndarray]:
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"image mode {image.mode!r} with do_convert_rgb false: the vision tower needs RGB")
        t = self.tile
        if self.max_patches <= 1:  # (no cropping: one tile, resized)
            array = np.asarray(image.resize((t, t), resample=self.resample))
            return [array]
        cols, rows = tile_grid(image.height, image.width, t, self.min_patches, self.max_patches)
        resized = np.asarray(image.resize((t * cols, t * rows), resample=self.resample))
        tiles = [resized[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
        if len(tiles) != 1:
            tiles.append(np.asarray(image.resize((t, t), resample=self.resample)))
        return tiles

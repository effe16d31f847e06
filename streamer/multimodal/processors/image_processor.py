"""Images -> pixel_values, as transformers' CLIPImageProcessor and SiglipImageProcessor compute them with their PIL
backend (CLIPImageProcessorPil / SiglipImageProcessorPil): convert to RGB, resize, center crop, rescale,
normalize, in that order, from the checkpoint's preprocessor_config.json.

The result is bit-for-bit the PIL backend's: the geometry goes through the same PIL calls on uint8 images, and
rescale + normalize, which act on each uint8 value and channel alone, are read from a 3 x 256 table built with the
very numpy operations and dtypes transformers applies (float64 rescale, cast to float32, float32 normalize).
The torchvision backend ("Fast" processors, and transformers' default where torchvision is installed) resizes with
its own kernels, so its pixels are close to PIL's but not equal; its config fields are the same, and such
checkpoints get the PIL backend's pixels here.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# The processors' class defaults (transformers' CLIPImageProcessorPil / SiglipImageProcessorPil); a field left out
# of the config, or null there, takes these.
_CLIP = dict(do_convert_rgb=True, do_resize=True, size={"shortest_edge": 224}, default_to_square=False, resample=3,
             do_center_crop=True, crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255,
             do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, do_pad=False)
_SIGLIP = dict(do_convert_rgb=True, do_resize=True, size={"height": 224, "width": 224}, default_to_square=False,
               resample=3, do_center_crop=False, crop_size=None, do_rescale=True, rescale_factor=1 / 255,
               do_normalize=True, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), do_pad=False)
DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP, "CLIPImageProcessorFast": _CLIP, "CLIPImageProcessorPil": _CLIP,
    "CLIPFeatureExtractor": _CLIP,  # older CLIP checkpoints (openai/clip-vit-large-patch14-336) name only this
    "SiglipImageProcessor": _SIGLIP, "SiglipImageProcessorFast": _SIGLIP, "SiglipImageProcessorPil": _SIGLIP,
}
# Gemma 3's: SigLIP's with bilinear resizing (and pan-and-scan crops, off by default, refused here).
_GEMMA3 = dict(_SIGLIP, resample=2, do_pan_and_scan=False)
DEFAULTS.update({"Gemma3ImageProcessor": _GEMMA3, "Gemma3ImageProcessorFast": _GEMMA3,
                 "Gemma3ImageProcessorPil": _GEMMA3})

_SIZE_KEYS = ({"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"height", "width"})


def read_processor_config(folder: Path) -> dict[str, Any]:
    """A checkpoint's image processor settings: preprocessor_config.json, or processor_config.json's
    "image_processor" entry (transformers 5 may save the whole processor in that one file)."""
    folder = Path(folder)
    pre, proc = folder / "preprocessor_config.json", folder / "processor_config.json"
    if pre.exists():
        return json.loads(pre.read_text())
    if proc.exists():
        config = json.loads(proc.read_text()).get("image_processor")
        if not isinstance(config, dict):
            raise ValueError(f"{proc} has no image_processor entry")
        return config
    raise FileNotFoundError(f"{folder} has neither preprocessor_config.json nor processor_config.json: "
                            "the image processor's settings are missing")


def size_dict(size: Any, default_to_square: bool, name: str) -> dict[str, int]:
    """A config's size in dict form, as transformers' get_size_dict reads the older spellings: an int is the
    shortest edge (or a square, with default_to_square), a pair is (height, width)."""
    if isinstance(size, dict):
        return {k: int(v) for k, v in size.items() if v is not None}
    if isinstance(size, int):
        return {"height": size, "width": size} if default_to_square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    raise ValueError(f"cannot read the image processor's {name} {size!r}")


def resize_output_size(height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
    """(height, width) after the resize, with transformers' rounding (image_transforms.get_resize_output_image_size
    and get_size_with_aspect_ratio: the long side truncated with int(), as torchvision does)."""
    if "shortest_edge" in size and "longest_edge" in size:
        return _size_with_aspect_ratio(height, width, size["shortest_edge"], size["longest_edge"])
    if "shortest_edge" in size:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    if "height" in size and "width" in size:
        return size["height"], size["width"]
    raise ValueError(f"unsupported image processor size {size} (supported: shortest_edge (+ longest_edge), "
                     "height and width)")


def _size_with_aspect_ratio(height: int, width: int, size: int, max_size: int) -> tuple[int, int]:
    # transformers' image_transforms.get_size_with_aspect_ratio, line for line.
    raw_size = None
    lo, hi = float(min(height, width)), float(max(height, width))
    if hi / lo * size > max_size:
        raw_size = max_size * lo / hi
        size = int(round(raw_size))
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return (int(raw_size * height / width) if raw_size is not None else int(size * height / width)), size
    return size, (int(raw_size * width / height) if raw_size is not None else int(size * width / height))


def value_table(do_rescale: bool, rescale_factor: float, do_normalize: bool, image_mean: Sequence[float],
                image_std: Sequence[float]) -> np.ndarray:
    """[3, 256] float32: what rescale + normalize make of each uint8 value in each channel, computed as transformers
    computes it per pixel (image_transforms.rescale, then normalize), so the lookup gives the same bits."""
    x = np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)
    if do_rescale:
        x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        if len(image_mean) != 3 or len(image_std) != 3:
            raise ValueError(f"image_mean/image_std need 3 values, got {image_mean}, {image_std}")
        x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
        x = (x - np.array(image_mean, dtype=x.dtype)) / np.array(image_std, dtype=x.dtype)
    return np.ascontiguousarray(x.astype(np.float32).T)


def as_rgb(image: Image.Image, do_convert_rgb: bool) -> Image.Image:
    """The image in RGB (converted with `to_rgb`), or a ValueError where conversion is off and it is not RGB."""
    if do_convert_rgb:
        return to_rgb(image)
    if image.mode != "RGB":
        raise ValueError(f"image mode {image.mode!r} with do_convert_rgb false: the vision tower needs RGB")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency is composited onto white, not dropped."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] -> [height, width, C], as transformers' image_transforms.center_crop: the offset rounds down, and
    an image smaller than the crop is zero-padded (the pad's extra pixel, if odd, goes before)."""
    h, w = image.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return image[top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    top_pad, left_pad = -(-(new_h - h) // 2), -(-(new_w - w) // 2)  # ceil
    padded = np.zeros((new_h, new_w, image.shape[2]), dtype=image.dtype)
    padded[top_pad:top_pad + h, left_pad:left_pad + w] = image
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


@dataclass
class ImageProcessor:
    do_convert_rgb: bool
    do_resize: bool
    size: dict[str, int]
    resample: int  # a PIL resampling filter (3: bicubic, 2: bilinear)
    do_center_crop: bool
    crop_size: dict[str, int] | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    output_size: tuple[int, int] = field(init=False)  # (H, W) of every output image
    _table: np.ndarray = field(init=False, repr=False, compare=False)  # [3, 256] float32: channel, uint8 -> output

    def __post_init__(self) -> None:
        self.output_size = self._output_size()
        self._table = self._value_table()

    def _output_size(self) -> tuple[int, int]:
        if self.do_resize and set(self.size) not in _SIZE_KEYS:
            raise ValueError(f"unsupported image processor size {self.size} (supported: shortest_edge, "
                             "shortest_edge + longest_edge, height + width)")
        if self.do_center_crop:
            if not self.crop_size or "height" not in self.crop_size or "width" not in self.crop_size:
                raise ValueError(f"do_center_crop needs a crop_size with height and width, got {self.crop_size}")
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size and "width" in self.size:
            return self.size["height"], self.size["width"]
        raise ValueError("the image processor's output size would depend on each image (no center crop and no "
                         f"fixed resize: do_resize {self.do_resize}, size {self.size}); images could not be batched")

    def _value_table(self) -> np.ndarray:
        return value_table(self.do_rescale, self.rescale_factor, self.do_normalize, self.image_mean, self.image_std)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessor:
        kind = config.get("image_processor_type") or config.get("feature_extractor_type")
        if kind not in DEFAULTS:
            raise ValueError(f"unsupported image processor {kind!r}; supported: {sorted(DEFAULTS)}")
        # A null field takes the class default, as transformers' _set_attributes does.
        c = {**DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}
        if c["do_pad"]:
            raise ValueError(f"{kind} with do_pad is not supported")
        if c.get("do_pan_and_scan"):
            raise ValueError(f"{kind} with do_pan_and_scan is not supported")
        mean, std = c["image_mean"], c["image_std"]
        return cls(
            do_convert_rgb=bool(c["do_convert_rgb"]), do_resize=bool(c["do_resize"]),
            size=size_dict(c["size"], bool(c["default_to_square"]), "size"), resample=int(c["resample"]),
            do_center_crop=bool(c["do_center_crop"]),
            crop_size=size_dict(c["crop_size"], True, "crop_size") if c["crop_size"] is not None else None,
            do_rescale=bool(c["do_rescale"]), rescale_factor=float(c["rescale_factor"]),
            do_normalize=bool(c["do_normalize"]),
            image_mean=tuple(mean) if isinstance(mean, (list, tuple)) else (float(mean),) * 3,
            image_std=tuple(std) if isinstance(std, (list, tuple)) else (float(std),) * 3,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ImageProcessor:
        return cls.from_config(read_processor_config(folder))

    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """[N, 3, H, W] float32."""
        h, w = self.output_size
        batch = np.empty((len(images), h, w, 3), dtype=np.uint8)
        for i, image in enumerate(images):
            batch[i] = self._geometry(image)
        # Rescale + normalize as one lookup per channel, written straight into the channels-first layout (3-4x
        # faster than a [256, 3] fancy index followed by a transpose).
        out = np.empty((len(images), 3, h, w), dtype=np.float32)
        for c in range(3):
            out[:, c] = self._table[c][batch[..., c]]
        return torch.from_numpy(out)

    def _geometry(self, image: Image.Image) -> np.ndarray:
        """RGB conversion, resize and crop, on uint8 [H, W, 3] (where transformers does them too)."""
        image = as_rgb(image, self.do_convert_rgb)
        if self.do_resize:
            height, width = resize_output_size(image.height, image.width, self.size)
            image = image.resize((width, height), resample=self.resample)
        array = np.asarray(image)
        if self.do_center_crop:
            array = center_crop(array, *self.output_size)
        if array.shape[:2] != self.output_size:
            raise ValueError(f"image of size {array.shape[1]}x{array.shape[0]} (WxH) does not come out at "
                             f"{self.output_size[1]}x{self.output_size[0]}")
        return array

"""Videos -> (pixel_values_videos, video_grid_thw, second_per_grid_ts) for Qwen2-VL and Qwen2.5-VL, following
transformers' Qwen2VLVideoProcessor (video_processing_qwen2_vl.py; Qwen2.5-VL's processor adds
second_per_grid_ts = temporal_patch_size / the sampled frames' fps), and for Qwen3-VL (`Qwen3VideoProcessor`,
following Qwen3VLVideoProcessor: its own defaults, sampling and sizing, plus each grid step's timestamp).

A video is a stack of RGB frames (uint8 [T, H, W, 3], or a list of PIL images). Optionally frames are sampled first
(`sample_indices`, as its sample_frames: fps frames a second of the video's own fps, or num_frames, rounded to
multiples of temporal_patch_size, within [min_frames, max_frames]). Every frame is resized to the one size
smart_resize picks for the video (multiples of patch_size * merge_size, within [min_pixels, max_pixels]; with
cap_pixels_per_frame, max_pixels is also bounded by an even share of max_video_tokens), rescaled and normalized; the
frame count is padded to a multiple of temporal_patch_size by repeating the last frame; then each group of
temporal_patch_size frames is cut into patch_size squares in merge-block order, each patch flattened as (C, T, P, P),
one row per patch: transformers' patchify, reshape for reshape.

transformers resizes video frames with torchvision (not installable beside every torch); here each frame takes the
image path's bicubic PIL resize on uint8 and its exact rescale/normalize lookup (streamer/multimodal/processors/qwen_image_processor.py).
So the geometry, order and padding are transformers', while a resized pixel may differ from torchvision's by
rounding (and the normalized values by float32 rounding of its fused rescale-and-normalize).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import numpy as np
import torch
from PIL import Image

from streamer.multimodal.processors.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from streamer.multimodal.processors.qwen_image_processor import QwenImageProcessor, common_fields, smart_resize

# transformers' Qwen2VLVideoProcessor class attributes: a field left out of the config, or null, takes these.
# (fps / num_frames: None, sample nothing unless asked.)
QWEN_VIDEO_DEFAULTS: dict[str, Any] = dict(
    do_convert_rgb=True, do_resize=True, size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=OPENAI_CLIP_MEAN,
    image_std=OPENAI_CLIP_STD, patch_size=14, temporal_patch_size=2, merge_size=2, min_frames=4, max_frames=768,
    do_sample_frames=False, fps=None, num_frames=None, cap_pixels_per_frame=False, max_video_tokens=128000)
DEFAULT_FPS = 2.0  # the frames' rate assumed when the caller gives none (Qwen2.5-VL's processor default)

Frames = Union[np.ndarray, Sequence[Image.Image]]


def read_video_processor_config(folder: Path) -> dict[str, Any]:
    """As transformers looks for a video processor's settings: processor_config.json's "video_processor" entry,
    else video_preprocessor_config.json, else preprocessor_config.json (the image processor's, whose min/max
    pixels then apply to video frames too); {} if none is there."""
    folder = Path(folder)
    proc = folder / "processor_config.json"
    if proc.is_file():
        entry = json.loads(proc.read_text()).get("video_processor")
        if isinstance(entry, dict):
            return entry
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())
    return {}


def as_frames(video: Any, what: str = "video") -> np.ndarray:
    """A video's frames as uint8 [T, H, W, 3] (RGB): from such an array ([T, H, W] grey or [T, H, W, 4] RGBA
    are converted) or a list of PIL images of one size."""
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8:
            raise ValueError(f"{what} must be a uint8 array of frames, got dtype {video.dtype}")
        if video.ndim == 3:
            video = np.repeat(video[..., None], 3, axis=-1)
        if video.ndim != 4 or video.shape[-1] not in (3, 4):
            raise ValueError(f"{what} must be a [frames, height, width, 3] array, got shape {video.shape}")
        frames = video[..., :3] if video.shape[-1] == 4 else video
    elif isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
        sizes = {f.size for f in video}
        if len(sizes) > 1:
            raise ValueError(f"{what}'s frames differ in size: {sorted(sizes)}")
        from streamer.multimodal.processors.image_processor import to_rgb
        frames = np.stack([np.asarray(to_rgb(f) if f.mode != "RGB" else f) for f in video])
    else:
        raise ValueError(f"{what} must be a uint8 numpy array [frames, height, width, 3] or a non-empty list of "
                         f"PIL images, got {type(video).__name__}")
    if not len(frames) or not frames.shape[1] or not frames.shape[2]:
        raise ValueError(f"{what} is empty (shape {frames.shape})")
    return np.ascontiguousarray(frames)


@dataclass
class ProcessedVideo:
    """One video as the processor made it: its patches (float32 [t * h * w, C * T * P * P]), patch grid (t, h, w),
    seconds per temporal grid step (Qwen2.5-VL's second_per_grid_ts), the indices of the frames kept and the
    frame rate those count in (None: unknown)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    seconds: float
    indices: np.ndarray
    fps: Optional[float]


@dataclass
class QwenVideoProcessor(QwenImageProcessor):
    """The image processor's geometry and values (a still image is a video of identical frames), plus frame
    sampling and a per-video size."""

    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = False
    fps: Optional[float] = None  # frames a second to sample (do_sample_frames)
    num_frames: Optional[int] = None  # or this many frames
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    DEFAULTS: ClassVar[dict[str, Any]] = QWEN_VIDEO_DEFAULTS
    unknown_fps: ClassVar[Optional[float]] = None  # the frame rate taken for a video that gives none (Qwen3-VL: 24)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("the video processor's fps and num_frames are mutually exclusive")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QwenVideoProcessor:
        c = {**cls.DEFAULTS, **{k: v for k, v in config.items() if v is not None and k in cls.DEFAULTS
                                       or k in ("min_pixels", "max_pixels") and v is not None}}
        return cls(**common_fields(c, "video"), min_frames=int(c["min_frames"]), max_frames=int(c["max_frames"]),
                   do_sample_frames=bool(c["do_sample_frames"]),
                   fps=float(c["fps"]) if c["fps"] is not None else None,
                   num_frames=int(c["num_frames"]) if c["num_frames"] is not None else None,
                   cap_pixels_per_frame=bool(c["cap_pixels_per_frame"]), max_video_tokens=int(c["max_video_tokens"]))

    @classmethod
    def from_folder(cls, folder: Path) -> QwenVideoProcessor:
        return cls.from_config(read_video_processor_config(folder))

    # ------------------------------------------------------------------ frame sampling
    def sample_indices(self, total: int, video_fps: Optional[float], fps: Optional[float] = None,
                       num_frames: Optional[int] = None) -> np.ndarray:
        """Qwen2VLVideoProcessor.sample_frames: which of a video's `total` frames to keep, num_frames of them
        (rounded to a multiple of temporal_patch_size), or fps a second of a video of video_fps frames a second
        (within [min_frames, max_frames], floored to a multiple of temporal_patch_size), uniformly spaced."""
        if fps is not None and num_frames is not None:
            raise ValueError("num_frames and fps are mutually exclusive")
        num_frames = num_frames if num_frames is not None else self.num_frames
        fps = fps if fps is not None else self.fps
        tp = self.temporal_patch_size
        n: Optional[float]
        if num_frames is not None:
            n = round(num_frames / tp) * tp
        elif fps is not None:
            if not video_fps:
                raise ValueError("sampling frames at an fps needs the video's own fps")
            max_frames = math.floor(min(self.max_frames, total) / tp) * tp
            n = total / video_fps * fps
            n = min(max(n, self.min_frames), max_frames, total)
            n = math.floor(n / tp) * tp
        else:
            return np.arange(total, dtype=np.int64)
        if n > total:
            raise ValueError(f"cannot sample {n} frames from a video of {total}")
        if n <= 0:
            raise ValueError(f"a video of {total} frames gives no frames to sample (at least {tp} needed)")
        # torch.arange(0, total, total / n).int(): float32 steps, as transformers computes them
        return torch.arange(0, total, total / n).int().numpy().astype(np.int64)

    # ------------------------------------------------------------------ processing
    def output_size(self, height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
        """(height, width) every frame of a video of that size and frame count is processed at."""
        if not self.do_resize:
            return height, width
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            total_pixels = int(self.max_video_tokens * self.factor * self.factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * self.temporal_patch_size // num_frames),
                             int(self.min_pixels * 1.05))
        return smart_resize(height, width, self.factor, self.min_pixels, max_pixels)

    def __call__(self, videos: Sequence[Frames], fps: Optional[Sequence[Optional[float]]] = None,
                 sample: Optional[Sequence[Optional[bool]]] = None, max_tokens: Optional[int] = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """(pixel_values_videos [total_patches, 3 * temporal_patch_size * patch_size**2] float32, video_grid_thw
        int64 [len(videos), 3], second_per_grid_ts: each video's seconds per temporal grid step). `fps`: each
        video's frame rate (None: unknown, taken as the processor's fps or DEFAULT_FPS), which frame sampling
        needs and second_per_grid_ts reads. `sample`: whether to sample each video's frames (None: do_sample_frames,
        where the video's fps is known or num_frames set; False: the frames are sampled already). `max_tokens`: a
        video that would take more merged tokens is refused before its frames are resized."""
        out = self.process(videos, fps, sample, max_tokens)
        return (torch.from_numpy(np.concatenate([v.pixels for v in out])),
                torch.tensor([v.grid for v in out], dtype=torch.int64), [v.seconds for v in out])

    def process(self, videos: Sequence[Frames], fps: Optional[Sequence[Optional[float]]] = None,
                sample: Optional[Sequence[Optional[bool]]] = None, max_tokens: Optional[int] = None,
                indices: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list["ProcessedVideo"]:
        """Each video processed (see `__call__`), with the frame indices kept (into the frames given, or, for
        frames not sampled here, `indices`: theirs in the video they came from) and the frame rate they count in
        (the video's; None: unknown), which Qwen3-VL's timestamps read."""
        if not videos:
            raise ValueError("no videos to process")
        fps = list(fps) if fps is not None else [None] * len(videos)
        sample = list(sample) if sample is not None else [None] * len(videos)
        indices = list(indices) if indices is not None else [None] * len(videos)
        if len(fps) != len(videos) or len(sample) != len(videos) or len(indices) != len(videos):
            raise ValueError(f"{len(fps)} fps, {len(sample)} sample flags and {len(indices)} index lists for "
                             f"{len(videos)} videos")
        out = []
        for i, (video, rate, wanted, given) in enumerate(zip(videos, fps, sample, indices)):
            frames = as_frames(video, f"video {i}")
            sampled_fps = rate if rate else (self.fps or DEFAULT_FPS)
            idx = np.arange(len(frames), dtype=np.int64)
            if given is not None:  # (sampling the frames again replaces them, as transformers does)
                idx = np.asarray(given, dtype=np.int64).reshape(-1)
                if len(idx) != len(frames):
                    raise ValueError(f"video {i}: {len(idx)} frames_indices for {len(frames)} frames")
            if wanted is None:
                wanted = self.do_sample_frames and bool(rate or self.num_frames is not None
                                                        or self.unknown_fps is not None)
            if wanted:
                idx = self.sample_indices(len(frames), rate or self.unknown_fps)
                sampled_fps = len(idx) / len(frames) * rate if rate else sampled_fps
                frames = frames[idx]
            if max_tokens is not None:
                t, h, w = len(frames), *self.output_size(frames.shape[1], frames.shape[2], len(frames))
                n = -(-t // self.temporal_patch_size) * (h // self.patch_size) * (w // self.patch_size) \
                    // self.merge_size ** 2
                if n > max_tokens:
                    raise ValueError(f"video {i} ({t} frames of {frames.shape[2]}x{frames.shape[1]}, processed at "
                                     f"{w}x{h}) would take {n} tokens, more than the model's context "
                                     f"({max_tokens})")
            p, grid = self._patches(self._resize(frames))
            out.append(ProcessedVideo(p, tuple(grid), self.temporal_patch_size / sampled_fps, idx,
                                      rate or self.unknown_fps))
        return out

    def _resize(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] -> uint8 [T, H', W', 3]: every frame to the video's size, PIL on uint8."""
        t, h, w, _ = frames.shape
        height, width = self.output_size(h, w, t)
        if height % self.factor or width % self.factor:
            raise ValueError(f"video frames of size {w}x{h} (WxH) without resizing: both sides must be multiples "
                             f"of patch_size * merge_size = {self.factor}")
        if (height, width) == (h, w):
            return frames
        return np.stack([np.asarray(Image.fromarray(f).resize((width, height), resample=self.resample))
                         for f in frames])


# transformers' Qwen3VLVideoProcessor class attributes (video_processing_qwen3_vl.py): 16-pixel patches, mean / std
# 0.5, a pixel budget for the whole video (128 to 768 tokens' worth of 32 x 32 pixels a frame, times the frames),
# sampling on by default at 2 frames a second (cap_pixels_per_frame None: off, as transformers takes it).
QWEN3_VIDEO_DEFAULTS: dict[str, Any] = dict(
    QWEN_VIDEO_DEFAULTS, size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), patch_size=16, do_sample_frames=True, fps=2,
    max_video_tokens=768)
QWEN3_UNKNOWN_FPS = 24.0  # what Qwen3-VL's processor takes for a video without metadata (sampling and timestamps)


def qwen3_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL smart_resize (video_processing_qwen3_vl.py), line for line: Qwen2-VL's, with sides
    below `factor` scaled up first and the pixel budget counted over the frames (rounded to temporal_factor)."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video of {num_frames} frame(s): Qwen3-VL's video processor needs at least "
                         f"temporal_patch_size ({temporal_factor})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class Qwen3VideoProcessor(QwenVideoProcessor):
    """Qwen3-VL's video processor (transformers' Qwen3VLVideoProcessor): the same patches (frames padded with the
    last, the same layout), with its own defaults, frame sampling (`sample_indices`: on by default, a video of
    unknown rate taken at 24 frames a second, as transformers does), sizing (`qwen3_smart_resize`, a budget over all
    frames) and per-frame cap; frames are resized with PIL bicubic (transformers: torchvision), so a resized pixel
    may differ by rounding. `timestamps` gives each temporal grid step's time, which Qwen3VLProcessor writes into
    the prompt before that step's tokens."""

    DEFAULTS: ClassVar[dict[str, Any]] = QWEN3_VIDEO_DEFAULTS
    unknown_fps: ClassVar[Optional[float]] = QWEN3_UNKNOWN_FPS

    def sample_indices(self, total: int, video_fps: Optional[float], fps: Optional[float] = None,
                       num_frames: Optional[int] = None) -> np.ndarray:
        """Qwen3VLVideoProcessor.sample_frames: num_frames, or fps a second of a video of video_fps frames a second
        (truncated, within [min_frames, max_frames] and the video's frames), linspace over the video, rounded."""
        if fps is not None and num_frames is not None:
            raise ValueError("num_frames and fps are mutually exclusive")
        num_frames = num_frames if num_frames is not None else self.num_frames
        fps = fps if fps is not None else self.fps
        if num_frames is None and fps is not None:
            n = int(total / (video_fps or QWEN3_UNKNOWN_FPS) * fps)
            num_frames = min(max(n, self.min_frames), self.max_frames, total)
        if num_frames is None:
            num_frames = min(max(total, self.min_frames), self.max_frames)
        return np.linspace(0, total - 1, num_frames).round().astype(np.int64)

    def output_size(self, height: int, width: int, num_frames: int = 1) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            frame_cap = self.max_video_tokens * self.factor * self.factor
            per_frame = max(min(frame_cap, self.max_pixels // num_frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return qwen3_smart_resize(num_frames, height, width, self.temporal_patch_size, self.factor,
                                  self.min_pixels, max_pixels)

    def timestamps(self, video: ProcessedVideo) -> list[float]:
        """Each temporal grid step's time in seconds (Qwen3VLProcessor._calculate_timestamps): the kept frames'
        indices over the frame rate (unknown: 24), padded with the last to whole steps, averaged over each
        step's first and last frame."""
        idx = video.indices.tolist()
        tp = self.temporal_patch_size
        idx += [idx[-1]] * (-len(idx) % tp)
        rate = video.fps or QWEN3_UNKNOWN_FPS
        times = [i / rate for i in idx]
        return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]

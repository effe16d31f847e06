"""Images in prompts, for vision-language models (models/vlm.py: LLaVA, LLaVA-NeXT, Gemma 3, Qwen2-VL / 2.5-VL / 3-VL,
Mistral 3, InternVL 3 / 3.5).

An image enters a prompt as a run of placeholder tokens (the model's image token, one per feature row its vision
encoder makes). Those positions go through the decoder like any other token, except that their input embeddings
are the image's features instead of the placeholder's embedding. So an image is:
- `ImageInput` on the request: where its placeholders sit, its preprocessed pixels, and a hash of them. The hash
  goes into the KV blocks' prefix-cache hashes (two prompts with the same text but other images share nothing
  past the first image) and keys the runner's `EncoderCache` (an image is encoded once, however many chunks,
  sequences or requests read it).
- `ImageStep` on a step: which of the step's tokens take which feature rows. Chunked prefill may split an image
  anywhere (except Gemma 3's, whose tokens attend both ways: `Request.fit_chunk`): each chunk reads the rows of
  its own positions.
Mistral 3's images also hold row-break tokens ([IMG_BREAK], [IMG_END]) among their placeholders: those keep their
own token embeddings (`ImageInput.feature_mask` says which positions take feature rows).
Qwen2-VL's and Qwen2.5-VL's videos (multi_modal_data["video"], streamer/multimodal/processors/qwen_video_processor.py) are the same thing
with more than one temporal grid step: an `ImageInput` (`video` set) whose placeholders are the video token, which
the same encoder reads (each temporal slice attending to itself) and whose M-RoPE temporal positions step by
`time_interval` per grid step (Qwen2.5-VL: tokens_per_second * second_per_grid_t).
Qwen3-VL's videos are written as Qwen3VLProcessor writes them: per temporal grid step, its time as text
("<1.5 seconds>", tokenized with the model's tokenizer), <|vision_start|>, that step's video tokens and
<|vision_end|>; each step is an `ImageInput` of its own (a one-step grid, as transformers' get_rope_index splits
a video's grid; the encoder's attention never crosses steps anyway), so its M-RoPE positions, prefix-cache hash and
encoder-cache entry are an image's, and the text between steps is ordinary prompt text.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch

from streamer.multimodal.media_fetch import DEFAULT_POLICY, FetchPolicy, fetch

if TYPE_CHECKING:
    from PIL.Image import Image

    from streamer.core.request import Request

MAX_IMAGE_BYTES = 32 << 20  # a fetched or decoded image's encoded size
# Videos from URLs (the server's video_url parts): the encoded size, the frames decoded (so the decoding time), each
# frame's pixels, and the frames kept (sampled at the video processor's fps, spread over the whole video past this)
MAX_VIDEO_BYTES = 64 << 20
MAX_VIDEO_DECODED_FRAMES = 20_000
MAX_VIDEO_FRAME_PIXELS = 4096 * 2160
MAX_VIDEO_FRAMES = 64


@dataclass(eq=False)
class ImageInput:
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens: the rows of features the encoder makes for it
    pixel_values: torch.Tensor  # float32 on the host, as the image processor made it ([3, H, W]; Qwen: patches;
    # InternVL, LLaVA-NeXT: [tiles, 3, S, S])
    hash: bytes  # of the pixel values: equal images share prefix-cache blocks and encoder output
    grid: Optional[tuple[int, int, int]] = None  # Qwen2-VL: its patches' (t, h, w) grid
    # M-RoPE (Qwen2-VL): the [3, length] (temporal, height, width) positions of its tokens, and what a token after
    # it adds to its index to get its position (the image takes max(h, w) positions for h * w tokens)
    mrope: Optional[np.ndarray] = None
    rope_shift: int = 0
    # Which of its `length` positions take the encoder's feature rows, in order (None: all of them); the others
    # (Mistral 3's [IMG_BREAK] / [IMG_END]) keep their token embeddings
    feature_mask: Optional[np.ndarray] = None
    video: bool = False  # a video (Qwen2-VL / 2.5-VL; Qwen3-VL: one temporal step of one): video tokens
    # M-RoPE: the temporal position step per temporal grid step (Qwen2.5-VL's videos: tokens_per_second *
    # second_per_grid_t, floored after the multiplication by the step's index, as transformers does)
    time_interval: float = 1.0
    # LLaVA-NeXT: the image's (height, width) before preprocessing, which lays its features out (and its hash covers)
    size: Optional[tuple[int, int]] = None
    # The features themselves, given (a prompt of embeddings, streamer/engine/prompt_embeds.py: [length, width] in the
    # model's dtype, on the host): no encoder runs, and pixel_values is empty
    features: Optional[torch.Tensor] = None
    # An audio clip (streamer/multimodal/audio_prompts.py): how many of its log-mel features' frames hold it (pixel_values are
    # the features, padded to 30 s)
    frames: Optional[int] = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_features(self) -> int:
        """The rows of features the encoder makes for it."""
        return self.length if self.feature_mask is None else int(self.feature_mask.sum())


def hash_pixels(pixels: torch.Tensor) -> bytes:
    h = hashlib.blake2b(np.asarray(pixels.shape, dtype=np.int64).tobytes(), digest_size=16)
    h.update(pixels.contiguous().numpy().tobytes())
    return h.digest()


def hash_sized(pixels: torch.Tensor, size: Optional[tuple[int, int]]) -> bytes:
    """An image's key: its pixels and, where its features depend on it (LLaVA-NeXT's unpadding), its original size
    (two sizes can make the same pixels)."""
    if size is None:
        return hash_pixels(pixels)
    h = hashlib.blake2b(b"sized image", digest_size=16)
    h.update(hash_pixels(pixels))
    h.update(np.asarray(size, dtype=np.int64).tobytes())
    return h.digest()


def hash_frame(pixels: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    """A Qwen3-VL video step's key: its pixels and grid (its time is prompt text, so in the prefix-cache hash)."""
    h = hashlib.blake2b(b"video frame", digest_size=16)
    h.update(hash_pixels(pixels))
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    return h.digest()


def hash_video(pixels: torch.Tensor, time_interval: float) -> bytes:
    """A video's key: its pixels and its temporal position step (which its tokens' positions, so their KV, read)."""
    h = hashlib.blake2b(b"video", digest_size=16)
    h.update(hash_pixels(pixels))
    h.update(np.float64(time_interval).tobytes())
    return h.digest()


@dataclass
class VideoData:
    """One video of a prompt: its frames (uint8 [T, H, W, 3], or a list of PIL images), their frame rate (None:
    unknown; the processor assumes its default) and whether the processor may still sample them (None: as its
    config says; False: they are sampled already); `indices`: the frames' indices in the video they were sampled
    from, counted at `fps` (Qwen3-VL's timestamps read them; None: 0, 1, 2, ...)."""

    frames: Any
    fps: Optional[float] = None
    sample: Optional[bool] = None
    indices: Optional[Sequence[int]] = None


def _is_video(v: Any) -> bool:
    from PIL.Image import Image
    if isinstance(v, (VideoData, np.ndarray)):
        return True
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict):  # (frames, metadata), as vLLM takes
        return True
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(f, Image) for f in v)


def _video(v: Any) -> VideoData:
    if isinstance(v, VideoData):
        return v
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict):
        frames, meta = v
        fps = meta.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            raise ValueError(f"multi_modal_data['video'] metadata fps must be a positive number, got {fps!r}")
        sample = meta.get("do_sample_frames")
        indices = meta.get("frames_indices")
        if indices is not None:
            indices = np.asarray(indices)
            if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer) or (indices < 0).any():
                raise ValueError("multi_modal_data['video'] metadata frames_indices must be a list of frame "
                                 "indices (non-negative integers)")
            indices = indices.tolist()
        return VideoData(frames, float(fps) if fps is not None else None,
                         bool(sample) if sample is not None else None, indices)
    return VideoData(v)


def as_media(data: Any) -> tuple[list["Image"], list[VideoData]]:
    """A prompt's `multi_modal_data` ({"image": an image or a list of them, "video": a video or a list of them})
    as (PIL images, videos). A video is a uint8 array [T, H, W, 3], a list of PIL images (its frames), or
    (either, {"fps": its frame rate}) as vLLM takes it."""
    from PIL.Image import Image
    if not isinstance(data, dict) or set(data) - {"image", "video"}:
        raise ValueError(f"multi_modal_data must be {{'image': image or list of images, 'video': video or list of "
                         f"videos}}, got {type(data).__name__ if not isinstance(data, dict) else sorted(data)}")
    images = data.get("image")
    images = [] if images is None else images if isinstance(images, (list, tuple)) else [images]
    for im in images:
        if not isinstance(im, Image):
            raise ValueError(f"multi_modal_data['image'] must hold PIL images, got {type(im).__name__}")
    videos = data.get("video")
    if videos is None:
        videos = []
    elif _is_video(videos):
        videos = [videos]
    elif not isinstance(videos, (list, tuple)) or not all(_is_video(v) for v in videos):
        raise ValueError("multi_modal_data['video'] must be a video (a uint8 numpy array [frames, height, width, 3], "
                         "a list of PIL images, or (either, {'fps': rate})) or a list of videos, got "
                         f"{type(videos).__name__}")
    return list(images), [_video(v) for v in videos]


def as_image_list(data: Any) -> list["Image"]:
    """A prompt's `multi_modal_data` ({"image": an image or a list of them}) as a list of PIL images."""
    images, videos = as_media(data)
    if videos:
        raise ValueError("multi_modal_data['video']: videos are not taken here")
    return images


class ImagePrompts:
    """Turns (prompt tokens, images) into the prompt the model reads: each image's placeholder expanded to its
    feature rows (wrapped in the tokens the model expects around them), with an `ImageInput` per image.

    LLaVA's templates write `<image>`, the image token itself: it becomes `tokens_per_image` of them. Gemma 3's
    write `<start_of_image>` (`placeholder_id`), which its processor replaces by "\n\n<start_of_image>", the image
    tokens and "<end_of_image>\n\n" (`full_text`): done on the text before tokenizing where there is text
    (`expand_text`; the newlines then merge with their neighbours as in transformers), else on the tokens.
    Qwen2-VL's write `<|image_pad|>` inside `<|vision_start|>...<|vision_end|>`; its images take as many tokens as
    their size asks (`merge`: the encoder merges merge x merge patches into one token), at M-RoPE positions.
    Mistral 3's write `[IMG]`, which becomes one row of `[IMG]` per row of merged patches (`patch` pixels square),
    each row closed by `[IMG_BREAK]` and the last by `[IMG_END]` (`row_breaks`: their ids), as PixtralProcessor
    expands it. InternVL's write `<IMG_CONTEXT>`, the image token itself: it becomes `<img>`, `tile_tokens` image
    tokens per tile of the image (`tile`: the tile size in pixels) and `</img>` (`wrap`), as InternVLProcessor
    expands it. LLaVA-NeXT's write `<image>` too, which becomes as many image tokens as the image's size makes
    (`anyres`: the tile size, the patches per tile side and the model's image_grid_pinpoints), as
    LlavaNextProcessor counts them. Gemma 4's write `<|image|>`, the image token itself: it becomes `<|image>`, as many
    image tokens as the image pools to at its own size, and `<image|>` (`processor`: streamer/multimodal/processors/gemma4_image_processor.py).

    Videos (Qwen2-VL, Qwen2.5-VL and Qwen3-VL: `video_token_id` set): their templates write `<|video_pad|>` inside
    `<|vision_start|>...<|vision_end|>` (`video_placeholder`); each lone video token becomes the video's tokens, one
    per merged patch of each temporal grid step, at M-RoPE positions whose temporal index steps by 1 per grid step
    (Qwen2-VL) or by tokens_per_second * second_per_grid_t (Qwen2.5-VL: `tokens_per_second` set). Qwen3-VL
    (`frame_wrap`: the vision start and end ids; `encode_text`: the tokenizer, without special tokens) writes each
    grid step as "<{time:.1f} seconds>", start, its tokens and end, as Qwen3VLProcessor does, each step an
    `ImageInput` of one step.
    `no_video`: why a model takes no video (the error a prompt with one gets)."""

    audio_placeholder: Optional[str] = None  # (no audio: streamer/multimodal/audio_prompts.py AudioPrompts takes it)

    def __init__(self, folder: Path, image_token_id: int, tokens_per_image: Optional[int], placeholder: str,
                 max_images: int, placeholder_id: Optional[int] = None, full_text: Optional[str] = None,
                 wrap: tuple[list[int], list[int]] = ([], []), merge: Optional[int] = None,
                 row_breaks: Optional[tuple[int, int]] = None, patch: int = 0, tile_tokens: int = 0,
                 tile: int = 0, video_token_id: Optional[int] = None, video_placeholder: Optional[str] = None,
                 tokens_per_second: Optional[float] = None, no_video: str = "this model takes no video",
                 max_tokens: Optional[int] = None, frame_wrap: Optional[tuple[int, int]] = None,
                 encode_text: Optional[Callable[[str], list[int]]] = None,
                 anyres: Optional[tuple[int, int, tuple[tuple[int, int], ...]]] = None,
                 processor: Any = None) -> None:
        self.folder = folder
        self.frame_wrap = frame_wrap  # Qwen3-VL: each video step between these, after its time as text
        self.encode_text = encode_text
        self.max_tokens = max_tokens  # a video taking more tokens is refused before its frames are processed
        self.video_token_id = video_token_id
        self.video_placeholder = video_placeholder
        self.tokens_per_second = tokens_per_second
        self.no_video = no_video
        self._video_processor: Any = None
        self.merge = merge
        self.row_breaks = row_breaks
        self.patch = patch
        self.tile_tokens = tile_tokens
        self.anyres = anyres
        # (`processor`: one whose `process(images)` gives each image's (pixels, tokens, grid): Gemma 4's)
        self.processor = processor if processor is not None else _qwen_processor(folder) if merge else _pixtral_processor(folder, patch) if row_breaks \
            else _internvl_processor(folder, tile) if tile_tokens else _llava_next_processor(folder, anyres) \
            if anyres else _processor(folder)
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image  # None: each image's own (Qwen2-VL)
        self.placeholder = placeholder  # the text chat templates write for an image
        self.placeholder_id = image_token_id if placeholder_id is None else placeholder_id
        self.full_text = full_text
        self.wrap = wrap  # the tokens before and after the image tokens that replace a placeholder token
        self.max_images = max_images

    def expand_text(self, text: str) -> str:
        return text.replace(self.placeholder, self.full_text) if self.full_text else text

    @property
    def takes_video(self) -> bool:
        return self.video_token_id is not None

    @property
    def video_processor(self) -> Any:
        if self._video_processor is None:
            from streamer.multimodal.processors.qwen_video_processor import Qwen3VideoProcessor, QwenVideoProcessor
            kind = Qwen3VideoProcessor if self.frame_wrap is not None else QwenVideoProcessor
            self._video_processor = kind.from_folder(self.folder)
        return self._video_processor

    def has_placeholders(self, token_ids: list[int]) -> bool:
        return self.image_token_id in token_ids or self.placeholder_id in token_ids or \
            (self.video_token_id is not None and self.video_token_id in token_ids)

    def expand(self, token_ids: list[int], images: Sequence["Image"],
               videos: Sequence[VideoData] = ()) -> tuple[list[int], list[ImageInput]]:
        """Each run of image tokens in the prompt is one image: a lone placeholder is expanded here; a run
        already as long as its image's tokens (expanded text, or a prompt expanded by the caller) is kept. The
        same for videos and runs of the video token."""
        if len(images) > self.max_images:
            raise ValueError(f"at most {self.max_images} images per prompt (limit_images_per_prompt), "
                             f"got {len(images)}")
        if videos and not self.takes_video:
            raise ValueError(f"multi_modal_data['video']: {self.no_video}")
        if len(videos) > self.max_images:
            raise ValueError(f"at most {self.max_images} videos per prompt (limit_images_per_prompt), "
                             f"got {len(videos)}")
        runs = self._runs(token_ids)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) ({self.placeholder}) but "
                             f"{len(images)} image(s) were given")
        video_runs = self._video_runs(token_ids)
        if len(video_runs) != len(videos):
            raise ValueError(f"the prompt has {len(video_runs)} video placeholder(s) ({self.video_placeholder}) "
                             f"but {len(videos)} video(s) were given")
        items = [(run, media, False) for run, media in zip(runs, self._process(images))] + \
            [(run, media, True) for run, media in zip(video_runs, self._process_videos(videos))]
        items.sort(key=lambda item: item[0][0])
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for (start, length, lone), (pixels, n, grid, *extra), video in items:
            if video and self.frame_wrap is not None:  # Qwen3-VL: each grid step after its time, wrapped
                tokens, frames = self._frame_tokens(n, grid, extra[1])
                if not lone and token_ids[start:start + length] != tokens:
                    raise ValueError("an expanded video does not match its video's frames: each video takes 1 "
                                     f"placeholder ({self.video_placeholder}) or exactly its tokens, each temporal "
                                     "step's time (\"<0.5 seconds>\"), <|vision_start|>, its tokens and <|vision_end|>")
                out += token_ids[prev:start]
                step_rows = len(pixels) // grid[0]
                for i, at in enumerate(frames):
                    px, g = pixels[i * step_rows:(i + 1) * step_rows], (1, grid[1], grid[2])
                    inputs.append(ImageInput(len(out) + at, n // grid[0], px, hash_frame(px, g), g, video=True))
                out += tokens
                prev = start + length
                continue
            if video:
                if not lone and token_ids[start:start + length] != [self.video_token_id] * n:
                    raise ValueError(f"a run of {length} video tokens: each video takes 1 placeholder "
                                     f"({self.video_placeholder}) or exactly its {n} video tokens")
                out += token_ids[prev:start]
                inputs.append(ImageInput(len(out), n, pixels, hash_video(pixels, extra[0]), grid, video=True,
                                         time_interval=extra[0]))
                out += [self.video_token_id] * n  # type: ignore[list-item]
                prev = start + length
                continue
            image_tokens = self._image_tokens(n, grid)
            if not lone and token_ids[start:start + length] != image_tokens:
                if self.row_breaks:
                    raise ValueError(f"an expanded image of {length} tokens does not match its image's {n}: each "
                                     f"image takes 1 placeholder ({self.placeholder}) or exactly its rows of image "
                                     "tokens, each row closed by [IMG_BREAK], the last by [IMG_END]")
                raise ValueError(f"a run of {length} image tokens: each image takes 1 placeholder "
                                 f"({self.placeholder}) or exactly its {n} image tokens")
            out += token_ids[prev:start] + (self.wrap[0] if lone else [])
            mask = None if self.row_breaks is None else np.asarray(image_tokens) == self.image_token_id
            size = extra[0] if extra else None  # (LLaVA-NeXT's)
            inputs.append(ImageInput(len(out), n, pixels, hash_sized(pixels, size), grid, feature_mask=mask,
                                     size=size))
            out += image_tokens + (self.wrap[1] if lone else [])
            prev = start + length
        out += token_ids[prev:]
        if self.merge:
            _place_mrope(inputs, self.merge)
        return out, inputs

    def _frame_tokens(self, n: int, grid: tuple[int, int, int], times: list[float]) -> tuple[list[int], list[int]]:
        """Qwen3-VL: a video's prompt tokens (Qwen3VLProcessor.replace_video_token, tokenized) and where each grid
        step's video tokens start in them."""
        assert self.frame_wrap is not None and self.encode_text is not None and self.video_token_id is not None
        start, end = self.frame_wrap
        per_step = n // grid[0]
        tokens: list[int] = []
        starts = []
        for t in times:
            tokens += self.encode_text(f"<{t:.1f} seconds>") + [start]
            starts.append(len(tokens))
            tokens += [self.video_token_id] * per_step + [end]
        return tokens, starts

    def _image_tokens(self, n: int, grid: Optional[tuple[int, int, int]]) -> list[int]:
        """The n tokens an image takes in the prompt."""
        if self.row_breaks is None:
            return [self.image_token_id] * n
        assert grid is not None
        rows, cols = grid[1], grid[2]
        tokens = ([self.image_token_id] * cols + [self.row_breaks[0]]) * rows
        tokens[-1] = self.row_breaks[1]
        return tokens

    def _process(self, images: Sequence["Image"]) -> list[tuple[Any, ...]]:
        """Each image's (pixel values, tokens, patch grid; Mistral 3: its grid of merged tokens; LLaVA-NeXT: and its
        original (height, width))."""
        if not images:
            return []
        if hasattr(self.processor, "process"):
            return self.processor.process(list(images))
        if self.anyres:
            return [(px, self.processor.num_tokens(*size), None, size) for px, size in self.processor(list(images))]
        if self.row_breaks:
            out = []
            for px in self.processor(list(images)):
                rows, cols = px.shape[1] // self.patch, px.shape[2] // self.patch
                out.append((px, rows * (cols + 1), (1, rows, cols)))
            return out
        if self.tile_tokens:
            return [(px, px.shape[0] * self.tile_tokens, None) for px in self.processor(list(images))]
        if not self.merge:
            assert self.tokens_per_image is not None
            return [(px, self.tokens_per_image, None) for px in self.processor(list(images))]
        pixels, grids = self.processor(list(images))
        sizes = [int(t * h * w) for t, h, w in grids.tolist()]
        return [(px, size // self.merge ** 2, tuple(g)) for px, size, g in
                zip(pixels.split(sizes), sizes, grids.tolist())]

    def _process_videos(self, videos: Sequence[VideoData]) -> list[tuple[torch.Tensor, int, tuple[int, int, int],
                                                                         float, Optional[list[float]]]]:
        """Each video's (pixel values, tokens, patch grid, M-RoPE temporal step, Qwen3-VL: each step's time)."""
        if not videos:
            return []
        assert self.merge is not None
        processor = self.video_processor
        processed = processor.process([v.frames for v in videos], [v.fps for v in videos],
                                      [v.sample for v in videos], self.max_tokens, [v.indices for v in videos])
        out = []
        for v in processed:
            # transformers: tokens_per_second * second_per_grid_t, a float32 tensor (Qwen2-VL: 1)
            step = 1.0 if self.tokens_per_second is None else \
                float(self.tokens_per_second * torch.tensor(v.seconds, dtype=torch.float32))
            times = processor.timestamps(v) if self.frame_wrap is not None else None
            t, h, w = v.grid
            out.append((torch.from_numpy(v.pixels), t * h * w // self.merge ** 2, v.grid, step, times))
        return out

    def _video_runs(self, token_ids: list[int]) -> list[tuple[int, int, bool]]:
        """(start, length, lone) of each video: a maximal run of video tokens (a run of one is a placeholder)."""
        if self.video_token_id is None:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        runs = [(a, n, n == 1) for a, n in token_runs(ids, self.video_token_id)]
        if self.frame_wrap is None:
            return runs
        # Qwen3-VL: an expanded video is its steps' runs, each "<t seconds>" <start> tokens <end>: consecutive runs
        # with only an end, text and a start between them are one video, from the first step's time on
        start, end = self.frame_wrap
        groups: list[tuple[int, int, bool]] = []
        prev_end = -1
        for a, n, lone in runs:
            gap = ids[prev_end:a]
            if not lone and groups and not groups[-1][2] and prev_end >= 0 and ids[prev_end] == end and \
                    ids[a - 1] == start and not np.isin(gap[1:-1], [start, end]).any():
                groups[-1] = (groups[-1][0], a + n + 1 - groups[-1][0], False)
            elif lone:
                groups.append((a, 1, True))
            else:
                before = np.flatnonzero(ids[:max(a - 1, 0)] == start)  # the video's own start, before its first time
                first = int(before[-1]) + 1 if len(before) else max(a - 1, 0)
                groups.append((first, a + n + 1 - first, False))
            prev_end = a + n
        return groups

    def _runs(self, token_ids: list[int]) -> list[tuple[int, int, bool]]:
        """(start, length, lone) of each image in the prompt: a lone placeholder (not followed by image tokens)
        or a maximal run of image tokens."""
        ids = np.asarray(token_ids, dtype=np.int64)
        img, ph = self.image_token_id, self.placeholder_id
        if self.row_breaks:
            return self._pixtral_runs(ids)
        runs = [(a, n, False) for a, n in token_runs(ids, img)]
        if ph != img:  # lone placeholders (Gemma 3's <start_of_image> not followed by its image tokens)
            nxt = np.concatenate([ids[1:], [-1]])
            runs += [(int(i), 1, True) for i in np.flatnonzero((ids == ph) & (nxt != img))]
        else:  # LLaVA / Qwen: a run of one image token is a placeholder to expand
            runs = [(a, n, True) if n == 1 else (a, n, False) for a, n, _ in runs]
        return sorted(runs)

    def _pixtral_runs(self, ids: np.ndarray) -> list[tuple[int, int, bool]]:
        """Mistral 3: an expanded image is a run of [IMG] / [IMG_BREAK] tokens ending in [IMG_END]; each [IMG]
        outside one is a placeholder (two images in a row are "[IMG][IMG]")."""
        img, (brk, end) = self.image_token_id, self.row_breaks  # type: ignore[misc]
        mask = np.concatenate([[False], np.isin(ids, [img, brk, end]), [False]])
        edges = np.flatnonzero(mask[1:] != mask[:-1])
        runs: list[tuple[int, int, bool]] = []
        for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
            ends = np.flatnonzero(ids[a:b] == end).tolist()
            start = a
            for e in ends:  # each [IMG_END] closes an expanded image (a stray one, holding no [IMG], is text)
                if (ids[start:a + e] == img).any():
                    runs.append((start, a + e + 1 - start, False))
                start = a + e + 1
            rest = ids[start:b]
            if (rest == brk).any() and (rest == img).any():
                raise ValueError("image tokens with an [IMG_BREAK] but no [IMG_END] after it: an expanded image "
                                 "must end with [IMG_END]")
            runs += [(start + i, 1, True) for i in np.flatnonzero(rest == img).tolist()]  # placeholders
        return runs


def token_runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    mask = np.concatenate([[False], np.asarray(ids) == token, [False]])
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def _processor(folder: Path) -> Any:
    from streamer.multimodal.processors.image_processor import ImageProcessor
    return ImageProcessor.from_folder(folder)


def _llava_next_processor(folder: Path, anyres: tuple[int, int, tuple[tuple[int, int], ...]]) -> Any:
    from streamer.multimodal.processors.llava_next_image_processor import LlavaNextImageProcessor
    return LlavaNextImageProcessor.from_folder(folder, *anyres)


def _pixtral_processor(folder: Path, patch: int) -> Any:
    from streamer.multimodal.processors.pixtral_image_processor import PixtralImageProcessor
    return PixtralImageProcessor.from_folder(folder, patch)


def _internvl_processor(folder: Path, tile: int) -> Any:
    from streamer.multimodal.processors.internvl_image_processor import InternVLImageProcessor
    return InternVLImageProcessor.from_folder(folder, tile)


def _qwen_processor(folder: Path) -> Any:
    from streamer.multimodal.processors.qwen_image_processor import QwenImageProcessor
    return QwenImageProcessor.from_folder(folder)


def _place_mrope(inputs: list[ImageInput], merge: int) -> None:
    """Qwen2-VL's M-RoPE positions (transformers' get_rope_index; Qwen3-VL's is the same for images and for each
    step of a video, a one-step grid of its own): an image's
    or video's tokens sit at (t, h, w) offsets from the position after the text before it, the temporal offset of
    grid step i being floor(i * time_interval) (Qwen2.5-VL's videos: tokens_per_second * second_per_grid_t; else
    1); the text after it continues past the largest position, as the original Qwen2-VL / 2.5-VL code (transformers
    4's get_rope_index) and vLLM place it. (transformers 5.x continues after max(h, w) only, whatever the temporal
    extent, while its own decode steps continue past the largest position: the two agree when a video's temporal
    extent (t - 1) * time_interval is below max(h, w), always for images.)"""
    shift = 0
    for im in inputs:
        assert im.grid is not None
        t, h, w = im.grid[0], im.grid[1] // merge, im.grid[2] // merge
        base = im.offset + shift
        steps = np.arange(t, dtype=np.int64)
        if im.time_interval != 1.0:  # (transformers: (arange(t) * interval).long() in float32)
            steps = (torch.arange(t) * torch.tensor(im.time_interval, dtype=torch.float32)).long().numpy()
        grid = np.stack(np.meshgrid(steps, np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        im.mrope = grid.astype(np.int64) + base
        shift += int(im.mrope.max()) + 1 - base - im.length
        im.rope_shift = shift


@dataclass
class ImageStep:
    """A step's image tokens: `token_idx` (int64 [M], rows of the step's flat token batch) take row `rows[m]` of
    the `images`' features stacked in order; `last_pos[m]` is the last position of the token's image (a model
    whose images attend both ways lets the token see that far)."""

    token_idx: np.ndarray
    images: list[ImageInput]
    rows: np.ndarray
    last_pos: np.ndarray
    mrope: Optional[np.ndarray] = None  # M-RoPE: [3, M] the tokens' (temporal, height, width) positions


def image_step(reqs: Sequence["Request"], token_starts: np.ndarray, starts: np.ndarray,
               q_lens: np.ndarray) -> Optional[ImageStep]:
    """The image tokens among the given requests' scheduled chunks (request i computes positions
    [starts[i], starts[i] + q_lens[i]), at rows token_starts[i]... of the step); None if there are none."""
    base: dict[bytes, int] = {}
    images: list[ImageInput] = []
    idx, rows, last, mrope = [], [], [], []
    total = 0
    for req, t0, start, q in zip(reqs, token_starts.tolist(), starts.tolist(), q_lens.tolist()):
        for img in req.images:
            lo, hi = max(start, img.offset), min(start + q, img.end)
            if lo >= hi:
                continue
            at = np.arange(lo - img.offset, hi - img.offset, dtype=np.int64)  # positions within the image
            feature_rows = at
            if img.feature_mask is not None:  # only these positions take features: row = features before it
                at = at[img.feature_mask[at]]
                if not len(at):
                    continue
                feature_rows = np.cumsum(img.feature_mask)[at] - 1
            if img.hash not in base:
                base[img.hash] = total
                images.append(img)
                total += img.num_features
            idx.append(at + img.offset - start + t0)
            rows.append(feature_rows + base[img.hash])
            last.append(np.full(len(at), img.end - 1, dtype=np.int64))
            if img.mrope is not None:
                mrope.append(img.mrope[:, at])
    if not idx:
        return None
    return ImageStep(np.concatenate(idx), images, np.concatenate(rows), np.concatenate(last),
                     np.concatenate(mrope, axis=1) if mrope else None)


def rope_shifts(req: "Request", positions: np.ndarray) -> np.ndarray:
    """M-RoPE: what each of the request's token positions adds to its index (the shift of the last image that
    ends at or before it; image tokens themselves take their [3] positions from `ImageInput.mrope`)."""
    ends = np.array([im.end for im in req.images], dtype=np.int64)
    shifts = np.array([0] + [im.rope_shift for im in req.images], dtype=np.int64)
    return shifts[np.searchsorted(ends, positions, side="right")]


class EncoderCache:
    """Image features by image hash, least recently used first out past a byte budget. An image's features are
    needed by every chunk that covers part of it (and again after a preemption, or by another request with the
    same image): kept, they are computed once."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.num_encoded = 0  # images run through the encoder (a cache miss each)

    def get(self, key: bytes) -> Optional[torch.Tensor]:
        t = self.entries.get(key)
        if t is not None:
            self.entries.move_to_end(key)
        return t

    def put(self, key: bytes, features: torch.Tensor) -> None:
        self.num_encoded += 1
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self.entries[key] = features
        self.bytes += features.nbytes
        while self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.nbytes


# ---------------------------------------------------------------------------------------------- fetching images
def load_image(url: str, policy: FetchPolicy = DEFAULT_POLICY) -> "Image":
    """An image from a chat message's `image_url`: a data: URL (base64) or an http(s) URL `policy` lets the server
    fetch (streamer/multimodal/media_fetch.py). ValueError for anything else or anything that is not an image."""
    return decode_image(read_url(url, policy, "image", MAX_IMAGE_BYTES, "image/png"))


def read_url(url: str, policy: FetchPolicy, what: str, limit: int, mime: str) -> bytes:
    """The bytes of a data: URL (base64) or of an http(s) URL fetched under `policy` (media_fetch.fetch), at most
    `limit` of them; `what` ("image", "video") and an example `mime` type name them in errors."""
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if ";base64" not in head:
            raise ValueError(f"{'an' if what[0] in 'aeiou' else 'a'} {what} data URL must be base64-encoded "
                             f"(data:{mime};base64,...)")
        if len(payload) > limit * 4 // 3 + 4:
            raise ValueError(f"{what} is larger than {limit >> 20} MiB")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"the {what} data URL is not valid base64") from None
    if url.startswith(("http://", "https://")):
        return fetch(url, policy, what, limit)
    raise ValueError(f"{what}_url must be a data: URL or an http(s) URL, got {url[:40]!r}")


class VideoBackendMissing(ValueError):
    """PyAV (the optional `av` package) is not installed: videos from URLs cannot be decoded."""


def load_video(url: str, policy: FetchPolicy = DEFAULT_POLICY, fps: float = 2.0,
               max_frames: int = MAX_VIDEO_FRAMES) -> VideoData:
    """A video from a chat message's `video_url`: a data: URL (base64) or an http(s) URL `policy` lets the server
    fetch, decoded with PyAV and sampled at `fps` frames a second (`decode_video`). ValueError for anything else."""
    return decode_video(read_url(url, policy, "video", MAX_VIDEO_BYTES, "video/mp4"), fps, max_frames)


def decode_video(data: bytes, fps: float = 2.0, max_frames: int = MAX_VIDEO_FRAMES) -> VideoData:
    """A video file's frames (RGB uint8 [T, H, W, 3]), sampled at `fps` frames a second of its timestamps (a
    frame is kept when its time reaches the next sample's), or more sparsely where the video is longer than
    max_frames / fps seconds, so that at most max_frames are kept, spread over its whole length (a video of unknown
    length is cut at max_frames); with the sampled frames' rate, for Qwen2.5-VL's second_per_grid_ts. ValueError
    for an undecodable, too long (MAX_VIDEO_DECODED_FRAMES) or too large (MAX_VIDEO_FRAME_PIXELS) video;
    `VideoBackendMissing` without PyAV."""
    try:
        import av
    except ImportError:
        raise VideoBackendMissing("video input needs PyAV, which is not installed: pip install av (or "
                                  "pip install 'streamer[video]')") from None
    if not fps > 0 or max_frames < 1:
        raise ValueError(f"video sampling needs fps > 0 and max_frames >= 1, got {fps}, {max_frames}")
    kept: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file holds no video stream")
            stream = container.streams.video[0]
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1_000_000  # (av.time_base)
            step = 1.0 / fps
            if duration and duration > 0:
                step = max(step, duration / max_frames)
            next_time, start, decoded = 0.0, None, 0
            for frame in container.decode(stream):
                decoded += 1
                if decoded > MAX_VIDEO_DECODED_FRAMES:
                    raise ValueError(f"the video is too long: more than {MAX_VIDEO_DECODED_FRAMES} frames")
                if frame.width * frame.height > MAX_VIDEO_FRAME_PIXELS:
                    raise ValueError(f"the video's frames ({frame.width}x{frame.height}) are larger than "
                                     f"{MAX_VIDEO_FRAME_PIXELS} pixels")
                time = frame.time if frame.time is not None else (decoded - 1) / fps
                start = time if start is None else start
                if time - start + 1e-6 >= next_time:
                    kept.append(frame.to_ndarray(format="rgb24"))
                    if kept[-1].shape != kept[0].shape:
                        raise ValueError("the video changes resolution midway")
                    next_time += step
                    if len(kept) >= max_frames:
                        break
    except av.error.FFmpegError as e:  # (some are ValueErrors too)
        raise ValueError(f"not a readable video ({type(e).__name__}: {e})") from None
    except ValueError:
        raise
    except Exception as e:  # anything else PyAV raises on a file it cannot read
        raise ValueError(f"not a readable video ({type(e).__name__}: {e})") from None
    if not kept:
        raise ValueError("the video has no frames")
    return VideoData(np.stack(kept), 1.0 / step, sample=False)


def decode_image(data: bytes) -> "Image":
    from PIL import Image, UnidentifiedImageError
    try:
        im = Image.open(io.BytesIO(data))
        im.load()  # decode now: a truncated file fails here, not in the image processor
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as e:
        raise ValueError(f"not a readable image ({type(e).__name__}: {e})") from None
    return im

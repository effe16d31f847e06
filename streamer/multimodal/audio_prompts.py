"""Audio clips in prompts, for audio-language models (Qwen2-Audio: models/vlm.py Qwen2AudioMixin).

A clip enters a prompt as images do (streamer/multimodal/inputs.py): a run of placeholder tokens, one per feature row its
encoder makes, whose input embeddings are those rows. So a clip is an `ImageInput` whose pixel_values are its
log-mel features (Whisper's, streamer/multimodal/audio.py, with the checkpoint's preprocessor_config.json: 128 mel bins for
Qwen2-Audio), padded to 30 s as Qwen2AudioProcessor pads them, and whose `frames` is how many mel frames hold the
clip; it takes `audio_tokens(frames)` tokens. Clips longer than 30 s are cut to their first 30 s, as the processor
cuts them. Prefix caching and the encoder cache key on a hash of the features and the frame count.

Where clips come from: `multi_modal_data={"audio": clip or [clips]}` (a clip: float samples at 16 kHz, or
(samples, sample_rate) as vLLM takes it: streamer/multimodal/audio.py `as_audio`), and in chat messages OpenAI's
`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}` or vLLM's
`{"type": "audio_url", "audio_url": {"url": ...}}` parts (`load_audio`: any container streamer/multimodal/audio.py decodes).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from streamer.multimodal.audio import (
    MAX_AUDIO_BYTES,
    SAMPLE_RATE,
    WhisperFeatureConfig,
    WhisperFeatures,
    as_audio,
    decode_audio,
)
from streamer.multimodal.inputs import ImageInput, hash_pixels, read_url, token_runs
from streamer.multimodal.media_fetch import DEFAULT_POLICY, FetchPolicy

MIN_FRAMES = 3  # the fewest mel frames that make a feature row (audio_tokens(3) == 1): 0.02 s at 16 kHz


class AudioPrompts:
    """Turns (prompt tokens, clips) into the prompt the model reads: each lone audio token (the chat template's
    `<|audio_bos|><|AUDIO|><|audio_eos|>`) expanded to its clip's feature rows; a run already as long as its
    clip's tokens (a prompt the caller expanded) is kept. The interface ImagePrompts offers the engine, the server
    and LLM.chat (`expand`, `has_placeholders`, `expand_text`, the placeholders), for audio."""

    placeholder: Optional[str] = None  # (no images)
    video_placeholder: Optional[str] = None
    takes_video = False
    no_video = "this model takes no video"

    def __init__(self, folder: Path, audio_token_id: int, audio_placeholder: str, max_audios: int) -> None:
        cfg = WhisperFeatureConfig.from_folder(folder)
        if cfg.sampling_rate != SAMPLE_RATE:
            raise ValueError(f"{folder}: the feature extractor's sampling_rate is {cfg.sampling_rate}; audio models "
                             f"are served at {SAMPLE_RATE} Hz")
        self.features = WhisperFeatures(cfg)
        self.audio_token_id = audio_token_id
        self.audio_placeholder = audio_placeholder  # the text chat templates write for a clip
        self.max_audios = max_audios

    def expand_text(self, text: str) -> str:
        return text

    def has_placeholders(self, token_ids: list[int]) -> bool:
        return self.audio_token_id in token_ids

    def expand(self, token_ids: list[int], clips: Sequence[np.ndarray]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each clip's placeholder expanded, and an input per clip (float32 16 kHz samples)."""
        if len(clips) > self.max_audios:
            raise ValueError(f"at most {self.max_audios} audio clips per prompt (limit_images_per_prompt), "
                             f"got {len(clips)}")
        runs = token_runs(np.asarray(token_ids, dtype=np.int64), self.audio_token_id)
        if len(runs) != len(clips):
            raise ValueError(f"the prompt has {len(runs)} audio placeholder(s) ({self.audio_placeholder}) but "
                             f"{len(clips)} audio clip(s) were given")
        from streamer.models.audio_tower import audio_tokens  # (Qwen2-Audio's model file: imported when it runs)
        out: list[int] = []
        inputs: list[ImageInput] = []
        prev = 0
        for (start, length), clip in zip(runs, clips):
            features, frames = self.process(clip)
            n = audio_tokens(frames)
            if length not in (1, n):
                raise ValueError(f"a run of {length} audio tokens: each clip takes 1 placeholder "
                                 f"({self.audio_placeholder}) or exactly its {n} audio tokens")
            out += token_ids[prev:start]
            inputs.append(ImageInput(len(out), n, features, hash_clip(features, frames), frames=frames))
            out += [self.audio_token_id] * n
            prev = start + length
        out += token_ids[prev:]
        return out, inputs

    def process(self, clip: np.ndarray) -> tuple[torch.Tensor, int]:
        """A clip's (log-mel features [mels, 3000], frames holding it): Qwen2AudioProcessor's features and
        feature_attention_mask count (ceil(samples / hop), the samples cut at 30 s)."""
        cfg = self.features.cfg
        samples = min(len(clip), cfg.n_samples)
        frames = -(-samples // cfg.hop_length)
        if frames < MIN_FRAMES:
            raise ValueError(f"an audio clip of {len(clip)} samples is too short: it needs at least "
                             f"{(MIN_FRAMES - 1) * cfg.hop_length + 1} ({MIN_FRAMES} mel frames)")
        return self.features(clip), frames


def hash_clip(features: torch.Tensor, frames: int) -> bytes:
    """A clip's key: its features and how many frames hold it."""
    h = hashlib.blake2b(b"audio clip", digest_size=16)
    h.update(hash_pixels(features))
    h.update(np.int64(frames).tobytes())
    return h.digest()


def as_clips(value: Any) -> list[np.ndarray]:
    """`multi_modal_data["audio"]`: one clip (samples, or (samples, sample_rate)) or a list of them -> float32
    mono clips at 16 kHz (streamer/multimodal/audio.py `as_audio`; ValueError naming what is wrong)."""
    one = isinstance(value, (np.ndarray, torch.Tensor)) or (
        isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (np.ndarray, torch.Tensor, list))
        and not isinstance(value[1], (np.ndarray, torch.Tensor, list, tuple)))
    items = [value] if one else value
    if not isinstance(items, (list, tuple)):
        raise ValueError("multi_modal_data['audio'] must be a clip (float samples at 16 kHz, or (samples, "
                         f"sample_rate)) or a list of clips, got {type(value).__name__}")
    try:
        return [as_audio(v) for v in items]
    except ValueError as e:
        raise ValueError(f"multi_modal_data['audio']: {e}") from None


def load_audio(url: str, policy: FetchPolicy = DEFAULT_POLICY) -> np.ndarray:
    """A chat message's clip: a data: URL (base64; `input_audio` parts become one) or an http(s) URL `policy` lets
    the server fetch (streamer/multimodal/media_fetch.py); decoded to 16 kHz mono. ValueError for anything else or anything
    that is not audio."""
    return decode_audio(read_url(url, policy, "audio", MAX_AUDIO_BYTES, "audio/wav"))

"""Audio for speech-to-text models (Whisper): bytes of an uploaded file -> float32 mono samples, resampling, splitting
long audio at quiet points, and Whisper's log-mel input features.

WAV is parsed here with no dependency; every other container and codec (mp3, flac, ogg/opus, m4a, webm ...) goes
through PyAV, imported only when such a file arrives, so that `pip install streamer` serves WAV without it.
The features are transformers' WhisperFeatureExtractor's, reimplemented in torch (transformers is not a runtime
dependency): the same padding, STFT, mel filter bank and log scaling, so the model sees what it was trained on.
"""
from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

SAMPLE_RATE = 16_000
MAX_AUDIO_BYTES = 25 * 2**20  # OpenAI's upload limit for /v1/audio/transcriptions

# Resampling filter: a Kaiser-windowed sinc with ZERO_CROSSINGS zero crossings each side of its centre, its cutoff
# ROLLOFF of the lower Nyquist frequency (the transition band must end before Nyquist, or what lies above aliases).
ZERO_CROSSINGS = 24
ROLLOFF = 0.95
KAISER_BETA = 8.6  # ~ -85 dB stop band
_PHASE_TABLE_MAX = 4096  # rate pairs with more phases than this compute each output sample's weights instead
_CHUNK = 1 << 15  # output samples resampled at a time: bounds the gathered [chunk, taps] block's memory

_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 0x0001, 0x0003, 0xFFFE


class AudioBackendMissing(ValueError):
    """A file that only PyAV can decode (anything but PCM / float WAV), and PyAV is not installed."""


# ---------------------------------------------------------------------------------------------------- decoding

def decode_audio(data: bytes, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """float32 mono in [-1, 1] at `sample_rate`. WAV (RIFF) is parsed by our own code (PCM 8/16/24/32-bit integer,
    IEEE float 32/64 (format tag 3), WAVE_FORMAT_EXTENSIBLE wrapping either) with no dependency; anything else
    (mp3, flac, ogg/opus, m4a, webm ...) through PyAV (decoded, resampled by PyAV's AudioResampler, channels
    averaged as for WAV). Empty / undecodable / truncated data -> ValueError with a clear message."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"audio data must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise ValueError("audio data is empty")
    if len(data) > MAX_AUDIO_BYTES:
        raise ValueError(f"audio file is {len(data)} bytes; the limit is {MAX_AUDIO_BYTES} (25 MiB)")
    _check_rate(sample_rate, "sample_rate")
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        wav = _parse_wav(data)
        if wav is not None:
            audio, rate = wav
            return _finish(resample(audio, rate, sample_rate))
        # A WAV of another codec (ADPCM, mu-law, ...): FFmpeg knows them.
    return _finish(_decode_with_pyav(data, sample_rate))


def _finish(audio: np.ndarray) -> np.ndarray:
    if audio.size == 0:
        raise ValueError("audio file holds no samples")
    # Float formats (and the resampler's overshoot near full scale) may leave [-1, 1].
    return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)


def _chunks(data: bytes) -> dict[bytes, bytes]:
    """The RIFF chunks after the WAVE tag, first of each id. A data chunk of size 0xFFFFFFFF (a WAV streamed to a
    pipe, its length unknown when the header was written) runs to the end of the file."""
    chunks: dict[bytes, bytes] = {}
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"data" and size == 0xFFFFFFFF:
            size = len(data) - body
        if body + size > len(data):
            raise ValueError(f"WAV file is truncated: its {cid.decode('latin-1')!r} chunk declares {size} bytes, "
                             f"{len(data) - body} remain")
        chunks.setdefault(cid, data[body:body + size])
        pos = body + size + (size & 1)  # chunks are word-aligned
    return chunks


def _parse_wav(data: bytes) -> tuple[np.ndarray, int] | None:
    """(mono float samples, rate) of a PCM / float WAV; None for a WAV of another codec."""
    chunks = _chunks(data)
    fmt, raw = chunks.get(b"fmt "), chunks.get(b"data")
    if fmt is None or len(fmt) < 16:
        raise ValueError("WAV file has no valid 'fmt ' chunk")
    if raw is None:
        raise ValueError("WAV file has no 'data' chunk (truncated?)")
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_EXTENSIBLE:
        if len(fmt) < 40:
            raise ValueError("WAVE_FORMAT_EXTENSIBLE 'fmt ' chunk is shorter than 40 bytes")
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the first two bytes of the SubFormat GUID
    if tag not in (_WAVE_PCM, _WAVE_FLOAT):
        return None
    if channels < 1 or rate < 1:
        raise ValueError(f"WAV header is invalid: {channels} channels at {rate} Hz")
    width = bits // 8
    supported = (1, 2, 3, 4) if tag == _WAVE_PCM else (4, 8)
    if bits % 8 or width not in supported or block_align != width * channels:
        kind = "PCM" if tag == _WAVE_PCM else "float"
        raise ValueError(f"unsupported WAV sample format: {kind} with {bits} bits, block align {block_align}")
    frames = len(raw) // block_align  # a trailing partial frame (a writer's padding) is dropped
    samples = _pcm_to_float(raw[:frames * block_align], width, tag == _WAVE_FLOAT)
    if not np.isfinite(samples).all():
        raise ValueError("WAV file holds NaN or infinite samples")
    return samples.reshape(frames, channels).mean(axis=1, dtype=np.float64).astype(np.float32), rate


def _pcm_to_float(raw: bytes, width: int, is_float: bool) -> np.ndarray:
    if is_float:
        return np.frombuffer(raw, "<f4" if width == 4 else "<f8").astype(np.float32)
    if width == 1:  # 8-bit WAV is unsigned, centred on 128
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 3:  # 24-bit: put each sample in the top three bytes of an int32, so its scale is that of 32-bit
        wide = np.zeros((len(raw) // 3, 4), np.uint8)
        wide[:, 1:] = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        return wide.view("<i4")[:, 0].astype(np.float32) / 2.0**31
    dtype = "<i2" if width == 2 else "<i4"
    return np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (8 * width - 1))


def _import_av() -> Any:
    try:
        import av
    except ImportError as e:
        raise AudioBackendMissing(
            "decoding this audio format needs PyAV: pip install 'streamer[audio]' (or pip install av); "
            "WAV (PCM or float) is read without it") from e
    return av


def _decode_with_pyav(data: bytes, sample_rate: int) -> np.ndarray:
    av = _import_av()
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise ValueError("the file has no audio stream")
            stream = container.streams.audio[0]
            # Planar float at the target rate (FFmpeg's swresample), channels averaged here: swresample's own
            # stereo -> mono mix is (L + R) / sqrt(2), louder than the WAV path's mean.
            resampler = av.AudioResampler(format="fltp", rate=sample_rate)
            frames = [f for frame in container.decode(stream) for f in resampler.resample(frame)]
            frames += resampler.resample(None)  # the resampler's tail
            parts = [f.to_ndarray().mean(axis=0, dtype=np.float32) for f in frames]
    except av.FFmpegError as e:
        raise ValueError(f"could not decode audio: {e}") from e
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


# ---------------------------------------------------------------------------------------------------- resampling

def resample(audio: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Band-limited resampling of 1-D audio: a Kaiser-windowed sinc, evaluated per phase (polyphase: the
    target_sr / gcd distinct fractional offsets of output samples between input samples), vectorised in torch.
    Returns float32 with ceil(len(audio) * target_sr / orig_sr) samples: output sample n sits at time
    n / target_sr, and those at times before the input's end len / orig_sr are kept. The input is taken to be zero
    outside its span. Identity (a float32 copy) when the rates are equal."""
    _check_rate(orig_sr, "orig_sr")
    _check_rate(target_sr, "target_sr")
    x = np.asarray(audio, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"resample takes 1-D audio, got shape {x.shape}")
    if orig_sr == target_sr or x.size == 0:
        return x.copy()
    g = math.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g
    n_out = -(-x.size * up // down)
    # Cutoff in cycles per input sample: below the lower of the two Nyquist frequencies.
    cutoff = 0.5 * min(1.0, up / down) * ROLLOFF
    half = ZERO_CROSSINGS / (2 * cutoff)  # the filter's half-width, in input samples
    taps = int(math.ceil(half))
    offsets = torch.arange(-taps + 1, taps + 1, dtype=torch.float64)  # tap k reads input i0 + k
    xp = torch.nn.functional.pad(torch.from_numpy(x), (taps, taps + 1))
    table = _sinc_weights(torch.arange(up, dtype=torch.float64) / up, offsets, cutoff, half) \
        if up <= _PHASE_TABLE_MAX else None
    out = torch.empty(n_out, dtype=torch.float32)
    for start in range(0, n_out, _CHUNK):
        n = torch.arange(start, min(start + _CHUNK, n_out), dtype=torch.int64)
        i0, phase = (n * down) // up, (n * down) % up  # output n at input position i0 + phase / up
        w = table[phase] if table is not None else _sinc_weights(phase.double() / up, offsets, cutoff, half)
        window = xp[(i0 + taps)[:, None] + offsets.long()[None, :]]  # xp[j + taps] is x[j]
        out[start:start + n.numel()] = (window * w).sum(dim=1)
    return out.numpy()


def _sinc_weights(frac: torch.Tensor, offsets: torch.Tensor, cutoff: float, half: float) -> torch.Tensor:
    """float32 [len(frac), taps] weights, for output samples `frac` of an input sample past input i0, of the
    inputs i0 + offsets.
    Each row sums to 1, so a constant signal keeps its level exactly whatever the truncation of the sinc."""
    d = frac[:, None] - offsets[None, :]  # distance from the output sample to each tap, in input samples
    sinc = torch.special.sinc(2 * cutoff * d)
    inside = (1 - (d / half) ** 2).clamp(min=0)
    kaiser = torch.special.i0(KAISER_BETA * inside.sqrt()) / torch.special.i0(torch.tensor(KAISER_BETA))
    w = sinc * torch.where(inside > 0, kaiser, torch.zeros_like(kaiser))
    return (w / w.sum(dim=1, keepdim=True)).float()


def _check_rate(rate: Any, name: str) -> None:
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise ValueError(f"{name} must be a positive integer number of Hz, got {rate!r}")


# ---------------------------------------------------------------------------------------------------- inputs

def as_audio(value: Any) -> np.ndarray:
    """A `multi_modal_data["audio"]` item -> float32 mono at SAMPLE_RATE: a 1-D np.ndarray / torch.Tensor / list of
    floats (taken to be at 16 kHz already), or a tuple (array, sample_rate) as vLLM takes it (resampled); 2-D arrays
    (channels x samples or samples x channels, the smaller dimension being channels) are averaged to mono; int16
    arrays scaled by 1/32768. Bad input (wrong type, 3-D, empty, NaN/inf, non-positive sample rate) -> ValueError
    naming what is wrong."""
    rate = SAMPLE_RATE
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (np.ndarray, torch.Tensor, list)):
        value, rate = value
        rate = _tuple_rate(rate)
    audio = _to_mono(_to_array(value))
    if not np.isfinite(audio).all():
        raise ValueError("audio holds NaN or infinite samples")
    return resample(audio, rate, SAMPLE_RATE) if rate != SAMPLE_RATE else audio


def _tuple_rate(rate: Any) -> int:
    # A float rate is fine when whole (16000.0, as some loaders give it); the resampler needs an integer.
    if isinstance(rate, (float, np.floating)) and float(rate).is_integer():
        rate = int(rate)
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise ValueError(f"audio sample rate must be an integer number of Hz, got {rate!r}")
    if rate <= 0:
        raise ValueError(f"audio sample rate must be positive, got {rate}")
    return int(rate)


def _to_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.float().numpy() if value.is_floating_point() else value.numpy()
    elif isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise ValueError(f"audio list must hold numbers (ragged or non-numeric: {e})") from e
    elif not isinstance(value, np.ndarray):
        raise ValueError(f"audio must be an array, a tensor, a list of floats or (array, sample_rate), "
                         f"not {type(value).__name__}")
    if value.dtype == np.int16:  # 16-bit PCM samples
        return value.astype(np.float32) / 32768.0
    if value.dtype.kind != "f":
        raise ValueError(f"audio dtype must be floating point or int16, got {value.dtype}")
    return value.astype(np.float32, copy=False)


def _to_mono(audio: np.ndarray) -> np.ndarray:
    if audio.ndim == 2:  # the smaller dimension is channels
        audio = audio.mean(axis=0 if audio.shape[0] <= audio.shape[1] else 1, dtype=np.float32)
    elif audio.ndim != 1:
        raise ValueError(f"audio must be 1-D (samples) or 2-D (channels and samples), got shape {audio.shape}")
    if audio.size == 0:
        raise ValueError("audio is empty")
    return np.ascontiguousarray(audio, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------- splitting

def split_audio(audio: np.ndarray, max_seconds: float = 30.0, search_seconds: float = 1.0,
                sample_rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """Audio longer than `max_seconds` cut into pieces of at most `max_seconds`, each cut placed at the quietest
    point (lowest energy over a 20 ms window) within the last `search_seconds` before the limit, so that words are
    not split (what vLLM does for long transcriptions). The pieces (views of `audio`) concatenated give back the
    input exactly. Audio of at most `max_seconds`: [audio]."""
    if not max_seconds > 0 or not search_seconds >= 0:
        raise ValueError(f"max_seconds must be > 0 and search_seconds >= 0, got {max_seconds}, {search_seconds}")
    _check_rate(sample_rate, "sample_rate")
    if not isinstance(audio, np.ndarray) or audio.ndim != 1:
        raise ValueError("split_audio takes a 1-D numpy array")
    limit = max(1, int(max_seconds * sample_rate))
    search = min(int(search_seconds * sample_rate), limit - 1)  # a cut must advance by at least one sample
    window = max(1, int(0.02 * sample_rate))
    if audio.shape[0] <= limit:
        return [audio]
    pieces, start = [], 0
    while audio.shape[0] - start > limit:
        cut = _quietest(audio[start + limit - search:start + limit], window) + start + limit - search
        pieces.append(audio[start:cut])
        start = cut
    pieces.append(audio[start:])
    return pieces


def _quietest(region: np.ndarray, window: int) -> int:
    """Index in `region` at the centre of its lowest-energy `window`; len(region) (cut at the limit) when the region
    is too short to search."""
    if region.shape[0] <= window:
        return region.shape[0]
    energy = np.concatenate([[0.0], np.cumsum(np.square(region, dtype=np.float64))])
    sums = energy[window:] - energy[:-window]  # energy of region[i:i + window] for every i
    return int(np.argmin(sums)) + window // 2


# ---------------------------------------------------------------------------------------------------- features

@dataclass
class WhisperFeatureConfig:
    """The fields of transformers' WhisperFeatureExtractor, from a checkpoint's preprocessor_config.json."""
    feature_size: int = 80  # mel bins (128 for large-v3)
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30
    padding_value: float = 0.0

    @classmethod
    def from_folder(cls, folder: Path) -> WhisperFeatureConfig:
        """preprocessor_config.json, or processor_config.json's "feature_extractor" entry (transformers 5 may save
        the whole processor in that one file); neither -> the defaults (Whisper's own)."""
        folder = Path(folder)
        pre, proc = folder / "preprocessor_config.json", folder / "processor_config.json"
        if pre.exists():
            path, raw = pre, json.loads(pre.read_text())
        elif proc.exists():
            path, raw = proc, json.loads(proc.read_text()).get("feature_extractor", {})
        else:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the feature extractor settings are not a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if raw.get(f.name) is None:
                continue
            value = raw[f.name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.name != "padding_value":
                ok = ok and float(value).is_integer() and value > 0
            if not ok:
                raise ValueError(f"{path}: {f.name} must be a positive integer, got {value!r}"
                                 if f.name != "padding_value" else f"{path}: padding_value must be a number")
            values[f.name] = float(value) if f.name == "padding_value" else int(value)
        return cls(**values)

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        return self.n_samples // self.hop_length


class WhisperFeatures:
    """Whisper's log-mel input features, computed as transformers' WhisperFeatureExtractor computes them (with
    torch, its default): pad or truncate to chunk_length seconds of samples, STFT with a periodic Hann window
    (centred, reflect-padded), power spectrum, the last frame dropped, Slaney-scale mel filter bank with Slaney
    normalisation, log10 clamped at 1e-10, floored at max - 8, (x + 4) / 4. float32."""

    def __init__(self, cfg: WhisperFeatureConfig):
        self.cfg = cfg
        self.window = torch.hann_window(cfg.n_fft)  # periodic, as torch.stft wants
        # transformers builds the bank in float64 and casts it to float32 for the matmul; so do we.
        self.mel_filters = torch.from_numpy(
            mel_filter_bank(1 + cfg.n_fft // 2, cfg.feature_size, cfg.sampling_rate)).float()

    def __call__(self, audio: np.ndarray) -> torch.Tensor:
        """float32 [feature_size, nb_max_frames] of 1-D audio at cfg.sampling_rate; audio longer than
        chunk_length seconds is truncated (split it first with split_audio)."""
        cfg = self.cfg
        x = np.asarray(audio, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"WhisperFeatures takes 1-D audio, got shape {x.shape}")
        padded = np.full(cfg.n_samples, cfg.padding_value, dtype=np.float32)
        padded[:min(x.size, cfg.n_samples)] = x[:cfg.n_samples]
        stft = torch.stft(torch.from_numpy(padded), cfg.n_fft, cfg.hop_length, window=self.window,
                          return_complex=True)
        power = stft[..., :-1].abs() ** 2
        log_spec = torch.clamp(self.mel_filters.T @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    return np.where(freq >= 1000.0, 15.0 + np.log(np.maximum(freq, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mels)


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels - 15.0)), freq)


def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, sampling_rate: int) -> np.ndarray:
    """float64 [num_frequency_bins, num_mel_filters]: triangular filters evenly spaced on Slaney's mel scale from
    0 to 8 kHz, each scaled by 2 / its width in Hz (Slaney's normalisation: about constant energy per band).
    8 kHz whatever the rate, as transformers' WhisperFeatureExtractor has it."""
    mel_freqs = np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(8000.0)), num_mel_filters + 2)
    filter_freqs = _mel_to_hz(mel_freqs)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    diff = np.diff(filter_freqs)
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]

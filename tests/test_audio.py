"""streamer.multimodal.audio: WAV parsing and PyAV decoding, resampling, multi_modal_data["audio"] inputs, splitting long audio,
and Whisper's log-mel features against transformers' WhisperFeatureExtractor (the oracle)."""
from __future__ import annotations

import builtins
import io
import math
import struct
import wave

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.multimodal import audio as A
from streamer.multimodal.audio import (
    MAX_AUDIO_BYTES,
    SAMPLE_RATE,
    AudioBackendMissing,
    WhisperFeatureConfig,
    WhisperFeatures,
    as_audio,
    decode_audio,
    resample,
    split_audio,
)

RNG = np.random.default_rng(1234)


def sine(freq: float, rate: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)


# ---------------------------------------------------------------------------------------------------- features

@pytest.fixture(scope="module", params=[80, 128])
def extractors(request):
    from transformers import WhisperFeatureExtractor
    fs = request.param
    return WhisperFeatureExtractor(feature_size=fs), WhisperFeatures(WhisperFeatureConfig(feature_size=fs))


# Signals for parity: noise of several lengths (short, exactly 30 s, longer: truncated), speech-like dynamic range
# (a loud tone over faint noise, where float32 rounding matters most: bins near the max - 8 floor), and silence.
SIGNALS = {
    "short": lambda: (0.1 * RNG.standard_normal(1234)).astype(np.float32),
    "5s": lambda: (0.3 * RNG.standard_normal(5 * SAMPLE_RATE)).astype(np.float32),
    "30s": lambda: (0.1 * RNG.standard_normal(30 * SAMPLE_RATE)).astype(np.float32),
    "37s": lambda: (0.1 * RNG.standard_normal(37 * SAMPLE_RATE)).astype(np.float32),
    "tone+faint": lambda: (sine(440, SAMPLE_RATE, 12, 0.9) + 1e-4 * RNG.standard_normal(12 * SAMPLE_RATE))
    .astype(np.float32),
    "silence": lambda: np.zeros(SAMPLE_RATE, np.float32),
}


@pytest.mark.parametrize("name", SIGNALS)
def test_features_match_transformers(extractors, name):
    hf, ours = extractors
    x = SIGNALS[name]()
    got = ours(x)
    assert got.dtype == torch.float32 and got.shape == (hf.feature_size, 3000)
    # transformers' default path (torch installed) does the same float32 torch ops: equal up to op ordering.
    ref = hf(x, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    assert np.abs(got.numpy() - ref).max() < 1e-5
    # Its numpy path works in float64 (a float32 result): float32 rounding in our STFT and matmul is ~1e-7 relative
    # in the mel power, i.e. ~1e-7 / ln(10) / 4 in the output; bins 80 dB under the maximum (the lowest kept by the
    # max - 8 floor) carry the STFT's absolute error relative to their tiny power, measured at ~1e-5. 1e-4 leaves a
    # 10x margin and is still far below anything a model could notice (outputs span about [-1.5, 1.5]).
    padded = np.zeros(hf.n_samples, np.float32)
    padded[:min(len(x), hf.n_samples)] = x[:hf.n_samples]
    ref64 = hf._np_extract_fbank_features(padded[None], "cpu")[0]
    assert np.abs(got.numpy() - ref64).max() < 1e-4
    if name == "silence":  # log10(1e-10) everywhere: (-10 + 4) / 4
        assert torch.all(got == -1.5)


def test_mel_filter_bank_matches_transformers():
    from transformers.audio_utils import mel_filter_bank as hf_bank
    for bins in (80, 128):
        ref = hf_bank(num_frequency_bins=201, num_mel_filters=bins, min_frequency=0.0, max_frequency=8000.0,
                      sampling_rate=16000, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(A.mel_filter_bank(201, bins, 16000), ref, rtol=1e-12, atol=1e-15)


def test_feature_config_from_folder(tmp_path):
    from transformers import WhisperFeatureExtractor
    WhisperFeatureExtractor(feature_size=128, hop_length=200, chunk_length=20, n_fft=512,
                            padding_value=0.5).save_pretrained(tmp_path)
    cfg = WhisperFeatureConfig.from_folder(tmp_path)
    assert cfg == WhisperFeatureConfig(feature_size=128, sampling_rate=16000, hop_length=200, n_fft=512,
                                       chunk_length=20, padding_value=0.5)
    assert cfg.n_samples == 320_000 and cfg.nb_max_frames == 1600
    assert WhisperFeatureConfig.from_folder(tmp_path / "missing") == WhisperFeatureConfig()
    assert WhisperFeatureConfig().nb_max_frames == 3000


def test_feature_config_nondefault_matches_transformers(tmp_path):
    """A config read from disk drives the features: hop, n_fft, chunk length and padding value all reach them."""
    from transformers import WhisperFeatureExtractor
    hf = WhisperFeatureExtractor(feature_size=64, hop_length=200, chunk_length=10, n_fft=512, padding_value=0.25)
    hf.save_pretrained(tmp_path)
    ours = WhisperFeatures(WhisperFeatureConfig.from_folder(tmp_path))
    x = (0.2 * RNG.standard_normal(3 * SAMPLE_RATE)).astype(np.float32)
    ref = hf(x, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    got = ours(x).numpy()
    assert got.shape == ref.shape == (64, 800)
    assert np.abs(got - ref).max() < 1e-5


def test_feature_config_rejects_bad_field(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text('{"feature_size": "eighty"}')
    with pytest.raises(ValueError, match="feature_size"):
        WhisperFeatureConfig.from_folder(tmp_path)


# ---------------------------------------------------------------------------------------------------- WAV

def stdlib_wav(samples: np.ndarray, rate: int, width: int) -> bytes:
    """samples [frames, channels] in [-1, 1) written by Python's wave module as width-byte PCM."""
    frames, channels = samples.shape
    scale = 2 ** (8 * width - 1)
    ints = np.clip(np.round(samples * scale), -scale, scale - 1).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = ints.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def handmade_wav(samples: np.ndarray, rate: int, *, dtype: str = "<f4", extensible: bool = False,
                 extra_chunk: bool = False) -> bytes:
    """A float (tag 3) or WAVE_FORMAT_EXTENSIBLE WAV of samples [frames, channels]."""
    channels = samples.shape[1]
    data = samples.astype(dtype).tobytes()
    width = np.dtype(dtype).itemsize
    is_float = np.dtype(dtype).kind == "f"
    tag = 3 if is_float else 1
    block = width * channels
    head = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * block, block, 8 * width)
    if extensible:  # cbSize, valid bits, channel mask, SubFormat GUID (tag + KSDATAFORMAT suffix)
        head += struct.pack("<HHI", 22, 8 * width, 0) + struct.pack("<H", tag) + \
            b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(head)) + head
    if extra_chunk:  # an odd-sized chunk before data: its pad byte must be skipped
        body += b"LIST" + struct.pack("<I", 3) + b"abc\x00"
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_decode_stdlib_wav_16k(width, channels):
    src = np.stack([sine(300, 16000, 0.5, 0.6), sine(300, 16000, 0.5, 0.2)][:channels], axis=1)
    got = decode_audio(stdlib_wav(src, 16000, width))
    assert got.dtype == np.float32 and got.shape == (8000,)
    # Quantisation error of width-byte PCM is half a step: 2^-(8 width); the mean of channels keeps it.
    np.testing.assert_allclose(got, src.mean(axis=1), atol=2.0 ** -(8 * width) + 1e-7)


@pytest.mark.parametrize("rate", [44100, 8000])
@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_decode_stdlib_wav_resampled(rate, width):
    src = np.stack([sine(250, rate, 1.0, 0.5), sine(250, rate, 1.0, 0.3)], axis=1)
    got = decode_audio(stdlib_wav(src, rate, width))
    assert got.shape == (16000,)
    want = sine(250, 16000, 1.0, 0.4)
    # Away from the edges (where the resampler sees zeros past the signal): 8-bit quantisation dominates.
    tol = 1e-2 if width == 1 else 1e-3
    np.testing.assert_allclose(got[800:-800], want[800:-800], atol=tol)


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
@pytest.mark.parametrize("extensible", [False, True])
def test_decode_float_and_extensible_wav(dtype, extensible):
    src = np.stack([sine(440, 16000, 0.25, 0.7), -sine(440, 16000, 0.25, 0.1)], axis=1)
    got = decode_audio(handmade_wav(src, 16000, dtype=dtype, extensible=extensible, extra_chunk=True))
    np.testing.assert_allclose(got, src.mean(axis=1), atol=1e-7)


def test_decode_extensible_pcm_and_clipping():
    src = sine(440, 16000, 0.1, 0.5)[:, None]
    got = decode_audio(handmade_wav(np.round(src * 32767), 16000, dtype="<i2", extensible=True))
    np.testing.assert_allclose(got, src[:, 0], atol=1 / 32768 + 1e-7)
    loud = decode_audio(handmade_wav(np.array([[2.0], [-3.0], [0.5]]), 16000))  # float WAV over full scale
    np.testing.assert_array_equal(loud, np.array([1.0, -1.0, 0.5], np.float32))


def test_decode_streamed_wav_with_unknown_length():
    src = sine(440, 16000, 0.1)[:, None]
    wav = bytearray(stdlib_wav(src, 16000, 2))
    pos = wav.index(b"data")
    wav[pos + 4:pos + 8] = b"\xff\xff\xff\xff"  # what a writer to a pipe puts there
    np.testing.assert_allclose(decode_audio(bytes(wav)), src[:, 0], atol=1 / 32768 + 1e-7)


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"\x00\x01garbage bytes that are no audio format at all" * 20, "could not decode"),
    (b"RIFF\x10\x00\x00\x00WAVEfmt ", "fmt"),
])
def test_decode_bad_data(data, message):
    with pytest.raises(ValueError, match=message):
        decode_audio(data)


def test_decode_truncated_wav():
    wav = stdlib_wav(sine(440, 16000, 0.5)[:, None], 16000, 2)
    with pytest.raises(ValueError, match="truncated"):
        decode_audio(wav[:len(wav) // 2])
    with pytest.raises(ValueError, match="truncated|data"):
        decode_audio(wav[:40])  # the header, cut inside the data chunk's header
    with pytest.raises(ValueError, match="no samples"):
        decode_audio(stdlib_wav(np.zeros((0, 1)), 16000, 2))


def test_decode_too_big():
    with pytest.raises(ValueError, match="25 MiB"):
        decode_audio(b"\x00" * (MAX_AUDIO_BYTES + 1))


def test_decode_unsupported_wav_sample_format():
    wav = bytearray(handmade_wav(sine(440, 16000, 0.1)[:, None], 16000, dtype="<f4"))
    struct.pack_into("<H", wav, 34, 16)  # float with 16 bits: no such format
    with pytest.raises(ValueError, match="unsupported WAV sample format"):
        decode_audio(bytes(wav))


def encode_with_pyav(x: np.ndarray, rate: int, fmt: str, codec: str) -> bytes:
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(np.stack([x, x]).astype(np.float32), format="fltp", layout="stereo")
        frame.rate = rate
        cc = stream.codec_context
        to_codec = av.AudioResampler(format=cc.format.name, layout="stereo", rate=cc.sample_rate)
        for f in to_codec.resample(frame) + to_codec.resample(None):
            container.mux(stream.encode(f))
        container.mux(stream.encode(None))
    return buf.getvalue()


@pytest.mark.parametrize("fmt, codec, rate", [("flac", "flac", 44100), ("mp3", "libmp3lame", 22050)])
def test_decode_with_pyav(fmt, codec, rate):
    x = sine(440, rate, 1.0, 0.5)
    try:
        data = encode_with_pyav(x, rate, fmt, codec)
    except Exception as e:  # an FFmpeg build without this encoder
        pytest.skip(f"cannot encode {codec}: {e}")
    got = decode_audio(data)
    want = sine(440, 16000, 1.0, 0.5)
    assert abs(len(got) - len(want)) < 0.1 * 16000  # mp3 adds encoder delay and padding
    # Codec delay shifts the signal: the best-aligned correlation over small lags.
    n = min(len(got), len(want)) - 4000
    corr = max(np.corrcoef(got[lag:lag + n], want[1000:1000 + n])[0, 1] for lag in range(0, 3000))
    assert corr > 0.99
    assert abs(np.sqrt(np.mean(got[2000:-2000] ** 2)) - 0.5 / np.sqrt(2)) < 0.02  # channels averaged, not summed


def test_decode_without_pyav(monkeypatch):
    real_import = builtins.__import__

    def no_av(name, *args, **kwargs):
        if name == "av" or name.startswith("av."):
            raise ImportError("No module named 'av'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_av)
    with pytest.raises(AudioBackendMissing, match=r"pip install 'streamer\[audio\]'") as info:
        decode_audio(b"ID3\x03\x00\x00\x00" + b"\x00" * 100)  # an mp3 header
    assert isinstance(info.value, ValueError)
    # WAV needs no PyAV.
    assert decode_audio(stdlib_wav(sine(440, 16000, 0.1)[:, None], 16000, 2)).shape == (1600,)


# ---------------------------------------------------------------------------------------------------- resample

@pytest.mark.parametrize("orig, target", [(44100, 16000), (8000, 16000), (48000, 16000), (22050, 16000),
                                          (16000, 44100), (44100, 16001)])
def test_resample_keeps_a_sine(orig, target):
    x = sine(440, orig, 1.0, 0.8)
    y = resample(x, orig, target)
    assert y.dtype == np.float32 and len(y) == math.ceil(len(x) * target / orig)
    want = sine(440, target, len(y) / target + 1, 0.8)[:len(y)]
    edge = target // 20  # 50 ms: the filter sees zeros past the ends
    assert np.abs(y[edge:-edge] - want[edge:-edge]).max() < 1e-2


@pytest.mark.parametrize("orig, freq", [(44100, 10000), (48000, 12000), (22050, 9000)])
def test_resample_removes_tones_above_new_nyquist(orig, freq):
    x = sine(freq, orig, 1.0, 0.8)
    y = resample(x, orig, 16000)
    assert np.sum(y[800:-800] ** 2) / np.sum(x[int(orig * 0.05):-int(orig * 0.05)] ** 2 * 16000 / orig) < 0.01


def test_resample_identity_and_dc():
    x = RNG.standard_normal(1000).astype(np.float32)
    y = resample(x, 16000, 16000)
    np.testing.assert_array_equal(y, x)
    assert y is not x
    const = resample(np.full(4410, 0.25), 44100, 16000)  # each phase's weights sum to 1
    np.testing.assert_allclose(const[100:-100], 0.25, rtol=1e-6)


def test_resample_bad_arguments():
    with pytest.raises(ValueError, match="orig_sr"):
        resample(np.zeros(10), 0, 16000)
    with pytest.raises(ValueError, match="target_sr"):
        resample(np.zeros(10), 16000, 22050.5)
    with pytest.raises(ValueError, match="1-D"):
        resample(np.zeros((2, 10)), 8000, 16000)


@settings(max_examples=40, deadline=None)
@given(orig=st.integers(1000, 96000), target=st.integers(1000, 96000), n=st.integers(1, 3000))
def test_resample_length(orig, target, n):
    """ceil(n * target / orig): output samples at times k / target before the input's end n / orig."""
    y = resample(np.ones(n, np.float32), orig, target)
    assert len(y) == -(-n * target // orig)
    assert np.isfinite(y).all()


# ---------------------------------------------------------------------------------------------------- as_audio

def test_as_audio_forms():
    x = sine(440, 16000, 0.1).astype(np.float32)
    for value in (x, x.astype(np.float64), torch.from_numpy(x), torch.from_numpy(x).to(torch.bfloat16), list(x)):
        got = as_audio(value)
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got, x, atol=4e-3)  # bfloat16's 8-bit mantissa
    np.testing.assert_array_equal(as_audio((x, 16000)), x)
    np.testing.assert_allclose(as_audio((x, 16000.0)), x)
    pcm = np.round(x * 32768).astype(np.int16)
    np.testing.assert_allclose(as_audio(pcm), x, atol=0.5 / 32768 + 1e-7)
    stereo = np.stack([x, 3 * x])
    np.testing.assert_allclose(as_audio(stereo), 2 * x, rtol=1e-6)  # channels x samples
    np.testing.assert_allclose(as_audio(stereo.T.copy()), 2 * x, rtol=1e-6)  # samples x channels
    np.testing.assert_allclose(as_audio(torch.from_numpy(stereo)), 2 * x, rtol=1e-6)


def test_as_audio_resamples_tuples():
    x44 = sine(300, 44100, 1.0, 0.5)
    got = as_audio((x44, 44100))
    assert got.shape == (16000,)
    np.testing.assert_allclose(got[800:-800], sine(300, 16000, 1.0, 0.5)[800:-800], atol=1e-3)
    got8 = as_audio((torch.tensor(sine(300, 8000, 1.0, 0.5)), 8000))
    np.testing.assert_allclose(got8[800:-800], sine(300, 16000, 1.0, 0.5)[800:-800], atol=1e-3)


@pytest.mark.parametrize("value, message", [
    ("a string", "not str"),
    (b"bytes", "not bytes"),
    (None, "not NoneType"),
    (np.zeros((2, 3, 4), np.float32), "shape"),
    (np.zeros(0, np.float32), "empty"),
    ([], "empty"),
    (np.array([0.1, np.nan]), "NaN"),
    (np.array([0.1, np.inf], np.float32), "infinite"),
    ((np.zeros(10), 0), "positive"),
    ((np.zeros(10), -16000), "positive"),
    ((np.zeros(10), 22050.5), "integer"),
    ((np.zeros(10), "16k"), "integer"),
    (np.zeros(10, np.int32), "dtype"),
    (np.zeros(10, np.complex64), "dtype"),
    ([[0.1, 0.2], [0.3]], "ragged|numbers"),
    (["a", "b"], "numbers"),
])
def test_as_audio_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        as_audio(value)


# ---------------------------------------------------------------------------------------------------- split_audio

@settings(max_examples=30, deadline=None)
@given(seconds=st.floats(0.05, 9.0), max_seconds=st.floats(0.5, 3.0), search=st.floats(0.0, 1.5),
       seed=st.integers(0, 2**16))
def test_split_concatenates_and_bounds(seconds, max_seconds, search, seed):
    rate = 8000
    x = np.random.default_rng(seed).standard_normal(int(seconds * rate)).astype(np.float32)
    pieces = split_audio(x, max_seconds=max_seconds, search_seconds=search, sample_rate=rate)
    np.testing.assert_array_equal(np.concatenate(pieces), x)
    assert all(0 < len(p) <= int(max_seconds * rate) for p in pieces)
    assert (len(pieces) == 1) == (len(x) <= int(max_seconds * rate))


@settings(max_examples=20, deadline=None)
@given(gap_at=st.floats(29.0, 29.85), seed=st.integers(0, 2**16))
def test_split_cuts_in_silent_gap(gap_at, seed):
    """A 150 ms gap anywhere in the search window (the last second before 30 s) gets the cut."""
    x = (0.3 * np.random.default_rng(seed).standard_normal(45 * SAMPLE_RATE)).astype(np.float32)
    lo, hi = int(gap_at * SAMPLE_RATE), int((gap_at + 0.15) * SAMPLE_RATE)  # 150 ms of silence
    x[lo:hi] = 0.0
    pieces = split_audio(x)
    assert len(pieces) == 2
    assert lo <= len(pieces[0]) <= hi
    assert len(pieces[0]) <= 30 * SAMPLE_RATE


def test_split_short_audio_and_bad_arguments():
    x = np.zeros(30 * SAMPLE_RATE, np.float32)
    pieces = split_audio(x)
    assert len(pieces) == 1 and pieces[0] is x
    with pytest.raises(ValueError, match="max_seconds"):
        split_audio(x, max_seconds=0)
    with pytest.raises(ValueError, match="1-D"):
        split_audio(np.zeros((2, 10)))

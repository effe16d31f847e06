"""Timed segments from /v1/audio/transcriptions (server/audio_api.py) on a tiny Whisper whose vocabulary ends in the
timestamp tokens: verbose_json's segments are those transformers' greedy decoding marks with its own timestamp rules
(times, tokens, text, mean log-probability), srt and vtt cues are those segments, json and text decode without
timestamps, long audio's segments are offset by their piece's start, and timestamp_granularities is checked. At
temperature 0 a piece that fails the fallback thresholds is decoded again at each fallback temperature in turn."""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamer.server.audio_api import TranscriptionConfig
from tests.server_utils import LiveServer
from tests.test_server_audio import (
    MAX_POSITIONS,
    NO_FALLBACK,
    RATE,
    Oracle,
    _assert_error,
    _clock,
    _file,
    _post,
    client,
)
from tests.whisper_checkpoints import hf_greedy, make_whisper, tone

AUDIO = tone(2.5, 300.0, seed=4)
PRECISION = 0.02


@pytest.fixture(scope="module")
def ts_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper-timestamps"), timestamps=True)


@pytest.fixture(scope="module")
def live(ts_dir):
    with LiveServer(ts_dir, dtype="float32", enforce_eager=True, transcription=NO_FALLBACK) as server:
        yield server


@pytest.fixture(scope="module")
def oracle(ts_dir) -> Oracle:
    return Oracle(ts_dir)


def _stamped_prompt(oracle: Oracle, language: str = "en") -> list[int]:
    return oracle.prompt(language)[:-1]  # (without <|notimestamps|>)


def _expected(oracle: Oracle, audio: np.ndarray, offset: float, end: float) -> list[dict[str, Any]]:
    """transformers' timestamped tokens for the audio, read as segments: a timestamp opens one, the next closes
    it; times from the piece's start, capped at its end; each with its tokens' mean log-probability."""
    import torch
    prompt = _stamped_prompt(oracle)
    tokens = hf_greedy(oracle.folder, audio, prompt, MAX_POSITIONS - len(prompt), rules=True)
    logits = oracle._logits(audio, prompt + tokens[:-1])[len(prompt) - 1:]
    logprobs = torch.log_softmax(logits.double(), dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    begin = oracle.id("<|notimestamps|>") + 1
    segments, start, text = [], None, []
    for i, t in enumerate(tokens):
        if t < oracle.eos:
            text.append(i)
        elif t >= begin:
            at = min(offset + (t - begin) * PRECISION, end)
            if start is not None and text:
                segments.append((start, at, text))
            start, text = at, []
    if text:
        segments.append((start, end, text))
    return [{"start": round(s, 3), "end": round(e, 3), "tokens": [tokens[i] for i in pos],
             "text": oracle.text([tokens[i] for i in pos]), "avg_logprob": float(logprobs[pos].mean())}
            for s, e, pos in segments]


def _check(got: list[Any], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want):
        assert (g.start, g.end, g.tokens, g.text) == (w["start"], w["end"], w["tokens"], w["text"])
        assert g.avg_logprob == pytest.approx(w["avg_logprob"], abs=1e-3)


def test_verbose_json_segments_match_transformers(live, oracle):
    r = client(live).audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en",
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["segment"])
    want = _expected(oracle, AUDIO, 0.0, len(AUDIO) / RATE)
    _check(r.segments, want)
    assert max(len(s.tokens) for s in r.segments) >= 2
    assert [s.id for s in r.segments] == list(range(len(want))) and all(s.seek == 0 for s in r.segments)
    assert "<|" not in r.text and r.text == oracle.text([t for w in want for t in w["tokens"]]).strip()


def test_subtitles_are_the_segments(live, oracle):
    c, m = client(live), live.model_name
    v = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="verbose_json")
    srt = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="srt")
    vtt = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="vtt")
    cues = [f"{i + 1}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate(v.segments)]
    assert srt.rstrip("\n") == "\n".join(cues).rstrip("\n")
    assert vtt.rstrip("\n") == ("WEBVTT\n\n" + "\n".join(
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in v.segments)).rstrip("\n")
    assert len(v.segments) >= 2


def test_json_and_text_decode_without_timestamps(live, oracle):
    """(the shorter output: <|notimestamps|> in the prompt)"""
    tokens, text = oracle.transcript(AUDIO, oracle.prompt("en"))
    c = client(live)
    assert c.audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en").text == text
    assert c.audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en",
                                         response_format="text") == text


def test_long_audio_segments_are_offset(live, oracle):
    """65 s: three pieces decoded at once; each piece's segments are transformers' for its samples, from its start."""
    audio = np.concatenate([tone(35.0, 330.0, seed=7), tone(30.0, 520.0, seed=8)])
    audio[int(29.3 * RATE):int(29.7 * RATE)] = 0.0
    r = client(live).audio.transcriptions.create(file=_file(audio), model=live.model_name, language="en",
                                                 response_format="verbose_json")
    from streamer.multimodal.audio import split_audio
    cuts = np.cumsum([0] + [len(c) for c in split_audio(audio, max_seconds=30.0)])  # (the pieces, as cut)
    bounds = [c / RATE for c in cuts]
    seeks = sorted({s.seek for s in r.segments})
    assert seeks == [round(b * 100) for b in bounds[:-1]] and len(seeks) == 3 and 2930 <= seeks[1] <= 2970
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        piece = audio[round(lo * RATE):round(hi * RATE)]
        got = [s for s in r.segments if s.seek == seeks[i]]
        assert all(lo <= s.start <= s.end <= hi + 1e-6 for s in got)
        want = _expected(oracle, piece, lo, hi)
        assert [(s.start, s.end, s.tokens) for s in got] == [(w["start"], w["end"], w["tokens"]) for w in want]
    starts = [s.start for s in r.segments]
    assert starts == sorted(starts)


def test_timestamp_granularities_are_checked(live):
    _assert_error(_post(live, language="en", response_format="json",
                        **{"timestamp_granularities[]": "segment"}), 400, "timestamp_granularities")
    _assert_error(_post(live, language="en", response_format="verbose_json",
                        **{"timestamp_granularities[]": "sentence"}), 400, "timestamp_granularities")
    ok = _post(live, language="en", response_format="verbose_json", **{"timestamp_granularities[]": "segment"})
    assert ok.status_code == 200 and ok.json()["segments"]


def test_temperature_fallback(ts_dir, oracle):
    """One engine, apps with different fallback settings. Thresholds every text passes: the greedy answer, at 0.
    Thresholds none passes: each piece tried at every fallback temperature, the last try standing; not when
    streaming (its text is sent as it comes), nor for a temperature asked for. OpenAI's defaults fail a random model's
    text (repetitive, unlikely tokens)."""
    import asyncio

    import httpx

    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.app import build_app
    from tests.test_server_audio import wav_bytes
    never = TranscriptionConfig((0.5, 1.0), compression_ratio_threshold=1e9, logprob_threshold=-1e9)
    always = TranscriptionConfig((0.5, 1.0), compression_ratio_threshold=1e9, logprob_threshold=1e9)
    audio = np.concatenate([tone(35.0, 330.0, seed=7), tone(5.0, 520.0, seed=8)])  # (two pieces)

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with AsyncEngine(str(ts_dir), dtype="float32", num_kv_blocks=96, max_num_seqs=4) as engine:
            added, probes = [], []
            add = engine.add_request

            def counted(prompt: Any, params: Any, *args: Any, **kw: Any) -> Any:
                # (the no-speech probes, one step held to <|nospeech|>, are counted apart)
                (probes if params.allowed_token_ids else added).append(params.temperature)
                return add(prompt, params, *args, **kw)
            engine.add_request = counted
            for name, config in (("never", never), ("always", always), ("default", None)):
                transport = httpx.ASGITransport(app=build_app(engine, transcription=config))
                async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as h:
                    async def post(**fields: str) -> httpx.Response:
                        return await h.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav_bytes(audio))},
                                            data={"language": "en", "response_format": "verbose_json", **fields})
                    added.clear()
                    probes.clear()
                    out[name] = ((await post()).json(), list(added))
                    assert probes == [0.0, 0.0]  # (one a piece, whatever the fallback does)
                    if name == "always":
                        added.clear()
                        stream = await post(response_format="json", stream="true")
                        out["stream"] = (stream.text, list(added))
                        added.clear()
                        out["hot"] = ((await post(temperature="0.3")).json(), list(added))
            assert engine.engine.kv.pool.num_free == engine.engine.kv.pool.num_blocks
        return out

    out = asyncio.run(asyncio.wait_for(main(), 600))
    body, temps = out["never"]
    assert temps == [0.0, 0.0] and {s["temperature"] for s in body["segments"]} == {0.0}
    from streamer.multimodal.audio import split_audio
    first = len(split_audio(audio, max_seconds=30.0)[0])  # (the first piece: greedy, transformers' tokens)
    want = _expected(oracle, audio[:first], 0.0, first / RATE)
    assert [s["tokens"] for s in body["segments"] if s["seek"] == 0] == [w["tokens"] for w in want]
    body, temps = out["always"]
    assert sorted(temps) == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert {s["temperature"] for s in body["segments"]} == {1.0}
    text, temps = out["stream"]
    assert temps == [0.0, 0.0] and "transcript.text.done" in text
    body, temps = out["hot"]
    assert temps == [0.3, 0.3] and {s["temperature"] for s in body["segments"]} == {0.3}
    body, temps = out["default"]  # (OpenAI's defaults: 0.2 .. 1.0)
    assert sorted(temps) == [0.0] * 2 + [0.2] * 2 + [0.4] * 2 + [0.6] * 2 + [0.8] * 2 + [1.0] * 2
    assert {s["temperature"] for s in body["segments"]} == {1.0}


def test_fallback_flags():
    import argparse

    from streamer.server.cli import transcription_config

    def parse(fallback: str, no_speech: str = "0.6") -> TranscriptionConfig:
        return transcription_config(argparse.Namespace(transcription_fallback=fallback,
                                                       transcription_compression_ratio_threshold=2.0,
                                                       transcription_logprob_threshold=-0.5,
                                                       transcription_no_speech_threshold=no_speech))
    assert parse("0.2, 0.6,1") == TranscriptionConfig((0.2, 0.6, 1.0), 2.0, -0.5, 0.6)
    assert parse("").fallback_temperatures == ()
    assert parse("", "").no_speech_threshold is None and parse("", "0.9").no_speech_threshold == 0.9
    for bad in ("hot", "0,0.5", "3"):
        with pytest.raises(ValueError, match="--transcription-fallback"):
            parse(bad)
    for bad in ("loud", "1.5"):
        with pytest.raises(ValueError, match="--transcription-no-speech-threshold"):
            parse("", bad)


def _expected_words(oracle: Oracle, audio: np.ndarray, text: list[int], heads: list[tuple[int, int]],
                    offset: float) -> list[tuple[str, float, float]]:
    """Word times as transformers' parts give them: its model's cross-attention probabilities (eager attention)
    over [<|startoftranscript|><|en|><|transcribe|><|notimestamps|>, text, <|endoftext|>], softmax cropped to the
    audio's frames, standardised over tokens, its median filter, averaged over the alignment heads, its dynamic
    time warping; a word starts at a space or a punctuation mark (none of the marks that join a neighbour is in
    this model's text)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter
    model = WhisperForConditionalGeneration.from_pretrained(oracle.folder, attn_implementation="eager").eval()
    fe = WhisperFeatureExtractor.from_pretrained(oracle.folder)
    feats = torch.from_numpy(fe(audio, sampling_rate=RATE, return_tensors="np").input_features)
    prefix = oracle.prompt("en")
    tokens = prefix + text + [oracle.eos]
    with torch.no_grad():
        attn = model(input_features=feats, decoder_input_ids=torch.tensor([tokens]), output_attentions=True)
    probs = torch.stack([attn.cross_attentions[layer][0, head] for layer, head in heads])
    frames = round(len(audio) / 160) // 2
    w = probs[:, len(prefix) - 1:-1, :frames]
    w = w / w.sum(dim=-1, keepdim=True)  # (the softmax over the audio's frames alone)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    matrix = _median_filter((w - mean) / std, 7).mean(dim=0)
    rows, cols = _dynamic_time_warping(-matrix.double().numpy())
    starts = cols[np.diff(rows, prepend=-1).astype(bool)] * PRECISION
    words, first = [], 0
    decoded = [oracle.text([t]) for t in text]  # (the test's tokens are whole characters)
    for i in range(1, len(text) + 1):
        if i == len(text) or decoded[i].startswith(" ") or decoded[i].strip() in string.punctuation:
            words.append((oracle.text(text[first:i]).strip(), offset + starts[first], offset + starts[i]))
            first = i
    return words


def test_word_timestamps_match_transformers(live, oracle):
    """Words and their times for a clip's greedy transcript, against transformers' model and alignment parts. The
    checkpoint names no alignment heads: every head of the decoder's second half (OpenAI's default)."""
    r = client(live).audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en",
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"])
    assert r.segments and r.words
    text = [t for s in r.segments for t in s.tokens]
    heads = [(1, h) for h in range(4)]  # (2 layers of 4 heads: the second layer's)
    want = _expected_words(oracle, AUDIO, text, heads, 0.0)
    got = [(w.word, w.start, w.end) for w in r.words]
    assert [g[0] for g in got] == [w[0] for w in want] and len(got) >= 3
    assert [t for g in got for t in g[1:]] == pytest.approx([float(t) for w in want for t in w[1:]], abs=1e-6)
    assert all(0.0 <= w.start <= w.end <= len(AUDIO) / RATE for w in r.words)
    only = _post(live, language="en", response_format="verbose_json", audio=AUDIO,
                 **{"timestamp_granularities[]": "word"}).json()
    assert "segments" not in only and [w["word"] for w in only["words"]] == [g[0] for g in got]

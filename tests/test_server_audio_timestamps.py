"""Timed segments from /v1/audio/transcriptions (server/audio_api.py) on a tiny Whisper whose vocabulary ends in the
timestamp tokens: verbose_json's segments are those transformers' greedy decoding marks with its own timestamp rules
(times, tokens, text, mean log-probability), srt and vtt cues are those segments, json and text decode without
timestamps, long audio's segments are offset by their piece's start, and timestamp_granularities is checked."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server_utils import LiveServer
from tests.test_server_audio import MAX_POSITIONS, RATE, Oracle, _assert_error, _clock, _file, _post, client
from tests.whisper_checkpoints import hf_greedy, make_whisper, tone

AUDIO = tone(2.5, 300.0, seed=4)
PRECISION = 0.02


@pytest.fixture(scope="module")
def ts_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper-timestamps"), timestamps=True)


@pytest.fixture(scope="module")
def live(ts_dir):
    with LiveServer(ts_dir, dtype="float32", enforce_eager=True) as server:
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
    from streamer.audio import split_audio
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
    _assert_error(_post(live, language="en", response_format="verbose_json",
                        **{"timestamp_granularities[]": "word"}), 400, "timestamp_granularities")
    _assert_error(_post(live, language="en", response_format="json",
                        **{"timestamp_granularities[]": "segment"}), 400, "timestamp_granularities")
    _assert_error(_post(live, language="en", response_format="verbose_json",
                        **{"timestamp_granularities[]": "sentence"}), 400, "timestamp_granularities")
    ok = _post(live, language="en", response_format="verbose_json", **{"timestamp_granularities[]": "segment"})
    assert ok.status_code == 200 and ok.json()["segments"]

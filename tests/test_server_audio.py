"""/v1/audio/transcriptions and /v1/audio/translations (server/audio_api.py) through the real `openai` client, on a
tiny Whisper checkpoint written by transformers (tests/whisper_checkpoints.py): every text is the one transformers'
greedy decoding gives for the decoder prompt Whisper takes (language, task, previous text), the detected language
is the one transformers' model scores highest, long audio comes back as contiguous pieces cut in a quiet gap, the
response formats (json, text, verbose_json, srt, vtt) and the stream's events agree, errors are OpenAI's 4xx bodies
naming the field, an English-only model neither detects nor translates, concurrent requests get their sequential
answers, and nothing is left running or allocated afterwards."""
from __future__ import annotations

import asyncio
import math
import re
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import httpx
import numpy as np
import openai
import pytest

from streamer.multimodal.audio import split_audio
from streamer.server.audio_api import TranscriptionConfig
from tests.server_utils import LiveServer, metric
from tests.whisper_checkpoints import hf_greedy, make_whisper, tone

# (the openai client marks audio.translations deprecated; it is still OpenAI's endpoint)
pytestmark = pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")

RATE = 16_000
MAX_POSITIONS = 64  # the tiny checkpoint's max_target_positions: prompt + generated tokens
AUDIO = tone(1.5, 440.0, seed=1)  # 1.5 s: usage reports ceil(duration) = 2 s
# Greedy answers to compare with transformers': no temperature fallback (a random model's text always fails its
# thresholds; tests/test_server_audio_timestamps.py checks the fallback)
NO_FALLBACK = TranscriptionConfig(fallback_temperatures=())


def wav_bytes(audio: np.ndarray) -> bytes:
    """A 32-bit float mono WAV (format tag 3) at 16 kHz: the server reads the very samples the oracle is given."""
    data = np.asarray(audio, dtype="<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, RATE, RATE * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _file(audio: np.ndarray, name: str = "a.wav") -> tuple[str, bytes]:
    return (name, wav_bytes(audio))


class Oracle:
    """transformers' answers for a checkpoint: the decoder prompts Whisper takes, its greedy tokens (hf_greedy) and
    their text, and the language it scores highest after <|startoftranscript|>."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer
        self.folder = folder
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.eos = self.id("<|endoftext|>")
        self._model: Any = None

    def id(self, token: str) -> int:
        i = self.tok.token_to_id(token)
        assert i is not None, token
        return i

    def prompt(self, language: Optional[str], task: str = "transcribe", previous: str = "") -> list[int]:
        ids = [self.id("<|startofprev|>"), *self.tok.encode(" " + previous).ids] if previous else []
        ids.append(self.id("<|startoftranscript|>"))
        if language is not None:
            ids += [self.id(f"<|{language}|>"), self.id(f"<|{task}|>")]
        return ids + [self.id("<|notimestamps|>")]

    def tokens(self, audio: np.ndarray, prompt_ids: list[int]) -> list[int]:
        """Greedy tokens up to the decoder's context (the server's max_tokens=None), without a final eos."""
        out = hf_greedy(self.folder, audio, prompt_ids, max_tokens=MAX_POSITIONS - len(prompt_ids))
        return out[:-1] if out and out[-1] == self.eos else out

    def text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)

    def transcript(self, audio: np.ndarray, prompt_ids: list[int]) -> tuple[list[int], str]:
        tokens = self.tokens(audio, prompt_ids)
        return tokens, self.text(tokens).strip()

    def _logits(self, audio: np.ndarray, decoder_ids: list[int]) -> Any:
        """transformers' logits [len(decoder_ids), vocab] for the audio and a decoder input."""
        import torch
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
        if self._model is None:
            self._model = WhisperForConditionalGeneration.from_pretrained(self.folder, torch_dtype=torch.float32)
            self._model.eval()
            self._fe = WhisperFeatureExtractor.from_pretrained(self.folder)
        feats = torch.from_numpy(self._fe(audio, sampling_rate=RATE, return_tensors="np").input_features)
        with torch.no_grad():
            return self._model(input_features=feats, decoder_input_ids=torch.tensor([decoder_ids])).logits[0]

    def language(self, audio: np.ndarray) -> str:
        """Whisper's detection: the likeliest language token at the first decoder position."""
        import json
        langs = json.loads((self.folder / "generation_config.json").read_text())["lang_to_id"]
        logits = self._logits(audio, [self.id("<|startoftranscript|>")])[0]
        scores = {tok.strip("<|>"): float(logits[i]) for tok, i in langs.items()}
        return max(scores, key=scores.__getitem__)

    def no_speech_prob(self, audio: np.ndarray, prompt_ids: list[int]) -> float:
        """<|nospeech|>'s probability at the decoder's <|startoftranscript|> (OpenAI's no_speech_prob)."""
        import torch
        sot = prompt_ids.index(self.id("<|startoftranscript|>"))
        logits = self._logits(audio, prompt_ids[:sot + 1])[sot]
        return float(torch.softmax(logits.double(), dim=-1)[self.id("<|nospeech|>")])

    def avg_logprob(self, audio: np.ndarray, prompt_ids: list[int], tokens: list[int]) -> float:
        """The mean log-probability of `tokens` after the prompt (verbose_json's avg_logprob)."""
        import torch
        logits = self._logits(audio, prompt_ids + tokens[:-1])[len(prompt_ids) - 1:]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        return float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].mean())


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def ml_dir(tmp_path_factory) -> Path:
    return make_whisper(tmp_path_factory.mktemp("whisper-multilingual"))


@pytest.fixture(scope="module")
def oracle(ml_dir) -> Oracle:
    return Oracle(ml_dir)


@pytest.fixture(scope="module")
def live(ml_dir):
    with LiveServer(ml_dir, dtype="float32", enforce_eager=True, transcription=NO_FALLBACK) as server:
        yield server


@pytest.fixture(scope="module")
def en_live(tmp_path_factory):
    folder = make_whisper(tmp_path_factory.mktemp("whisper-english"), seed=1, multilingual=False)
    with LiveServer(folder, dtype="float32", enforce_eager=True, transcription=NO_FALLBACK) as server:
        server.oracle = Oracle(folder)
        yield server


@pytest.fixture(scope="module")
def english(oracle) -> SimpleNamespace:
    """AUDIO transcribed as English: transformers' tokens and text."""
    tokens, text = oracle.transcript(AUDIO, oracle.prompt("en"))
    assert tokens and text
    return SimpleNamespace(tokens=tokens, text=text)


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120)


def _post(live: LiveServer, path: str = "/audio/transcriptions", *, audio: Optional[np.ndarray] = AUDIO,
          **fields: Any) -> httpx.Response:
    files = {"file": _file(audio)} if audio is not None else None
    data = {"model": live.model_name, **fields}
    return httpx.post(live.base_url + path, data=data, files=files, timeout=120)


def _assert_error(e: Any, status: int, param: str) -> dict:
    """An OpenAI-style error body (as the openai client hands it, or an httpx response's) naming `param`."""
    if isinstance(e, httpx.Response):
        assert e.status_code == status, (e.status_code, e.text)
        body = e.json()["error"]
    else:
        assert e.status_code == status, (e.status_code, e.body)
        body = e.body
    assert {"message", "type", "param", "code"} <= set(body), body
    assert body["param"] == param and body["message"], body
    if status == 400:
        assert body["type"] == "invalid_request_error", body
    return body


# ---------------------------------------------------------------------------------------------------- tests

def test_transcription_matches_transformers(live, oracle, english):
    r = client(live).audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en")
    assert r.text == english.text
    assert r.usage.type == "duration" and r.usage.seconds == math.ceil(len(AUDIO) / RATE) == 2
    # Different audio, different text (the audio reaches the decoder); and the tokens are transformers' exactly.
    other = tone(1.0, 200.0, seed=10)
    v = client(live).audio.transcriptions.create(file=_file(other), model=live.model_name, language="en",
                                                 response_format="verbose_json")
    tokens, text = oracle.transcript(other, oracle.prompt("en"))
    assert v.text == text and [s.tokens for s in v.segments] == [tokens] != [english.tokens]
    assert v.segments[0].avg_logprob == pytest.approx(oracle.avg_logprob(other, oracle.prompt("en"), tokens),
                                                      abs=1e-3)
    raw = v.segments[0].text.encode()
    assert v.segments[0].compression_ratio == pytest.approx(len(raw) / len(zlib.compress(raw)))


def test_response_formats(live, english, oracle):
    c, m = client(live), live.model_name
    text = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="text")
    assert isinstance(text, str) and text == english.text
    srt = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="srt")
    assert srt.rstrip("\n") == f"1\n00:00:00,000 --> 00:00:01,500\n{english.text}"
    vtt = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en", response_format="vtt")
    assert vtt.rstrip("\n") == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n{english.text}"
    v = c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="EN", response_format="verbose_json")
    assert v.language == "en" and v.duration == pytest.approx(1.5) and v.text == english.text
    assert len(v.segments) == 1
    seg = v.segments[0]
    assert (seg.id, seg.start, seg.end) == (0, 0.0, 1.5)
    assert seg.text.strip() == english.text and seg.tokens == english.tokens
    assert seg.temperature == 0.0 and seg.avg_logprob < 0 and seg.compression_ratio > 0
    assert seg.no_speech_prob == pytest.approx(oracle.no_speech_prob(AUDIO, oracle.prompt("en")), rel=1e-3)
    raw = _post(live, language="en", response_format="verbose_json").json()
    assert raw["task"] == "transcribe" and raw["usage"] == {"type": "duration", "seconds": 2}
    assert _post(live, language="en", response_format="vtt").headers["content-type"].startswith("text/vtt")


def test_language_detection(live, oracle):
    audio = tone(2.0, 3000.0, seed=3)
    language = oracle.language(audio)
    r = client(live).audio.transcriptions.create(file=_file(audio), model=live.model_name,
                                                 response_format="verbose_json")
    assert r.language == language
    tokens, text = oracle.transcript(audio, oracle.prompt(language))
    assert r.text == text and r.segments[0].tokens == tokens
    # An empty `language` field is no language: detected too.
    assert _post(live, audio=audio, language="", response_format="verbose_json").json()["language"] == language


@pytest.fixture(scope="module")
def long_audio() -> np.ndarray:
    """65 s of tone with a silent gap at 29.3 - 29.7 s, in the last second before the first piece's 30 s limit."""
    audio = np.concatenate([tone(35.0, 330.0, seed=7), tone(30.0, 520.0, seed=8)])
    audio[int(29.3 * RATE):int(29.7 * RATE)] = 0.0
    return audio


def test_long_audio_is_cut_in_quiet_places(live, oracle, long_audio):
    duration = len(long_audio) / RATE
    r = client(live).audio.transcriptions.create(file=_file(long_audio), model=live.model_name,
                                                 response_format="verbose_json")
    assert r.duration == pytest.approx(duration) and r.usage.seconds == 65
    segs = r.segments
    assert len(segs) >= 3 and segs[0].start == 0.0 and segs[-1].end == pytest.approx(duration)
    assert all(b.start == a.end for a, b in zip(segs, segs[1:]))  # contiguous
    assert all(0 < s.end - s.start <= 30.0 for s in segs) and [s.id for s in segs] == list(range(len(segs)))
    assert 29.3 <= segs[0].end <= 29.7  # the cut lies in the silent gap
    assert r.text == " ".join(s.text.strip() for s in segs)
    # The language is detected on the first piece; each piece's text is transformers' for that piece's samples.
    first = long_audio[:round(segs[0].end * RATE)]
    assert r.language == oracle.language(first)
    prompt = oracle.prompt(r.language)
    for s in segs:
        piece = long_audio[round(s.start * RATE):round(s.end * RATE)]
        tokens, text = oracle.transcript(piece, prompt)
        assert s.tokens == tokens and s.text.strip() == text
    srt = client(live).audio.transcriptions.create(file=_file(long_audio), model=live.model_name,
                                                   language=r.language, response_format="srt")
    assert re.findall(r"^(\d+)\n00:00:00,000 --> 00:00:(29,\d{3})\n", srt, flags=re.M) == \
        [("1", _clock(segs[0].end, ",")[6:])]
    cues = [f"{i + 1}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n" for i, s in enumerate(segs)]
    assert srt.rstrip("\n") == "\n".join(cues).rstrip("\n") and " --> 00:01:05,000\n" in srt


def _clock(seconds: float, sep: str) -> str:
    """hh:mm:ss,mmm (srt) or hh:mm:ss.mmm (vtt)."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _stream(live: LiveServer, audio: np.ndarray, **kw: Any) -> tuple[list[str], Any]:
    deltas, done = [], []
    for ev in client(live).audio.transcriptions.create(file=_file(audio), model=live.model_name, stream=True,
                                                       **kw):
        if ev.type == "transcript.text.delta":
            assert not done, "a delta after transcript.text.done"
            deltas.append(ev.delta)
        else:
            assert ev.type == "transcript.text.done", ev
            done.append(ev)
    assert len(done) == 1
    return deltas, done[0]


def test_stream_equals_non_stream(live, english, long_audio):
    deltas, done = _stream(live, AUDIO, language="en")
    assert len(deltas) > 1 and "".join(deltas) == done.text == english.text
    assert done.usage.seconds == 2
    # Several pieces: the done event's text is the non-streamed one (for the deltas, see the test below).
    whole = client(live).audio.transcriptions.create(file=_file(long_audio), model=live.model_name, language="de")
    deltas, done = _stream(live, long_audio, language="de", response_format="text")
    assert done.text == whole.text and done.usage.seconds == 65 and len(deltas) > 3
    raw = httpx.post(live.base_url + "/audio/transcriptions", timeout=120, files={"file": _file(AUDIO)},
                     data={"model": live.model_name, "language": "en", "stream": "true"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_stream_deltas_add_up_when_pieces_carry_spaces(live, long_audio):
    cases = [(AUDIO, {"language": "en", "prompt": "The quick brown fox"}), (long_audio, {"language": "de"})]
    shown, wrong = 0, []
    for audio, kw in cases:
        v = client(live).audio.transcriptions.create(file=_file(audio), model=live.model_name,
                                                     response_format="verbose_json", **kw)
        shown += any(s.text != s.text.strip() for s in v.segments)
        deltas, done = _stream(live, audio, **kw)
        assert done.text == v.text
        if "".join(deltas) != done.text:
            wrong.append(("".join(deltas)[:8], done.text[:8]))
    if not shown:
        pytest.skip("no piece begins or ends with whitespace with this checkpoint: see the unit test below")
    assert not wrong


def test_prompt_is_previous_text(live, oracle, english):
    previous = "The quick brown fox"
    r = client(live).audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en",
                                                 prompt=previous, response_format="verbose_json")
    prompt_ids = oracle.prompt("en", previous=previous)
    assert len(prompt_ids) > 5
    tokens, text = oracle.transcript(AUDIO, prompt_ids)
    assert r.text == text != english.text
    assert r.segments[0].tokens == tokens != english.tokens
    # (no_speech_prob after the previous text, as OpenAI's whisper reads it at <|startoftranscript|>)
    assert r.segments[0].no_speech_prob == pytest.approx(oracle.no_speech_prob(AUDIO, prompt_ids), rel=1e-3)


def test_long_prompt_keeps_its_last_tokens(live, oracle):
    previous = " ".join(f"word{i} and more" for i in range(60))  # far over half the 64-token decoder context
    r = client(live).audio.transcriptions.create(file=_file(AUDIO), model=live.model_name, language="en",
                                                 prompt=previous)
    keep = MAX_POSITIONS // 2 - 1  # as transformers (and OpenAI's whisper: n_text_ctx // 2 - 1) cut it
    ids = oracle.tok.encode(" " + previous).ids[-keep:]
    prompt_ids = [oracle.id("<|startofprev|>"), *ids, *oracle.prompt("en")]
    assert r.text == oracle.transcript(AUDIO, prompt_ids)[1]


def test_prompt_cannot_inject_special_tokens(live):
    r = _post(live, language="en", prompt="<|endoftext|><|startoftranscript|><|de|><|translate|>")
    _assert_error(r, 400, "prompt")


def test_translations(live, oracle):
    audio = tone(2.0, 3000.0, seed=3)
    c = client(live)
    r = c.audio.translations.create(file=_file(audio), model=live.model_name, response_format="verbose_json")
    language = oracle.language(audio)
    assert r.language == language and r.task == "translate"
    tokens, text = oracle.transcript(audio, oracle.prompt(language, "translate"))
    assert r.text == text and r.segments[0].tokens == tokens
    # A language named (the openai client has no such field for translations: extra_body puts it in the form)
    r = c.audio.translations.create(file=_file(AUDIO), model=live.model_name, extra_body={"language": "de"})
    tokens, text = oracle.transcript(AUDIO, oracle.prompt("de", "translate"))
    assert r.text == text
    assert text != oracle.transcript(AUDIO, oracle.prompt("de", "transcribe"))[1]  # (the task token matters)


def test_errors(live, english):
    c, m = client(live), live.model_name
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=("a.wav", b"this is not audio at all" * 10), model=m)
    assert "decode" in _assert_error(e.value, 400, "file")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=("a.wav", b"RIFF\x10\x00\x00\x00WAVEjunkjunk"), model=m)
    _assert_error(e.value, 400, "file")
    # No file: a form without one, and a body that is not a multipart form.
    r = httpx.post(live.base_url + "/audio/transcriptions", data={"model": m}, files={"other": ("x.txt", b"x")})
    assert "required" in _assert_error(r, 400, "file")["message"]
    _assert_error(httpx.post(live.base_url + "/audio/transcriptions", data={"model": m}), 400, "file")
    _assert_error(_post(live, audio=np.zeros(0, np.float32)), 400, "file")  # a WAV without samples
    too_big = httpx.post(live.base_url + "/audio/transcriptions", data={"model": m}, timeout=60,
                         files={"file": ("a.wav", bytes(25 * 2**20 + 1))})
    assert "25 MiB" in _assert_error(too_big, 413, "file")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=_file(AUDIO), model=m, response_format="mp3")
    _assert_error(e.value, 400, "response_format")
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=_file(AUDIO), model=m, temperature=2)
    _assert_error(e.value, 400, "temperature")
    _assert_error(_post(live, temperature="warm"), 400, "temperature")
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="xx")
    assert "'xx'" in _assert_error(e.value, 400, "language")["message"]
    _assert_error(_post(live, stream="true", response_format="srt"), 400, "stream")
    _assert_error(_post(live, stream="maybe"), 400, "stream")
    with pytest.raises(openai.NotFoundError) as e:
        c.audio.transcriptions.create(file=_file(AUDIO), model="whisper-1")
    assert _assert_error(e.value, 404, "model")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.audio.translations.create(file=_file(AUDIO), model="whisper-1")
    # ... and the server goes on transcribing.
    assert c.audio.transcriptions.create(file=_file(AUDIO), model=m, language="en").text == english.text


def test_text_model_refuses_audio(llama_dir):
    """A text model's server answers the audio routes with 400 naming the model, before reading the upload (the
    app in process, over a started engine for the tiny llama checkpoint)."""
    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.app import build_app

    async def main() -> list[httpx.Response]:
        async with AsyncEngine(str(llama_dir), dtype="float32", num_kv_blocks=16, max_num_seqs=2) as engine:
            transport = httpx.ASGITransport(app=build_app(engine, transcription=NO_FALLBACK))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as h:
                return [await h.post(path, data={"model": "llama"}, files={"file": _file(AUDIO)})
                        for path in ("/v1/audio/transcriptions", "/v1/audio/translations")]

    for r in asyncio.run(asyncio.wait_for(main(), 120)):
        body = _assert_error(r, 400, "model")
        assert body["code"] == "model_not_supported" and "does not take audio" in body["message"]


def test_english_only_model(en_live):
    o: Oracle = en_live.oracle
    c, m = client(en_live), en_live.model_name
    audio = tone(1.0, 700.0, seed=4)
    prompt_ids = o.prompt(None)
    assert prompt_ids == [o.id("<|startoftranscript|>"), o.id("<|notimestamps|>")]
    tokens, text = o.transcript(audio, prompt_ids)
    r = c.audio.transcriptions.create(file=_file(audio), model=m, response_format="verbose_json")
    assert r.text == text and r.segments[0].tokens == tokens and r.language == "en"
    assert c.audio.transcriptions.create(file=_file(audio), model=m, language="en").text == text
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.translations.create(file=_file(audio), model=m)
    assert "English-only" in _assert_error(e.value, 400, "model")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.audio.transcriptions.create(file=_file(audio), model=m, language="de")
    _assert_error(e.value, 400, "language")
    en_live.wait_idle()


def test_concurrent_requests_get_their_sequential_answers(live):
    """Six at once, half of them detecting their language first (a request of its own in the engine)."""
    audios = [tone(1.0 + 0.25 * i, 200.0 + 450.0 * i, seed=10 + i) for i in range(6)]
    kws = [{"language": "en"} if i % 2 else {} for i in range(6)]
    sequential = [client(live).audio.transcriptions.create(file=_file(a), model=live.model_name, **kw).text
                  for a, kw in zip(audios, kws)]
    assert len(set(sequential)) > 1

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=120) as c:
            rs = await asyncio.gather(*(c.audio.transcriptions.create(file=_file(a), model=live.model_name, **kw)
                                        for a, kw in zip(audios, kws)))
            return [r.text for r in rs]

    assert asyncio.run(asyncio.wait_for(main(), 300)) == sequential


def test_stream_left_early_frees_everything(live, long_audio):
    """A client that leaves a stream of several pieces after its first event: every piece's request is aborted."""
    with httpx.stream("POST", live.base_url + "/audio/transcriptions", timeout=120, files={"file": _file(long_audio)},
                      data={"model": live.model_name, "language": "en", "stream": "true"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert "transcript.text.delta" in line
                break
    live.wait_idle()


def test_nothing_left_running(live):
    """After every request above (errors, streams, a stream left early): no request running or waiting, every KV
    block and every cross-attention state slot free, and the metrics say so."""
    state = live.wait_idle()
    assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == state["streams"] == 0

    def slots() -> tuple[int, int]:
        core = live.engine.engine
        return core.kv.state.num_free, core.runner.num_state_slots
    free, total = live.call(slots)
    assert free == total > 0
    text = httpx.get(live.url + "/metrics", timeout=30).text
    assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    assert metric(text, "vllm:request_success_total") > 0


def test_silence_says_nothing_and_each_piece_is_encoded_once(ml_dir, oracle, long_audio):
    """With a no-speech threshold every piece passes (this random model's no_speech_prob is above 0 and its text
    unlikely), the transcript is empty: no text, no segments, and no fallback retries (silence is not retried).
    Each piece's audio went through the encoder once, for its transcription, its no-speech probe and language
    detection together."""
    config = TranscriptionConfig(no_speech_threshold=0.0)  # (fallback on)
    with LiveServer(ml_dir, dtype="float32", enforce_eager=True, transcription=config) as server:
        c = client(server)
        runner = server.engine.engine.runner
        before = server.call(lambda: runner.encoder_cache.num_encoded)
        v = c.audio.transcriptions.create(file=_file(long_audio), model=server.model_name,
                                          response_format="verbose_json")
        assert v.text == "" and v.segments == [] and v.language == oracle.language(long_audio[:RATE * 30])
        pieces = len(split_audio(long_audio))
        assert pieces == 3 and server.call(lambda: runner.encoder_cache.num_encoded) - before == pieces
        text = httpx.get(server.url + "/metrics", timeout=30).text
        assert metric(text, "vllm:request_success_total") == 1 + 2 * pieces  # detection, probes, transcriptions
        words = c.audio.transcriptions.create(file=_file(AUDIO), model=server.model_name, language="en",
                                              response_format="verbose_json", timestamp_granularities=["word"])
        assert words.text == "" and words.words == []


# ---------------------------------------------------------------------------------------------------- units

class _FakeStream:
    """An engine stream of one piece: its outputs' text deltas."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    async def __aiter__(self):
        for i, t in enumerate(self.texts):
            yield SimpleNamespace(text=t, token_ids=[i])

    def close(self) -> None:
        pass


def test_stream_deltas_add_up_with_whisper_spacing():
    """Real Whisper checkpoints begin a transcript with a space (" Hello"); the random tiny model never does, so
    the event generator is driven with such pieces directly."""
    from streamer.server.audio_api import AudioAPI, Piece

    async def events(texts: list[list[str]]) -> list[dict]:
        import json
        pieces = [Piece(float(i), float(i + 1)) for i in range(len(texts))]
        raw = [e async for e in AudioAPI(None)._events([_FakeStream(t) for t in texts], pieces, len(texts))]
        text = b"".join(x if isinstance(x, bytes) else x.encode() for x in raw).decode()
        return [json.loads(d) for d in re.findall(r"^data: (\{.*\})$", text, flags=re.M)]

    for texts in ([["Plain", " text"], ["next"]],  # (no surrounding spaces: this one adds up)
                  [[" Hello", " world."], [" How", " are you?"]],  # Whisper's spacing
                  [[" ", ""], [" Then", " this. "]]):  # an empty first piece, a trailing space
        evs = asyncio.run(events(texts))
        done = evs[-1]
        assert done["type"] == "transcript.text.done"
        deltas = "".join(e["delta"] for e in evs if e["type"] == "transcript.text.delta")
        assert done["text"] == " ".join(t for t in ("".join(p).strip() for p in texts) if t)
        assert deltas == done["text"], (texts, deltas, done["text"])


def test_suppress_tokens_from_generation_config(ml_dir, english, tmp_path):
    """generation_config.json's suppress_tokens are banned in transcriptions, as transformers and OpenAI's whisper
    decode: a copy of the checkpoint that suppresses the first token transformers picks never writes it."""
    import json
    import shutil

    from streamer.engine.async_engine import AsyncEngine
    from streamer.server.app import build_app
    banned = english.tokens[0]
    folder = tmp_path / "suppressing"
    shutil.copytree(ml_dir, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "suppress_tokens": [banned]}))

    async def main() -> httpx.Response:
        async with AsyncEngine(str(folder), dtype="float32", num_kv_blocks=32, max_num_seqs=2) as engine:
            transport = httpx.ASGITransport(app=build_app(engine, transcription=NO_FALLBACK))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as h:
                return await h.post("/v1/audio/transcriptions", files={"file": _file(AUDIO)},
                                    data={"language": "en", "response_format": "verbose_json"})

    r = asyncio.run(asyncio.wait_for(main(), 180))
    assert r.status_code == 200, r.text
    tokens = [t for s in r.json()["segments"] for t in s["tokens"]]
    assert tokens and banned not in tokens

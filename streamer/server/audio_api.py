"""OpenAI's speech-to-text endpoints, /v1/audio/transcriptions and /v1/audio/translations, for a speech model
(Whisper: models/whisper.py, streamer/multimodal/speech.py).

A request is a multipart form, as OpenAI's clients send it: `file` (the audio: WAV read by our own code, anything
else through PyAV), `model`, `language` (ISO-639-1; detected when not given), `prompt` (text before the audio, or
spellings to follow), `response_format` (json, text, verbose_json, srt, vtt), `temperature`, `stream`,
`timestamp_granularities[]` (segment, word; verbose_json only).

Audio longer than the model's window (30 s) is cut at its quietest points into pieces (streamer/multimodal/audio.py
split_audio), transcribed as concurrent requests, and joined in order. Without a `language`, a multilingual model
names it first: one decoder step after <|startoftranscript|> over the language tokens alone, on the first piece
(as Whisper detects it). Streaming sends OpenAI's events, `transcript.text.delta` then `transcript.text.done`.
At temperature 0 a piece whose text repeats itself or whose tokens are unlikely is decoded again, hotter
(`TranscriptionConfig`: OpenAI's whisper's fallback; not when streaming, whose text is already sent).
verbose_json, srt and vtt decode with timestamp tokens (streamer/multimodal/speech.py DecodeRules) and give the segments they
mark, offset by their piece's start; json and text decode without them (a shorter output). A checkpoint whose
vocabulary has no timestamp tokens gives one segment per piece. Word timestamps come from the decoder's
cross-attention (streamer/multimodal/word_timestamps.py): a teacher-forced pass over each piece's text on the device thread.
"""
from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import numpy as np
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from streamer.multimodal.audio import MAX_AUDIO_BYTES, SAMPLE_RATE, decode_audio, split_audio
from streamer.multimodal.speech import Segment
from streamer.multimodal.word_timestamps import Word, token_start_times, word_timestamps
from streamer.sampling_params import SamplingParams
from streamer.server.generation import engine_error
from streamer.server.protocol import APIError
from streamer.server.responding import JSONResponse
from streamer.server.sse import DONE, event, sse_response
from streamer.threads import to_own_thread

if TYPE_CHECKING:
    from streamer.multimodal.speech import SpeechPrompts
    from streamer.server.app import OpenAIServer

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
_FORM_FIELDS = 32


@dataclass(frozen=True)
class TranscriptionConfig:
    """OpenAI's whisper decoding choices, as its API documents temperature 0: a piece whose text compresses too well
    (it repeats itself: zlib ratio above `compression_ratio_threshold`) or whose tokens are unlikely (mean
    log-probability, end of text counted, below `logprob_threshold`) is decoded again at the next of
    `fallback_temperatures`; the last try stands. No temperatures: off.
    Silence, as OpenAI's whisper judges it: a piece whose no_speech_prob (<|nospeech|>'s probability right after
    <|startoftranscript|>) is above `no_speech_threshold` and whose mean log-probability is at most
    `logprob_threshold` says nothing (no text, no segment; what Whisper writes there is made up), and is not
    decoded again. None: never silent. Streams are neither retried nor cut."""

    fallback_temperatures: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float = 2.4
    logprob_threshold: float = -1.0
    no_speech_threshold: Optional[float] = 0.6

    def __post_init__(self) -> None:
        if any(not 0.0 < t <= 2.0 for t in self.fallback_temperatures):
            raise ValueError(f"fallback temperatures must be in (0, 2], got {self.fallback_temperatures}")
        if self.no_speech_threshold is not None and not 0.0 <= self.no_speech_threshold <= 1.0:
            raise ValueError(f"no_speech_threshold must be in [0, 1], got {self.no_speech_threshold}")

    def fails(self, piece: "Piece") -> bool:
        if self.silent(piece):
            return False
        return _compression_ratio(piece.text) > self.compression_ratio_threshold or \
            piece.mean_logprob < self.logprob_threshold

    def silent(self, piece: "Piece") -> bool:
        return self.no_speech_threshold is not None and piece.no_speech_prob is not None and \
            piece.no_speech_prob > self.no_speech_threshold and piece.mean_logprob <= self.logprob_threshold


@dataclass
class AudioRequest:
    audio: np.ndarray
    model: Optional[str]
    language: Optional[str]
    prompt: str
    response_format: str
    temperature: float
    stream: bool
    task: str  # "transcribe" or "translate"
    granularities: frozenset[str] = frozenset()  # timestamp_granularities[]: segment, word

    @property
    def timestamps(self) -> bool:
        """Whether the answer is made of timed segments."""
        return self.response_format in ("verbose_json", "srt", "vtt")


@dataclass
class Piece:
    """One piece of the audio and its decoded text."""

    start: float  # seconds into the audio
    end: float
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # each token's (verbose_json's avg_logprob)
    temperature: float = 0.0  # the one it was decoded at
    words: list[Word] = field(default_factory=list)  # (word timestamps, when asked for)
    no_speech_prob: Optional[float] = None  # (TranscriptionConfig.silent; None: not measured)
    silent: bool = False  # judged silence: no text, no segment

    @property
    def mean_logprob(self) -> float:
        """Its tokens' mean log-probability, end of text counted (OpenAI's avg_logprob for the fallback)."""
        return sum(self.logprobs) / (len(self.token_ids) + 1)


class AudioAPI:
    """The /v1/audio routes of an OpenAIServer."""

    def __init__(self, server: "OpenAIServer", config: Optional[TranscriptionConfig] = None) -> None:
        self.server = server
        self.config = config if config is not None else TranscriptionConfig()

    def routes(self) -> list[Route]:
        return [Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"]),
                Route("/v1/audio/translations", self.translations, methods=["POST"])]

    @property
    def speech(self) -> "SpeechPrompts":
        core = self.server.engine.engine
        speech = getattr(core, "speech", None)
        if speech is None:
            raise APIError(f"the model `{self.server.model_name}` does not take audio: /v1/audio serves a speech "
                           "model (Whisper)", 400, param="model", code="model_not_supported")
        return speech

    async def transcriptions(self, request: Request) -> Response:
        return await self._answer(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._answer(request, "translate")

    # ------------------------------------------------------------------ parsing
    async def _form(self, request: Request, task: str) -> AudioRequest:
        speech = self.speech  # (before reading the upload: a text model refuses at once)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_AUDIO_BYTES + (1 << 20):
            raise APIError(f"the audio file is larger than {MAX_AUDIO_BYTES >> 20} MiB", 413, param="file")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError("the request must be multipart/form-data with the audio in `file`", param="file")
        try:
            form = await request.form(max_files=1, max_fields=_FORM_FIELDS)
        except Exception as e:  # (starlette's MultiPartException and the parser's own)
            raise APIError(f"the request's form could not be read: {e}", param="file") from None
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise APIError("`file` (the audio, as a file part) is required", param="file")
            data = await upload.read()
        finally:
            await form.close()
        if len(data) > MAX_AUDIO_BYTES:
            raise APIError(f"the audio file is larger than {MAX_AUDIO_BYTES >> 20} MiB", 413, param="file")
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        fmt = fields.get("response_format", "json")
        if fmt not in FORMATS:
            raise APIError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}",
                           param="response_format")
        temperature = _number(fields.get("temperature", "0"), "temperature")
        if not 0.0 <= temperature <= 1.0:
            raise APIError(f"temperature must be in [0, 1], got {temperature}", param="temperature")
        stream = _boolean(fields.get("stream", "false"), "stream")
        if stream and fmt not in ("json", "text"):
            raise APIError(f"stream is supported with response_format json or text, not {fmt}", param="stream")
        granularities = _granularities([v for v in form.getlist("timestamp_granularities[]") if isinstance(v, str)]
                                       + [v for v in form.getlist("timestamp_granularities") if isinstance(v, str)],
                                       fmt)
        language = fields.get("language") or None
        if language is not None:
            language = language.strip().lower()
            known = speech.language_ids()
            if speech.multilingual and language not in known:
                raise APIError(f"language {language!r} is not one this model knows ({', '.join(sorted(known))})",
                               param="language")
            if not speech.multilingual and language != "en":
                raise APIError("this model is English-only (language 'en')", param="language")
        if task == "translate" and not speech.multilingual:
            raise APIError("this model is English-only: it does not translate", param="model")
        try:
            audio = await to_own_thread(decode_audio, data)
        except ValueError as e:
            raise APIError(f"the audio file could not be decoded: {e}", param="file") from None
        if not len(audio):
            raise APIError("the audio file holds no samples", param="file")
        return AudioRequest(audio, fields.get("model"), language, fields.get("prompt", ""), fmt, temperature,
                            stream, task, granularities)

    # ------------------------------------------------------------------ answering
    async def _answer(self, request: Request, task: str) -> Response:
        req = await self._form(request, task)
        self.server._check_model(req.model)  # (404 for a model not served; adapters do not apply here)
        speech = self.speech
        tokenizer = self.server.engine.tokenizer
        cuts = split_audio(req.audio, max_seconds=speech.max_seconds)
        pieces, at = [], 0
        for cut in cuts:
            pieces.append(Piece(at / SAMPLE_RATE, (at + len(cut)) / SAMPLE_RATE, temperature=req.temperature))
            at += len(cut)
        language = req.language
        if language is None and speech.multilingual:
            language = await self._detect_language(cuts[0])
        try:
            previous = speech.previous_ids(tokenizer, req.prompt)
            timestamps = req.timestamps and bool(speech.timestamp_ids(tokenizer))
            prompt_ids = speech.prompt_ids(tokenizer, language, req.task, previous, timestamps)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None
        params = SamplingParams(temperature=req.temperature, max_tokens=None, logprobs=0,
                                skip_special_tokens=True,
                                logit_bias=speech.suppressed(self.server.engine.engine.vocab_size) or None)
        prompts = [{"prompt_token_ids": prompt_ids, "multi_modal_data": {"audio": (cut, SAMPLE_RATE)}}
                   for cut in cuts]
        streams = []
        try:
            for prompt in prompts:
                streams.append(await self.server.engine.add_request(prompt, params))
        except Exception as e:
            for s in streams:
                s.close()
            raise engine_error(e) from None
        duration = len(req.audio) / SAMPLE_RATE
        if req.stream:
            return sse_response(self._events(streams, pieces, duration), headers={})
        no_speech = speech.no_speech_id(tokenizer)
        probe = no_speech is not None and (req.response_format == "verbose_json" or
                                           self.config.no_speech_threshold is not None)
        try:
            await asyncio.gather(*(_collect(s, p) for s, p in zip(streams, pieces)),
                                 *(self._no_speech(p, pr, no_speech) for p, pr in zip(pieces, prompts) if probe))
            if req.temperature == 0.0:
                await asyncio.gather(*(self._fall_back(pr, i, pieces, params) for i, pr in enumerate(prompts)))
            for i, p in enumerate(pieces):
                if self.config.silent(p):  # (nothing said: what the model wrote is dropped)
                    pieces[i] = Piece(p.start, p.end, temperature=p.temperature, no_speech_prob=p.no_speech_prob,
                                      silent=True)
            if "word" in req.granularities:
                align = speech.prompt_ids(tokenizer, language, req.task)  # (no previous text, no timestamps)
                await asyncio.gather(*(self._words(p, cut, align, language) for p, cut in zip(pieces, cuts)))
        except Exception as e:
            raise engine_error(e) from None
        finally:
            for s in streams:
                s.close()
        return self._response(req, pieces, language, duration, prompt_ids)

    async def _fall_back(self, prompt: dict[str, Any], index: int, pieces: list[Piece],
                         params: SamplingParams) -> None:
        """Decode pieces[index] again at each fallback temperature in turn while it fails the thresholds."""
        for temperature in self.config.fallback_temperatures:
            piece = pieces[index]
            if not self.config.fails(piece):
                return
            again = Piece(piece.start, piece.end, temperature=temperature, no_speech_prob=piece.no_speech_prob)
            stream = await self.server.engine.add_request(prompt, params.clone(temperature=temperature))
            try:
                await _collect(stream, again)
            finally:
                stream.close()
            pieces[index] = again

    async def _no_speech(self, piece: Piece, prompt: dict[str, Any], no_speech: int) -> None:
        """The piece's no_speech_prob: <|nospeech|>'s probability where the decoder reads <|startoftranscript|>
        (after any previous text), one decoder step over the audio the transcription encoded (the runner's encoder
        cache holds it). The sampled token is held to <|nospeech|>; its logprob is the raw distribution's."""
        ids = prompt["prompt_token_ids"]
        sot = ids.index(self.speech.special_id(self.server.engine.tokenizer, "<|startoftranscript|>"))
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, allowed_token_ids=[no_speech])
        out = await self.server.engine.generate({**prompt, "prompt_token_ids": ids[:sot + 1]}, params)
        lps = out.outputs[0].logprobs
        piece.no_speech_prob = math.exp(lps[0][no_speech].logprob) if lps and no_speech in lps[0] else None

    async def _words(self, piece: Piece, audio: np.ndarray, prefix: list[int], language: Optional[str]) -> None:
        """The piece's words and when they are spoken (streamer/multimodal/word_timestamps.py): the alignment heads' scores
        for its text after `prefix` (the decoder prompt, without timestamps), on the device thread."""
        import torch
        speech = self.speech
        engine = self.server.engine
        eos = engine.tokenizer.token_to_id("<|endoftext|>")
        text = [t for t in piece.token_ids if t < eos]
        if not text:
            return
        clip = await to_own_thread(speech.encoder_input, {"audio": (audio, SAMPLE_RATE)})
        tokens = torch.tensor(prefix + text + [eos])
        runner = engine.engine.runner

        def scores() -> Any:  # (the encoder's output for this audio is in the runner's cache: the piece's own)
            return runner.model.cross_attention_scores(runner.encoded_audio([clip])[0], tokens,
                                                       speech.alignment_heads)
        scores = await engine.on_device(scores)
        frames = round(len(audio) / speech.config.hop_length) // 2  # (the audio's encoder frames: no padding)
        starts = await to_own_thread(token_start_times, scores[:, len(prefix) - 1:-1].cpu(), max(frames, 1),
                                         speech.time_precision)
        piece.words = word_timestamps(text, starts, self._decode, language, piece.start, piece.end)

    async def _detect_language(self, audio: np.ndarray) -> str:
        """The language the model reads in `audio`: its likeliest language token right after
        <|startoftranscript|>."""
        speech = self.speech
        langs = speech.language_ids()
        tokenizer = self.server.engine.tokenizer
        prompt = {"prompt_token_ids": [speech.special_id(tokenizer, "<|startoftranscript|>")],
                  "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}}
        params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=sorted(langs.values()))
        try:
            out = await self.server.engine.generate(prompt, params)
        except Exception as e:
            raise engine_error(e) from None
        token = out.outputs[0].token_ids[0]
        return next(code for code, i in langs.items() if i == token)

    async def _events(self, streams: list, pieces: list[Piece], duration: float) -> AsyncIterator[bytes]:
        """OpenAI's transcription stream: text deltas, piece after piece, then the whole text. The deltas add up
        to that text: each piece's edge whitespace is dropped (trailing whitespace is held until more text follows)
        and pieces are joined by one space, as `_joined` joins them."""
        try:
            sent = False
            for stream, piece in zip(streams, pieces):
                started, held = False, ""
                async for out in stream:
                    piece.text += out.text
                    piece.token_ids += tuple(out.token_ids)
                    text = out.text
                    if not started:
                        text = text.lstrip()
                        if not text:
                            continue
                        started = True
                        text = " " + text if sent else text
                    text = held + text
                    body = text.rstrip()
                    held = text[len(body):]
                    if body:
                        sent = True
                        yield event({"type": "transcript.text.delta", "delta": body, "logprobs": None})
            yield event({"type": "transcript.text.done", "text": _joined(pieces), "logprobs": None,
                         "usage": _usage(duration)})
        except Exception as e:
            yield event(engine_error(e).body())
        finally:
            for s in streams:
                s.close()
        yield DONE

    def _response(self, req: AudioRequest, pieces: list[Piece], language: Optional[str],
                  duration: float, prompt_ids: list[int]) -> Response:
        text = _joined(pieces)
        fmt = req.response_format
        if fmt == "text":
            return PlainTextResponse(text)
        if fmt == "json":
            return JSONResponse({"text": text, "usage": _usage(duration)})
        segments = self._segments(pieces, prompt_ids)
        if fmt == "srt" or fmt == "vtt":
            return PlainTextResponse(_subtitles(segments, fmt), media_type="text/vtt" if fmt == "vtt" else None)
        body: dict[str, Any] = {"task": "translate" if req.task == "translate" else "transcribe",
                                "language": language or "en", "duration": duration, "text": text}
        if "word" in req.granularities:
            body["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
                             for p in pieces for w in p.words]
        if "segment" in req.granularities or not req.granularities:
            body["segments"] = segments
        return JSONResponse({**body, "usage": _usage(duration)})

    def _segments(self, pieces: list[Piece], prompt_ids: list[int]) -> list[dict[str, Any]]:
        """verbose_json's segments: those the timestamps mark in each piece (the piece whole when it wrote none,
        or the model has no timestamp tokens), each with its tokens' mean log-probability."""
        speech = self.speech
        rules = speech.rules(self.server.engine.tokenizer, prompt_ids)
        stamped = rules is not None and rules.timestamps
        out: list[dict[str, Any]] = []
        for p in (p for p in pieces if not p.silent):
            spans = speech.segments(p.token_ids, rules, p.start, p.end) if stamped else []  # type: ignore[arg-type]
            if not spans:  # (one segment: the piece)
                positions = [i for i, t in enumerate(p.token_ids) if not stamped or t < rules.eos]  # type: ignore
                spans = [Segment(p.start, p.end, [p.token_ids[i] for i in positions], positions)] if positions \
                    or not stamped else []
            for seg in spans:
                text = self._decode(seg.token_ids) if stamped else p.text
                lps = [p.logprobs[i] for i in seg.positions if i < len(p.logprobs)]
                out.append({"id": len(out), "seek": int(round(p.start * 100)), "start": round(seg.start, 3),
                            "end": round(seg.end, 3), "text": text, "tokens": seg.token_ids,
                            "temperature": p.temperature, "avg_logprob": sum(lps) / max(len(lps), 1),
                            "compression_ratio": _compression_ratio(text), "no_speech_prob": p.no_speech_prob})
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.server.engine.tokenizer.decode(ids, skip_special_tokens=True)


async def _collect(stream: Any, piece: Piece) -> None:
    texts = []
    async for out in stream:
        texts.append(out.text)
        piece.token_ids += tuple(out.token_ids)
        piece.logprobs += tuple(next(iter(lp.values())).logprob for lp in out.logprobs or () if lp)
    piece.text = "".join(texts)


def _granularities(values: list[str], fmt: str) -> frozenset[str]:
    """timestamp_granularities[]: segment and / or word, with verbose_json."""
    for v in values:
        if v not in ("segment", "word"):
            raise APIError(f"timestamp_granularities must be 'segment' or 'word', got {v!r}",
                           param="timestamp_granularities")
    if values and fmt != "verbose_json":
        raise APIError(f"timestamp_granularities needs response_format verbose_json, not {fmt}",
                       param="timestamp_granularities")
    return frozenset(values)


def _joined(pieces: list[Piece]) -> str:
    return " ".join(t for t in (p.text.strip() for p in pieces) if t)


def _usage(duration: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(duration)}


def _compression_ratio(text: str) -> float:
    """Whisper's repetition check: the text's bytes over its zlib-compressed bytes."""
    raw = text.encode()
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _subtitles(segments: list[dict[str, Any]], fmt: str) -> str:
    sep = "," if fmt == "srt" else "."
    cues = []
    for i, seg in enumerate(segments):
        when = f"{_timestamp(seg['start'], sep)} --> {_timestamp(seg['end'], sep)}"
        text = seg["text"].strip()
        cues.append(f"{i + 1}\n{when}\n{text}\n" if fmt == "srt" else f"{when}\n{text}\n")
    return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)


def _number(value: str, name: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise APIError(f"{name} must be a number, got {value!r}", param=name) from None
    if not math.isfinite(x):
        raise APIError(f"{name} must be finite, got {value!r}", param=name)
    return x


def _boolean(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0", ""):
        return False
    raise APIError(f"{name} must be true or false, got {value!r}", param=name)


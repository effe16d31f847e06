"""Speech prompts for an encoder-decoder speech model (Whisper, models/whisper.py): a prompt's audio becomes its
encoder input, and a transcription or translation request becomes the decoder prompt Whisper was trained on.

A request is `{"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", "multi_modal_data":
{"audio": (samples, sample_rate)}}` (vLLM's form). The audio (at most `chunk_length`, 30 s) is turned into
log-mel features on the host when the request arrives (streamer/multimodal/audio.py); the model's encoder runs on them by the
step that computes the request's first token. The server's /v1/audio/transcriptions builds the decoder prompt
(`decoder_prompt`), detects the language when none is given (`language_tokens`), and cuts longer audio into pieces.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from streamer.multimodal.audio import SAMPLE_RATE, WhisperFeatureConfig, WhisperFeatures, as_audio
from streamer.multimodal.inputs import hash_pixels
from streamer.multimodal.word_timestamps import alignment_heads


@dataclass(eq=False)
class SpeechInput:
    """One prompt's audio as its encoder takes it (carried with the prompt's images' inputs until the engine
    hands it to its Request as `encoder_input`)."""

    features: torch.Tensor  # float32 [mels, frames] on the host
    seconds: float  # the audio's length
    key: bytes = b""  # a hash of the features: the runner's encoder cache keeps the encoder's output by it


@dataclass(frozen=True)
class DecodeRules:
    """What Whisper's decoding bans, beyond logit_bias, from the tokens a request has written so far (transformers'
    SuppressTokensAtBegin and WhisperTimeStamp logits processors; OpenAI's whisper applies the same).

    The first token never is one of `begin_suppress` (a blank, end of text). A request whose prompt leaves out
    <|notimestamps|> writes timestamps: <|0.00|> .. <|30.00|>, the ids from `timestamp_begin` on, one every 20 ms.
    Its text comes in segments, each opened and closed by a timestamp: it starts with a timestamp (at most
    `max_initial`, 1 s by default), a timestamp follows a closing one only right before the end, timestamps never go
    back, and <|notimestamps|> never comes. The sampler adds the rule that needs the logits: where the timestamps
    together are likelier than any one text token, a timestamp comes next (`Sampler`, `SpeechMasks`)."""

    eos: int
    no_timestamps: int
    begin_suppress: tuple[int, ...]
    timestamps: bool  # the request writes timestamps
    max_initial: Optional[int]  # the first timestamp's highest index

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    def bans(self, output: Sequence[int], vocab_size: int) -> list[tuple[int, int]]:
        """The token ranges [lo, hi) banned after `output` (the request's generated tokens)."""
        bans = [(t, t + 1) for t in self.begin_suppress] if not output else []
        if not self.timestamps:
            return bans
        begin = self.timestamp_begin
        bans.append((self.no_timestamps, self.no_timestamps + 1))
        if not output:  # a timestamp first, and an early one
            bans.append((0, begin))
            if self.max_initial is not None:
                bans.append((begin + self.max_initial + 1, vocab_size))
            return bans
        last = output[-1] >= begin
        if last:
            closed = len(output) < 2 or output[-2] >= begin  # (a segment's opening timestamp is never last)
            bans.append((begin, vocab_size) if closed else (0, self.eos))
        stamp = next((t for t in reversed(output) if t >= begin), None)
        if stamp is not None:  # no going back; a closed segment's end does not open the next one
            bans.append((begin, stamp if last and not closed else stamp + 1))
        return bans


@dataclass
class Segment:
    """A stretch of text between two timestamps (seconds from the audio's start)."""

    start: float
    end: float
    token_ids: list[int]  # its text's
    positions: list[int]  # where they are in the output


def timestamp_segments(token_ids: Sequence[int], rules: DecodeRules, precision: float, offset: float = 0.0,
                       end: Optional[float] = None) -> list[Segment]:
    """A timestamped output's segments: `<|t0|> text <|t1|>` pairs (a segment closed by the next one's opening
    timestamp too). Text with no closing timestamp (the output was cut off) ends at `end`; a segment without text
    is dropped, and so are special tokens (end of text). Times are `offset` + index x `precision`, capped at
    `end`."""
    begin = rules.timestamp_begin
    segments: list[Segment] = []
    start: Optional[float] = None
    text: list[int] = []
    positions: list[int] = []
    for i, t in enumerate(token_ids):
        if t < rules.eos:
            text.append(t)
            positions.append(i)
            continue
        if t < begin:
            continue
        at = offset + (t - begin) * precision
        if end is not None:
            at = min(at, end)
        if start is not None and text:
            segments.append(Segment(start, at, text, positions))
        start, text, positions = at, [], []
    if text:
        last = end if end is not None else segments[-1].end if segments else offset
        segments.append(Segment(offset if start is None else start, max(last, start or offset), text, positions))
    return segments


class SpeechPrompts:
    """How a speech model takes its prompts' audio: the checkpoint's feature extractor settings
    (preprocessor_config.json) and its special tokens (generation_config.json, as Whisper checkpoints ship)."""

    def __init__(self, folder: Path, model: Any) -> None:
        cfg = WhisperFeatureConfig.from_folder(folder)
        mels = model.encoder.num_mel_bins
        if cfg.feature_size != mels:
            raise ValueError(f"{folder}: preprocessor_config.json's feature_size is {cfg.feature_size}, but the "
                             f"model's encoder takes {mels} mel bins (num_mel_bins)")
        self.config = cfg
        # (a `prompt` keeps at most half the decoder's context, as transformers and OpenAI's whisper keep it)
        self.max_previous_tokens = model.cfg.max_position_embeddings // 2 - 1
        self.vocab_size = model.cfg.vocab_size
        self.features = WhisperFeatures(cfg)
        gen = folder / "generation_config.json"
        self.generation: dict[str, Any] = json.loads(gen.read_text()) if gen.is_file() else {}
        # A timestamp token's step in seconds: one encoder frame, two feature frames (20 ms)
        self.time_precision = 2 * cfg.hop_length / cfg.sampling_rate
        layers, heads = len(model.layers), model.layers[0].encoder_attn.heads
        self.alignment_heads = alignment_heads(self.generation, layers, heads)  # (word timestamps)
        bad = [(layer, head) for layer, head in self.alignment_heads if not (0 <= layer < layers and 0 <= head < heads)]
        if bad:
            raise ValueError(f"{folder}: generation_config.json's alignment_heads names {bad}, but the decoder has "
                             f"{layers} layers of {heads} heads")

    def no_timestamps_id(self, tokenizer: Any) -> Optional[int]:
        no_ts = self.generation.get("no_timestamps_token_id", tokenizer.token_to_id("<|notimestamps|>"))
        return None if no_ts is None else int(no_ts)

    @staticmethod
    def no_speech_id(tokenizer: Any) -> Optional[int]:
        """<|nospeech|> (<|nocaptions|> in the first Whisper vocabularies): its probability right after
        <|startoftranscript|> is OpenAI's no_speech_prob. None for a vocabulary without it."""
        for token in ("<|nospeech|>", "<|nocaptions|>"):
            i = tokenizer.token_to_id(token)
            if i is not None:
                return int(i)
        return None

    def timestamp_ids(self, tokenizer: Any, vocab_size: Optional[int] = None) -> range:
        """The timestamp tokens' ids: from the one after <|notimestamps|> to the end of the model's vocabulary
        (<|0.00|> .. <|30.00|>); empty without <|notimestamps|> (or room after it)."""
        no_ts = self.no_timestamps_id(tokenizer)
        return range(0) if no_ts is None else range(no_ts + 1, vocab_size or self.vocab_size)

    @property
    def max_seconds(self) -> float:
        return float(self.config.chunk_length)

    def encoder_input(self, data: Any) -> SpeechInput:
        """A prompt's multi_modal_data ({"audio": samples at 16 kHz, or (samples, sample_rate)}) as its encoder
        input; ValueError for anything else, or for audio longer than the model's window."""
        if data is None:
            raise ValueError("this is a speech model: a prompt needs audio, {'prompt': decoder prompt, "
                             "'multi_modal_data': {'audio': (samples, sample_rate)}}")
        if not isinstance(data, dict) or set(data) != {"audio"}:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data must be {{'audio': (samples, sample_rate)}} for a speech model, got "
                             f"{keys}")
        audio = as_audio(data["audio"])
        seconds = len(audio) / SAMPLE_RATE
        if seconds > self.max_seconds:
            raise ValueError(f"multi_modal_data['audio'] is {seconds:.1f} s long; the model takes at most "
                             f"{self.max_seconds:g} s a prompt (split longer audio: streamer.multimodal.audio.split_audio, "
                             "as /v1/audio/transcriptions does)")
        features = self.features(audio)
        return SpeechInput(features, seconds, hash_pixels(features))

    @staticmethod
    def take(inputs: tuple) -> SpeechInput:
        """The encoder input among a prompt's inputs (see `encoder_input`)."""
        if len(inputs) != 1 or not isinstance(inputs[0], SpeechInput):
            raise ValueError("this is a speech model: a prompt needs audio (multi_modal_data={'audio': ...})")
        return inputs[0]

    # ------------------------------------------------------------------ decoder prompts
    def language_ids(self) -> dict[str, int]:
        """Language code -> its token id ("en" -> id of <|en|>), from generation_config.json's lang_to_id; {} for an
        English-only checkpoint (or one without it)."""
        langs = self.generation.get("lang_to_id") or {}
        return {tok.strip("<|>"): int(i) for tok, i in langs.items()}

    @property
    def multilingual(self) -> bool:
        return bool(self.generation.get("is_multilingual", bool(self.language_ids())))

    def suppressed(self, vocab_size: int) -> dict[int, float]:
        """generation_config.json's `suppress_tokens` (symbols Whisper writes for non-speech: music notes,
        brackets, ...) as a logit bias that bans them, as transformers' and OpenAI's whisper decode by default."""
        ids = self.generation.get("suppress_tokens") or []
        return {int(i): -100.0 for i in ids if isinstance(i, int) and 0 <= i < vocab_size}

    def rules(self, tokenizer: Any, prompt_ids: Sequence[int]) -> Optional[DecodeRules]:
        """How a request with this decoder prompt decodes (`DecodeRules`): with timestamps unless the prompt says
        <|notimestamps|> (or the vocabulary has none), when it asks for a transcription (a multilingual model's
        prompt names the language and the task after <|startoftranscript|>; one that stops before, as language
        detection's does, gets no rules). None for a prompt without <|startoftranscript|>."""
        sot = tokenizer.token_to_id("<|startoftranscript|>")
        no_ts = self.no_timestamps_id(tokenizer)
        eos = tokenizer.token_to_id("<|endoftext|>")
        if sot is None or no_ts is None or eos is None or sot not in prompt_ids:
            return None
        after = list(prompt_ids)[len(prompt_ids) - list(reversed(prompt_ids)).index(sot):]
        tasks = {tokenizer.token_to_id(f"<|{t}|>") for t in ("transcribe", "translate")}
        if self.multilingual and not (len(after) >= 2 and after[0] in self.language_ids().values()
                                      and after[1] in tasks):
            return None
        begin_suppress = self.generation.get("begin_suppress_tokens") or []
        max_initial = self.generation.get("max_initial_timestamp_index", 50)
        return DecodeRules(eos=int(eos), no_timestamps=no_ts,
                           begin_suppress=tuple(int(t) for t in begin_suppress if isinstance(t, int)),
                           timestamps=no_ts not in after and bool(self.timestamp_ids(tokenizer)),
                           max_initial=None if max_initial is None else int(max_initial))

    def segments(self, token_ids: Sequence[int], rules: DecodeRules, offset: float = 0.0,
                 end: Optional[float] = None) -> list[Segment]:
        """A timestamped output's segments (see `timestamp_segments`)."""
        return timestamp_segments(token_ids, rules, self.time_precision, offset, end)

    def special_id(self, tokenizer: Any, token: str) -> int:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"the tokenizer has no {token} token (is this a Whisper tokenizer?)")
        return int(i)

    def prompt_ids(self, tokenizer: Any, language: Optional[str], task: str = "transcribe",
                   previous: Sequence[int] = (), timestamps: bool = False) -> list[int]:
        """The decoder prompt Whisper was trained on: [<|startofprev|> previous text's ids] <|startoftranscript|>
        <|lang|> <|task|> [<|notimestamps|> unless `timestamps`] (an English-only model's: no language nor task).
        ValueError for a language the model does not know, or a task it does not do."""
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {task!r}")
        ids = [self.special_id(tokenizer, "<|startofprev|>"), *previous] if previous else []
        ids.append(self.special_id(tokenizer, "<|startoftranscript|>"))
        if self.multilingual:
            langs = self.language_ids()
            if language not in langs:
                raise ValueError(f"language {language!r} is not one this model knows "
                                 f"({', '.join(sorted(langs))})")
            ids += [langs[language], self.special_id(tokenizer, f"<|{task}|>")]
        elif language not in (None, "en") or task != "transcribe":
            raise ValueError("this model is English-only: it transcribes English (language 'en'), and does not "
                             "translate")
        if not timestamps:
            ids.append(self.special_id(tokenizer, "<|notimestamps|>"))
        return ids

    def previous_ids(self, tokenizer: Any, text: str) -> list[int]:
        """A request's `prompt` (text that came before the audio, or spellings to follow) as Whisper reads it
        after <|startofprev|>: " " + the text, at most half the decoder's context (its last tokens), as
        transformers and OpenAI's whisper keep it. ValueError for one that spells special tokens (it would steer
        the task or the language)."""
        ids = tokenizer.encode(" " + text.strip(), add_special_tokens=False) if text.strip() else []
        special = [i for i in ids if i in tokenizer.all_special_ids]
        if special:
            raise ValueError(f"prompt must not contain special tokens, found {tokenizer.decode(special[:1], False)!r}")
        return ids[-self.max_previous_tokens:] if ids else []

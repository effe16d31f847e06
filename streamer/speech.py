"""Speech prompts for an encoder-decoder speech model (Whisper, models/whisper.py): a prompt's audio becomes its
encoder input, and a transcription or translation request becomes the decoder prompt Whisper was trained on.

A request is `{"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", "multi_modal_data":
{"audio": (samples, sample_rate)}}` (vLLM's form). The audio (at most `chunk_length`, 30 s) is turned into
log-mel features on the host when the request arrives (streamer/audio.py); the model's encoder runs on them by the
step that computes the request's first token. The server's /v1/audio/transcriptions builds the decoder prompt
(`decoder_prompt`), detects the language when none is given (`language_tokens`), and cuts longer audio into pieces.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from streamer.audio import SAMPLE_RATE, WhisperFeatureConfig, WhisperFeatures, as_audio


@dataclass(eq=False)
class SpeechInput:
    """One prompt's audio as its encoder takes it (carried with the prompt's images' inputs until the engine
    hands it to its Request as `encoder_input`)."""

    features: torch.Tensor  # float32 [mels, frames] on the host
    seconds: float  # the audio's length


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
        self.features = WhisperFeatures(cfg)
        gen = folder / "generation_config.json"
        self.generation: dict[str, Any] = json.loads(gen.read_text()) if gen.is_file() else {}

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
                             f"{self.max_seconds:g} s a prompt (split longer audio: streamer.audio.split_audio, "
                             "as /v1/audio/transcriptions does)")
        return SpeechInput(self.features(audio), seconds)

    @staticmethod
    def take(inputs: tuple) -> torch.Tensor:
        """The encoder input among a prompt's inputs (see `encoder_input`)."""
        if len(inputs) != 1 or not isinstance(inputs[0], SpeechInput):
            raise ValueError("this is a speech model: a prompt needs audio (multi_modal_data={'audio': ...})")
        return inputs[0].features

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

    def special_id(self, tokenizer: Any, token: str) -> int:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"the tokenizer has no {token} token (is this a Whisper tokenizer?)")
        return int(i)

    def prompt_ids(self, tokenizer: Any, language: Optional[str], task: str = "transcribe",
                   previous: Sequence[int] = ()) -> list[int]:
        """The decoder prompt Whisper was trained on: [<|startofprev|> previous text's ids] <|startoftranscript|>
        <|lang|> <|task|> <|notimestamps|> (an English-only model's: no language nor task). ValueError for a
        language the model does not know, or a task it does not do."""
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

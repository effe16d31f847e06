"""Benchmark workloads: random prompts of exact token lengths, prefix-sharing groups, JSON/JSONL prompt files.

Random prompts are text (so the same workload drives both the completions and the chat endpoint): token ids are
sampled from the model's vocabulary, decoded, and re-encoded; the ids are then trimmed or topped up and the loop
repeats until the text encodes to exactly the asked number of tokens (without special tokens such as BOS, as
vLLM's bench counts them). A shared prefix is kept token-identical in every prompt that uses it.
"""
from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from tokenizers import Tokenizer

from streamer.bench.remote_tokenizer import RemoteTokenizer

# A local tokenizer, or the server's own through its /tokenize and /detokenize (streamer/bench/remote_tokenizer.py).
AnyTokenizer = Union[Tokenizer, RemoteTokenizer]

_MAX_TRIES = 64
_ADJUST_ROUNDS = 8
DEFAULT_FILE_OUTPUT_LEN = 128


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens without special tokens; 0 = unknown (no tokenizer)
    output_len: int  # max_tokens asked of the server
    images: list[str] = field(default_factory=list)  # data: URLs sent as image_url parts (chat endpoint)
    audio: bytes = b""  # a WAV file uploaded as the `file` part (transcriptions endpoint)
    audios: list[str] = field(default_factory=list)  # base64 WAV files sent as input_audio parts (chat endpoint)
    audio_seconds: float = 0.0  # the clip's length


def random_image_urls(num: int, width: int, height: int, seed: int) -> list[str]:
    """`num` distinct random-pixel PNG images as data: URLs (distinct, so no server cache can skip one)."""
    import io

    from PIL import Image
    rng = np.random.default_rng(seed)
    urls = []
    for _ in range(num):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


def add_images(requests: list[SampleRequest], per_request: int, width: int, height: int, seed: int) -> None:
    """Give every request `per_request` images of its own."""
    urls = random_image_urls(len(requests) * per_request, width, height, seed + 7919)
    for i, req in enumerate(requests):
        req.images = urls[i * per_request:(i + 1) * per_request]


AUDIO_RATE = 16000  # Whisper's sample rate: the server need not resample


def synthetic_wav(seconds: float, rng: np.random.Generator, rate: int = AUDIO_RATE) -> bytes:
    """A WAV file (mono, 16-bit PCM) of `seconds` of synthetic sound: a tone of random pitch with its second
    harmonic, a syllable-rate loudness envelope and a little noise, all drawn from `rng` (so every clip differs)."""
    import io
    import wave

    n = max(1, int(round(seconds * rate)))
    t = np.arange(n) / rate
    f0, syllables = rng.uniform(100.0, 1000.0), rng.uniform(2.0, 6.0)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * syllables * t + phase[0])
    x = envelope * (0.35 * np.sin(2 * np.pi * f0 * t + phase[1]) + 0.12 * np.sin(4 * np.pi * f0 * t + phase[2]))
    x += 0.03 * rng.standard_normal(n)
    pcm = (np.clip(x, -1.0, 1.0) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def audio_requests(num: int, seconds: float, seed: int = 0) -> list[SampleRequest]:
    """`num` transcription requests, each its own synthetic clip of `seconds` (distinct, so no cache serves one);
    no text prompt and no output length (the transcript's length is the model's)."""
    rng = np.random.default_rng(seed + 104729)
    n = max(1, int(round(seconds * AUDIO_RATE)))
    return [SampleRequest("", 0, 0, audio=synthetic_wav(seconds, rng), audio_seconds=n / AUDIO_RATE)
            for _ in range(num)]


def add_audio(requests: list[SampleRequest], per_request: int, seconds: float, seed: int) -> None:
    """Give every request `per_request` synthetic clips of `seconds` of its own (audio-language models' chat)."""
    rng = np.random.default_rng(seed + 15485863)
    for req in requests:
        req.audios = [base64.b64encode(synthetic_wav(seconds, rng)).decode() for _ in range(per_request)]
        req.audio_seconds = per_request * seconds


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A HF tokenizer from a folder holding tokenizer.json (or that file itself), or a slow tokenizer's files."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        from streamer.tokenizer.slow_tokenizer import convert, slow_config
        config = p / "tokenizer_config.json"
        converted = convert(p, slow_config(p, json.loads(config.read_text()) if config.is_file() else {})) \
            if p.is_dir() else None
        if converted is None:
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        return converted
    return Tokenizer.from_file(str(file))


def count_tokens(tok: AnyTokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


class PromptMaker:
    """Makes texts that encode to an exact number of tokens, optionally after a fixed token prefix."""

    def __init__(self, tok: AnyTokenizer, rng: np.random.Generator) -> None:
        special = _added_token_ids(tok)
        vocab = (tok.token_ids() if isinstance(tok, RemoteTokenizer)
                 else tok.get_vocab(with_added_tokens=False).values())
        ids = sorted(set(vocab) - special)
        if not ids:
            raise ValueError("tokenizer has an empty vocabulary")
        self.tok, self.rng, self.pool = tok, rng, np.asarray(ids, dtype=np.int64)

    def sample(self, n: int) -> list[int]:
        return self.rng.choice(self.pool, size=n).tolist() if n > 0 else []

    def make(self, n: int, prefix: Optional[list[int]] = None) -> tuple[str, list[int]]:
        """(text, ids) with len(ids) == len(prefix) + n, ids == encode(text), ids starting with prefix."""
        prefix = prefix or []
        p = len(prefix)
        for _ in range(_MAX_TRIES):  # fresh samples
            ids = self.sample(n)
            for _ in range(_ADJUST_ROUNDS):  # trim / top up; usually settles in one or two rounds
                text = self.tok.decode(prefix + ids, skip_special_tokens=True)
                enc = self.tok.encode(text, add_special_tokens=False).ids
                if enc[:p] != prefix:  # the random part merged into the prefix
                    break
                suffix = enc[p:]
                if len(suffix) == n:
                    return text, enc
                ids = suffix[:n] if len(suffix) > n else suffix + self.sample(n - len(suffix))
        raise RuntimeError(f"could not make a prompt of exactly {n} tokens after {_MAX_TRIES} tries")


def _added_token_ids(tok: AnyTokenizer) -> set[int]:
    if isinstance(tok, RemoteTokenizer):
        return set(tok.special_ids())
    try:
        return set(tok.get_added_tokens_decoder())
    except AttributeError:  # pragma: no cover - very old tokenizers
        return set()


def length_range(mean: int, ratio: float, low: int) -> tuple[int, int]:
    """Inclusive [floor(mean*(1-r)), ceil(mean*(1+r))], as vLLM's random dataset samples lengths."""
    return max(low, math.floor(mean * (1 - ratio))), max(low, math.ceil(mean * (1 + ratio)))


def synthetic_requests(tok: AnyTokenizer, num: int, *, input_len: int, output_len: int, range_ratio: float = 0.0,
                       prefix_len: int = 0, num_prefixes: int = 1, seed: int = 0,
                       shuffle: bool = False) -> list[SampleRequest]:
    """Random prompts: `num_prefixes` groups (round-robin) sharing a prefix of `prefix_len` tokens, then a
    random part of input_len (+- range_ratio) tokens; output lengths vary by the same ratio."""
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tok, rng)
    prefixes = [maker.make(prefix_len)[1] if prefix_len > 0 else [] for _ in range(max(1, num_prefixes))]
    in_lo, in_hi = length_range(input_len, range_ratio, 1)
    out_lo, out_hi = length_range(output_len, range_ratio, 1)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num)
    reqs = []
    for i in range(num):
        text, ids = maker.make(int(in_lens[i]), prefixes[i % len(prefixes)])
        reqs.append(SampleRequest(text, len(ids), int(out_lens[i])))
    if shuffle:
        reqs = [reqs[i] for i in rng.permutation(num)]
    return reqs


# --- prompt files -----------------------------------------------------------------------------------
_USER_ROLES = {"human", "user"}
_BOT_ROLES = {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


def _read_entries(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    return data


def _turns(entry: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """First user turn and the reply to it, from ShareGPT `conversations` or OpenAI-style `messages`."""
    turns = entry.get("conversations") or entry.get("messages") or []
    prompt = reply = None
    for t in turns:
        if not isinstance(t, dict):
            continue
        role = str(t.get("from", t.get("role", ""))).lower()
        value = t.get("value", t.get("content"))
        if prompt is None and role in _USER_ROLES and isinstance(value, str):
            prompt = value
        elif prompt is not None and role in _BOT_ROLES and isinstance(value, str):
            reply = value
            break
    return prompt, reply


def _parse_entry(entry: Any) -> tuple[Optional[str], Optional[int], Optional[str]]:
    """(prompt, output_len from the entry, reference reply) of one file entry."""
    if isinstance(entry, str):
        return entry, None, None
    if not isinstance(entry, dict):
        return None, None, None
    if "conversations" in entry or "messages" in entry:
        prompt, reply = _turns(entry)
        return prompt, None, reply
    prompt = entry.get("prompt", entry.get("text"))
    out = entry.get("output_len", entry.get("max_tokens"))
    return (prompt if isinstance(prompt, str) else None), (int(out) if out else None), entry.get("completion")


def file_requests(path: str | Path, num: int, *, tok: Optional[AnyTokenizer], output_len: Optional[int] = None,
                  seed: int = 0, shuffle: bool = True) -> list[SampleRequest]:
    """Prompts from a JSON list or JSONL file: strings, {"prompt", "output_len"|"max_tokens"} objects, or
    ShareGPT conversations (first human turn; the reply's token length as output length, as vLLM does).
    Output length: --output-len if given, else the entry's, else the reply's length, else 128. The order is a
    seeded shuffle; entries repeat when the file has fewer than `num`."""
    p = Path(path)
    usable: list[SampleRequest] = []
    for entry in _read_entries(p):
        prompt, out, reply = _parse_entry(entry)
        if not prompt:
            continue
        if output_len is not None:
            out = output_len
        elif out is None and reply and tok is not None:
            out = count_tokens(tok, reply)
        usable.append(SampleRequest(prompt, count_tokens(tok, prompt) if tok else 0,
                                    max(1, out or DEFAULT_FILE_OUTPUT_LEN)))
    if not usable:
        raise ValueError(f"{p}: no usable prompts (expected strings, {{'prompt': ...}} or ShareGPT conversations)")
    order = np.random.default_rng(seed).permutation(len(usable)) if shuffle else np.arange(len(usable))
    return [usable[int(order[i % len(usable)])] for i in range(num)]

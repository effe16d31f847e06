"""Word timestamps for Whisper: when each word of a transcription is spoken, from the decoder's cross-attention.

Whisper's timestamp tokens mark segments; words need the alignment Whisper learned in a few cross-attention heads
(generation_config.json's `alignment_heads`, else every head of the decoder's second half). As OpenAI's whisper
and transformers find it:
1. the decoder reads `<|startoftranscript|><|lang|><|task|><|notimestamps|>`, the text's tokens and
   `<|endoftext|>`, teacher-forced (`WhisperForConditionalGeneration.cross_attention_scores`), and the alignment heads'
   attention over the audio's encoder frames (20 ms each) is kept for the queries that predict each text token;
2. each head's weights are standardised over the tokens, smoothed along time (a median filter, 7 frames wide) and
   averaged over the heads;
3. dynamic time warping finds the monotonic path through the tokens x frames matrix of highest attention: a token
   starts where the path first reaches its row;
4. tokens are grouped into words (at spaces and punctuation; each character for languages written without spaces),
   punctuation joins its neighbour, and a word runs from its first token's start to the next word's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

MEDIAN_FILTER_WIDTH = 7
# Languages written without spaces between words: each character is a word
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
_PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
_PREPENDED = "\"'\u201c\u00bf([{-"  # join the word after them
_APPENDED = "\"'.\u3002,\uff0c!\uff01?\uff1f:\uff1a\u201d)]}\u3001"  # join the word before them


@dataclass
class Word:
    word: str  # with its leading space, as the text has it
    start: float  # seconds
    end: float
    positions: list[int]  # its tokens' indices in the aligned text


def alignment_heads(generation: dict[str, Any], num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """(layer, head) pairs: the checkpoint's `alignment_heads`, else every head of the decoder's second half (as
    OpenAI's whisper defaults)."""
    heads = generation.get("alignment_heads")
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    return [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


def median_filter(x: torch.Tensor, width: int = MEDIAN_FILTER_WIDTH) -> torch.Tensor:
    """A median over `width` neighbours along the last dimension, its edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect").reshape(*x.shape[:-1], -1)
    return padded.unfold(-1, width, 1).sort().values[..., pad]


def dynamic_time_warping(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [N, M] from (0, 0) to (N-1, M-1), each step one row, one column
    or both: (row, column) indices along it. Filled an anti-diagonal at a time (its cells depend only on the two
    before), in float32 with the tie-breaking of transformers' and OpenAI's loops."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    acc[0, 0] = 0.0
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0, c1, c2 = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        step = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2)).astype(np.int8)
        best = np.where(step == 0, c0, np.where(step == 1, c1, c2))
        acc[i, j] = cost[i - 1, j - 1] + best
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    rows, cols = [], []
    i, j = n, m
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def token_start_times(scores: torch.Tensor, num_frames: int, precision: float = 0.02) -> np.ndarray:
    """Each aligned row's start in seconds, from the alignment heads' cross-attention scores [heads, rows, frames]
    (pre-softmax; rows: the queries that predict each text token and the end of text), over the audio's first
    `num_frames` encoder frames."""
    weights = scores[..., :num_frames].float().softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    matrix = median_filter((weights - mean) / std).mean(dim=0)
    rows, cols = dynamic_time_warping(-matrix.double().numpy())
    jumps = np.diff(rows, prepend=-1).astype(bool)  # where the path enters each row
    return cols[jumps] * precision


def split_words(token_ids: Sequence[int], decode: Callable[[list[int]], str], language: Optional[str]
                ) -> list[tuple[str, list[int]]]:
    """The text's words as (text, token positions): pieces that decode to whole characters, joined until a piece
    starts with a space or is punctuation (each piece is a word for languages written without spaces), then
    punctuation joined to its neighbour as Whisper's alignment does."""
    pieces: list[tuple[str, list[int]]] = []
    held: list[int] = []
    for i in range(len(token_ids)):
        held.append(i)
        text = decode([token_ids[k] for k in held])
        if "\ufffd" not in text or len(held) >= 8 or i == len(token_ids) - 1:  # (8: bytes that never complete)
            pieces.append((text, held))
            held = []
    if language in NO_SPACE_LANGUAGES:
        words = pieces
    else:
        words = []
        for text, pos in pieces:
            if not words or text.startswith(" ") or text.strip() in _PUNCTUATION:
                words.append((text, list(pos)))
            else:
                words[-1] = (words[-1][0] + text, words[-1][1] + pos)
    return _merge_punctuation(words)


def _merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    out = list(words)
    for i in range(len(out) - 2, -1, -1):  # opening marks join the word after them
        text, pos = out[i]
        if text.startswith(" ") and text.strip() in _PREPENDED:  # (a lone space, too)
            out[i + 1] = (text + out[i + 1][0], pos + out[i + 1][1])
            out[i] = ("", [])
    merged: list[tuple[str, list[int]]] = []
    for text, pos in out:  # closing marks join the word before them
        if not pos:
            continue
        if merged and not merged[-1][0].endswith(" ") and text in _APPENDED:
            merged[-1] = (merged[-1][0] + text, merged[-1][1] + pos)
        else:
            merged.append((text, pos))
    return merged


def word_timestamps(token_ids: Sequence[int], starts: np.ndarray, decode: Callable[[list[int]], str],
                    language: Optional[str], offset: float = 0.0, end: Optional[float] = None) -> list[Word]:
    """The words of `token_ids` (a text's tokens) with their times: `starts` holds each token's start and, last,
    the end of text's (`token_start_times`). A word ends where the next token after it starts; times are offset
    by `offset` and capped at `end`."""
    words = []
    for text, pos in split_words(token_ids, decode, language):
        lo, hi = offset + float(starts[pos[0]]), offset + float(starts[pos[-1] + 1])
        if end is not None:
            lo, hi = min(lo, end), min(hi, end)
        words.append(Word(text, lo, hi, pos))
    return words

"""streamer/multimodal/word_timestamps.py against transformers' own Whisper alignment parts: dynamic time warping (path for
path, ties included), the median filter, and the grouping of tokens into words with punctuation joined (OpenAI's
marks); token start times follow a diagonal attention; alignment heads from generation_config or the default."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from streamer.multimodal.word_timestamps import (
    alignment_heads,
    dynamic_time_warping,
    median_filter,
    split_words,
    token_start_times,
    word_timestamps,
)

PREPENDED = "\"'\u201c\u00bf([{-"
APPENDED = "\"'.\u3002,\uff0c!\uff01?\uff1f:\uff1a\u201d)]}\u3001"


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (3, 7), (12, 40), (40, 12)])
def test_dtw_equals_transformers(shape):
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping
    rng = np.random.default_rng(sum(shape))
    for _ in range(4):
        cost = rng.standard_normal(shape)
        want = _dynamic_time_warping(cost)
        got = dynamic_time_warping(cost)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    ties = np.zeros(shape)  # (every step ties: the tie-breaking decides the whole path)
    assert all(np.array_equal(a, b) for a, b in zip(dynamic_time_warping(ties), _dynamic_time_warping(ties)))


def test_median_filter_equals_transformers():
    from transformers.models.whisper.generation_whisper import _median_filter
    x = torch.randn(4, 9, 50)
    assert torch.equal(median_filter(x), _median_filter(x, 7))
    assert torch.equal(median_filter(x[..., :3]), x[..., :3])  # (too short to filter)


def test_start_times_follow_a_diagonal():
    """Row r attends to frames near 10 r: it starts where its stretch of the diagonal begins."""
    rows, frames = 8, 80
    centers = torch.arange(rows) * 10 + 5
    scores = -((torch.arange(frames)[None] - centers[:, None]).float() ** 2) / 8
    starts = token_start_times(scores.expand(3, rows, frames).clone(), frames)
    assert len(starts) == rows and list(starts) == sorted(starts)
    assert np.allclose(starts[1:], (centers[1:].numpy() - 5) * 0.02, atol=0.06)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from streamer.tokenizer.tokenizer import Tokenizer
    from tests.tokenizer_factory import make_bytelevel_tokenizer
    return Tokenizer.from_pretrained(make_bytelevel_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", [' "Hello," she said (quietly). Don\'t - stop!', " the (quick) brown fox: done.",
                                  " 日本語のテキスト、です。", " plain words only"])
def test_words_equal_transformers(tokenizer, text):
    from transformers.models.whisper.tokenization_whisper import _merge_punctuations, _split_tokens_on_spaces

    class Shim:  # (transformers' helpers want its tokenizer's decode and eos id)
        eos_token_id = 10 ** 9

        def decode(self, ids, decode_with_timestamps=False):
            return tokenizer.decode(ids)

    ids = tokenizer.encode(text, add_special_tokens=False)
    words, tokens, indices = _split_tokens_on_spaces(Shim(), ids)
    _merge_punctuations(words, tokens, indices, PREPENDED, APPENDED)
    got = split_words(ids, tokenizer.decode, "en")
    assert [w for w, _ in got] == words and [p for _, p in got] == indices
    assert "".join(w for w, _ in got) == tokenizer.decode(ids)


def test_words_without_spaces(tokenizer):
    ids = tokenizer.encode(" 日本語", add_special_tokens=False)
    words = split_words(ids, tokenizer.decode, "ja")
    assert "".join(w for w, _ in words) == " 日本語" and len(words) >= 3  # (a word a character)


def test_word_times_and_heads(tokenizer):
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    starts = np.linspace(0.0, 1.0, len(ids) + 1)
    words = word_timestamps(ids, starts, tokenizer.decode, "en", offset=30.0, end=30.9)
    assert [w.word for w in words] == [" one", " two", " three"]
    assert words[0].start == 30.0 and words[-1].end == 30.9  # (capped at the piece's end)
    assert all(a.end == b.start for a, b in zip(words, words[1:]))
    assert alignment_heads({"alignment_heads": [[2, 1], [3, 0]]}, 4, 6) == [(2, 1), (3, 0)]
    assert alignment_heads({}, 4, 2) == [(2, 0), (2, 1), (3, 0), (3, 1)]


def test_bad_alignment_heads_are_named(tmp_path):
    import json
    import shutil

    from streamer import LLM
    from tests.whisper_checkpoints import make_whisper
    folder = make_whisper(tmp_path / "w")
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "alignment_heads": [[5, 0]]}))
    with pytest.raises(ValueError, match="alignment_heads"):
        LLM(str(folder), dtype="float32", num_kv_blocks=16)
    shutil.rmtree(folder)
    assert not Path(folder).exists()

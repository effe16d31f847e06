"""IncrementalDetokenizer: UTF-8 hold-back, prompt context, bounded cost, stop strings, special tokens."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer.engine import detokenizer as detok_mod
from streamer.engine.detokenizer import IncrementalDetokenizer
from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer
from tests.tokenizer_factory import CORPUS, make_bytelevel_tokenizer, make_sentencepiece_tokenizer

# bytelevel: its tokens' bytes and Python's UTF-8 decoder; bytelevel-stream: the same tokenizer through DecodeStream
# and the Python window (the path of sentencepiece's, and of a byte-level prompt that ends mid-character).
KINDS = ("bytelevel", "bytelevel-stream", "sentencepiece")
TEXTS = {
    "cjk": "你好，世界！今天天气很好。日本語のテキスト、한국어 문장입니다.",
    "emoji": "Emoji 😀🚀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ ok 🦀🧠",
    "accented": "Le café très chaud, über größer, señor, Tiếng Việt, Zażółć gęślą jaźń",
    "code": "def f(x: int) -> int:\n    return x ** 2  # x² → ∑\n\tprint(f'{x=} naïve 🐍')\n",
    "byte_fallback": "ไทย हिन्दी 한국어 ∑∫√ 𝔘𝔫𝔦 ☃ Ω≈",
    "mixed": "Hello 你好 😀 wörld! ∑x² = 42 — «fin» …",
}
HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Characters that tokenize into several tokens (or byte-fallback tokens) and ASCII that forms stop strings.
HARD_CHARS = sorted(set(CORPUS) | set("".join(TEXTS.values())))


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    bytelevel = make_bytelevel_tokenizer(tmp_path_factory.mktemp("bl"))
    streamed = Tokenizer.from_pretrained(bytelevel)
    streamed._token_bytes = None  # as if it were not byte-level
    out = {"bytelevel": Tokenizer.from_pretrained(bytelevel), "bytelevel-stream": streamed,
           "sentencepiece": Tokenizer.from_pretrained(make_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp")))}
    assert out["bytelevel"].token_bytes is not None and out["sentencepiece"].token_bytes is None
    return out


def relative_decode(tok: Tokenizer, prompt: list[int], gen: list[int], skip: bool = True) -> str:
    """What the output reads as after the prompt: decode(prompt + gen) minus decode(prompt)."""
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before):]


def run(tok: Tokenizer, gen: Sequence[int], prompt: Sequence[int] = (), chunks: Optional[list[int]] = None,
        **params: object) -> tuple[list[str], Optional[str], IncrementalDetokenizer]:
    """Feed gen (one id at a time, or in the given chunk sizes); flush unless a stop string matched."""
    d = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))  # type: ignore[arg-type]
    deltas: list[str] = []
    sizes = iter(chunks or [])
    i = 0
    while i < len(gen):
        n = max(1, next(sizes, 1))
        delta, stop = d.add_tokens(gen[i:i + n])
        deltas.append(delta)
        i += n
        if stop is not None:
            return deltas, stop, d
    deltas.append(d.flush())
    return deltas, d.stop_reason, d


# ---------------------------------------------------------------- UTF-8 hold-back and prompt context
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("with_prompt", [False, True])
def test_one_token_at_a_time(toks: dict[str, Tokenizer], kind: str, name: str, with_prompt: bool) -> None:
    tok = toks[kind]
    prompt = tok.encode("Prompt: say it") if with_prompt else []
    gen = tok.encode(TEXTS[name], add_special_tokens=False)
    assert any("\ufffd" in tok.decode(gen[:k]) for k in range(1, len(gen))), "no split character to hold"
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    final = relative_decode(tok, prompt, gen)
    emitted = ""
    for k in range(1, len(gen) + 1):
        delta, stop = d.add_tokens([gen[k - 1]])
        assert stop is None and "\ufffd" not in delta
        emitted += delta
        so_far = relative_decode(tok, prompt, gen[:k])
        if so_far.endswith("\ufffd"):  # an unfinished character is held (nothing else)
            assert final.startswith(emitted)
        else:
            assert emitted == so_far
    assert d.flush() == ""
    assert emitted == d.text == final
    if not with_prompt:
        assert emitted == tok.decode(gen)


def test_sentencepiece_leading_space_follows_prompt(toks: dict[str, Tokenizer]) -> None:
    tok = toks["sentencepiece"]
    gen = tok.encode("Hello world", add_special_tokens=False)
    assert "".join(run(tok, gen, prompt=tok.encode("Say:"))[0]) == " Hello world"
    assert "".join(run(tok, gen, prompt=[tok.bos_token_id])[0]) == "Hello world"  # BOS alone: start of text
    assert "".join(run(tok, gen)[0]) == "Hello world"
    # Special tokens at the end of the prompt are skipped, so the context is the text before them.
    prompt = tok.encode("Say:") + [tok.eos_token_id]
    assert "".join(run(tok, gen, prompt=prompt)[0]) == relative_decode(tok, prompt, gen) == " Hello world"
    assert "".join(run(tok, gen, prompt=prompt, skip_special_tokens=False)[0]) == relative_decode(
        tok, prompt, gen, skip=False) == " Hello world"


@pytest.mark.parametrize("kind", KINDS)
@HYP
@given(text=st.text(st.sampled_from(HARD_CHARS) | st.characters(exclude_categories=("Cs",)), max_size=40),
       chunks=st.lists(st.integers(1, 6), max_size=40), with_prompt=st.booleans())
def test_random_text_random_chunks(toks: dict[str, Tokenizer], kind: str, text: str, chunks: list[int],
                                   with_prompt: bool) -> None:
    tok = toks[kind]
    prompt = tok.encode("Once upon a time,") if with_prompt else []
    gen = tok.encode(text, add_special_tokens=False)
    deltas, stop, d = run(tok, gen, prompt, chunks)
    assert stop is None
    assert "".join(deltas) == d.text == relative_decode(tok, prompt, gen)
    assert not any("\ufffd" in x for x in deltas if "\ufffd" not in text)


@pytest.mark.parametrize("kind", KINDS)
@HYP
@given(ids=st.lists(st.integers(0, 520), max_size=40), chunks=st.lists(st.integers(1, 4), max_size=40),
       skip=st.booleans())
def test_random_ids(toks: dict[str, Tokenizer], kind: str, ids: list[int], chunks: list[int], skip: bool) -> None:
    """Arbitrary ids: special, out-of-vocab, invalid UTF-8. Byte-level decoding is local, so streaming stays
    exact; sentencepiece's ByteFallback turns a whole run of byte tokens into U+FFFDs when one byte is bad,
    which no stream can foresee, so there only valid output is compared."""
    tok = toks[kind]
    deltas, _, _ = run(tok, ids, chunks=chunks, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    if kind.startswith("bytelevel") or "\ufffd" not in full:
        assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in x for x in deltas)


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """The ids of the 256 single-byte tokens (GPT-2's printable byte alphabet for byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    ids = [tok.token_to_id(chars[b]) for b in range(256)]
    assert None not in ids
    return ids  # type: ignore[return-value]


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel-stream"])
@HYP
@given(units=st.lists(st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=3).map(bytes)
                      | st.characters(exclude_categories=("Cs",)).map(str.encode), max_size=40),
       chunks=st.lists(st.integers(1, 3), max_size=60))
def test_random_bytes_bytelevel(toks: dict[str, Tokenizer], kind: str, units: list[bytes], chunks: list[int]) -> None:
    """One token per byte: runs of invalid UTF-8 between valid characters. Still exact, never stuck."""
    tok = toks[kind]
    pool = byte_token_ids(tok)
    ids = [pool[b] for b in b"".join(units)]
    deltas, _, _ = run(tok, ids, chunks=chunks)
    assert "".join(deltas) == tok.decode(ids)
    assert sum(len(x) for x in deltas[:-1]) >= len(tok.decode(ids[:-2 * detok_mod.MAX_UNREAD_TOKENS]))


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel-stream"])
@pytest.mark.parametrize("run_length", range(2 * detok_mod.MAX_UNREAD_TOKENS + 2))
def test_valid_character_after_invalid_run(toks: dict[str, Tokenizer], kind: str, run_length: int) -> None:
    """Giving up on an invalid run must not cut into the valid character that follows it."""
    tok = toks[kind]
    pool = byte_token_ids(tok)
    ids = [pool[b] for b in b"\xa9" * run_length + "好".encode() + b"\xbf" * run_length + "😀!".encode()]
    deltas, _, _ = run(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "\ufffd" * run_length + "好" + "\ufffd" * run_length + "😀!"


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_bytes_are_emitted_eventually(toks: dict[str, Tokenizer], kind: str) -> None:
    tok = toks[kind]
    lone = tok.token_to_id("©" if kind.startswith("bytelevel") else "<0xA9>")  # the continuation byte 0xA9 alone
    assert tok.decode([lone]) == "\ufffd"
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    emitted = "".join(d.add_tokens([lone])[0] for _ in range(100))
    assert emitted.count("\ufffd") >= 100 - detok_mod.MAX_UNREAD_TOKENS  # not held until the end
    assert emitted + d.flush() == tok.decode([lone] * 100)


# ---------------------------------------------------------------- cost per token
@pytest.mark.parametrize("kind", KINDS)
def test_decode_window_stays_small(toks: dict[str, Tokenizer], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = toks[kind]
    longest = [0]
    real_decode = tok.decode

    def spy(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        longest[0] = max(longest[0], len(ids))
        return real_decode(ids, skip_special_tokens)

    gen = tok.encode(CORPUS, add_special_tokens=False) * 3
    gen += [tok.vocab_size + 5] * 50  # out-of-vocab ids decode to nothing: must not grow the window either
    assert len(gen) > 3000
    prompt = tok.encode("Prompt: " * 100)
    expected = relative_decode(tok, prompt, gen)
    monkeypatch.setattr(tok, "decode", spy)
    deltas, _, _ = run(tok, gen, prompt=prompt)
    assert "".join(deltas) == expected
    assert longest[0] <= max(detok_mod.PROMPT_CONTEXT_TOKENS, detok_mod.MAX_UNREAD_TOKENS) * 2


# ---------------------------------------------------------------- special tokens
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(toks: dict[str, Tokenizer], kind: str, skip: bool) -> None:
    tok = toks[kind]
    gen = ([tok.bos_token_id] + tok.encode("Hi 你好", add_special_tokens=False) + [tok.eos_token_id]
           + tok.encode(" again😀", add_special_tokens=False) + [tok.eos_token_id])
    prompt = tok.encode("Q:")
    deltas, _, _ = run(tok, gen, prompt=prompt, skip_special_tokens=skip)
    text = "".join(deltas)
    assert text == relative_decode(tok, prompt, gen, skip=skip)
    assert (tok.eos_token in text) is not skip and (tok.bos_token in text) is not skip
    assert text.replace(tok.eos_token, "").replace(tok.bos_token, "").strip() == "Hi 你好 again😀"


# ---------------------------------------------------------------- stop strings
@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_spanning_tokens_is_held_back(toks: dict[str, Tokenizer], kind: str) -> None:
    tok = toks[kind]
    gen = tok.encode("The answer is 42. STOP here, not there", add_special_tokens=False)
    assert len(tok.encode(" STOP", add_special_tokens=False)) > 1
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    emitted = ""
    for t in gen:
        delta, stop = d.add_tokens([t])
        emitted += delta
        assert "S" not in emitted and "here" not in emitted
        if stop:
            break
    assert stop == "STOP" and emitted == d.text == "The answer is 42. "
    with pytest.raises(RuntimeError):
        d.add_tokens([gen[0]])
    assert d.flush() == ""


@pytest.mark.parametrize("kind", KINDS)
def test_include_stop_str_in_output(toks: dict[str, Tokenizer], kind: str) -> None:
    tok = toks[kind]
    gen = tok.encode("Say 你好世界 and go", add_special_tokens=False)
    deltas, stop, d = run(tok, gen, stop=["好世"], include_stop_str_in_output=True)
    assert stop == "好世" and "".join(deltas) == d.text == "Say 你好世"
    deltas, stop, _ = run(tok, gen, stop=["好世"])
    assert stop == "好世" and "".join(deltas) == "Say 你"


def _stop_after_min_tokens(tok: Tokenizer, gen: list[int], stop: str, min_tokens: int) -> tuple[str, bool]:
    """vLLM's rule, from whole decodes: the first stop string ending in the text of a token past the first
    min_tokens (it may begin earlier) ends the output; its text is cut there."""
    before = ""
    for i in range(1, len(gen) + 1):
        text = relative_decode(tok, [], gen[:i])
        if i > min_tokens:
            at = text.find(stop, max(0, len(before) - len(stop) + 1))
            if at >= 0:
                return text[:at], True
        before = text
    return before, False


@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings_wait_for_min_tokens(toks: dict[str, Tokenizer], kind: str) -> None:
    tok = toks[kind]
    gen = tok.encode("ab cd ab cd xab efg ab", add_special_tokens=False)
    outcomes = set()
    for min_tokens in range(len(gen) + 1):
        want, stopped = _stop_after_min_tokens(tok, gen, "ab", min_tokens)
        for chunks in (None, [3] * len(gen)):
            deltas, stop, _ = run(tok, gen, chunks=chunks, stop=["ab"], min_tokens=min_tokens, max_tokens=len(gen))
            if chunks is None or min_tokens == 0:
                assert ("".join(deltas), stop) == (want, "ab" if stopped else None), (min_tokens, chunks)
        outcomes.add(want)
    assert len(outcomes) >= 3  # (the stop moves on as min_tokens grows: the check can fail)


def test_hold_back_and_flush(toks: dict[str, Tokenizer]) -> None:
    tok = toks["bytelevel"]
    gen = tok.encode("abc ST", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP", "xyz"]))
    assert d.add_tokens(gen) == ("abc ", None)
    assert d.text == "abc "
    assert d.flush() == "ST" and d.stop_reason is None and d.text == "abc ST"
    # include_stop_str_in_output: the stop string is emitted anyway, so nothing needs holding back.
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert d.add_tokens(gen) == ("abc ST", None)


def test_multiple_stops_first_completed_wins(toks: dict[str, Tokenizer]) -> None:
    tok = toks["bytelevel"]
    gen = tok.encode("hello world, xyz", add_special_tokens=False)
    assert run(tok, gen, stop=["world", "lo w"])[1:2] == ("lo w",)
    assert "".join(run(tok, gen, stop=["world", "lo w"])[0]) == "hel"
    assert "".join(run(tok, gen, stop=[", xyz", "xyz"], include_stop_str_in_output=True)[0]) == "hello world, xyz"
    assert run(tok, gen, stop=["xyz", ", xyz"])[1] == ", xyz"  # same end: the longer one began earlier
    assert run(tok, gen, stop=["nope", "o"])[1] == "o"


@pytest.mark.parametrize("chunked", [False, True])
def test_first_completed_stop_wins_within_one_chunk(toks: dict[str, Tokenizer], chunked: bool) -> None:
    tok = toks["bytelevel"]
    gen = tok.encode("hello world!", add_special_tokens=False)
    deltas, stop, _ = run(tok, gen, chunks=[len(gen)] if chunked else None, stop=["hello world", "lo w"])
    assert stop == "lo w" and "".join(deltas) == "hel"


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel-stream"])
def test_stop_completed_before_an_unfinished_character(toks: dict[str, Tokenizer], kind: str) -> None:
    """A stop string followed, in the same token, by an unfinished character is found: at once on the byte path
    (the token's complete characters are out), else when flushed (DecodeStream holds the token's whole text)."""
    tok = toks[kind]
    partial = tok.token_to_id("ĠðŁ")  # " " + the first two bytes of an emoji
    assert partial is not None
    gen = tok.encode("ok x", add_special_tokens=False) + [partial]
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["x "]))
    if kind == "bytelevel":
        assert d.add_tokens(gen) == ("ok ", "x ")
    else:
        assert d.add_tokens(gen) == ("ok ", None)
        assert d.flush() == ""
    assert d.stop_reason == "x " and d.text == "ok "


STOP_ALPHABET = "ab 好😀é\n"


def first_stop(text: str, stops: list[str]) -> Optional[tuple[int, int, str]]:
    """Reference: the stop string whose first occurrence ends first (ties: the longer); (start, end, stop)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    end, start, stop = min(found, key=lambda f: (f[0], f[1]))
    return start, end, stop


@pytest.mark.parametrize("kind", KINDS)
@HYP
@given(head=st.text(STOP_ALPHABET, max_size=20), tail=st.text(STOP_ALPHABET, max_size=20),
       stops=st.lists(st.text(STOP_ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3),
       which=st.integers(0, 2), include=st.booleans(), chunks=st.lists(st.integers(1, 5), max_size=30))
def test_stop_strings_property(toks: dict[str, Tokenizer], kind: str, head: str, tail: str, stops: list[str],
                               which: int, include: bool, chunks: list[int]) -> None:
    tok = toks[kind]
    gen = tok.encode(head + stops[which % len(stops)] + tail, add_special_tokens=False)
    full = tok.decode(gen)  # what the detokenizer sees (sentencepiece drops a leading space)
    deltas, stop, d = run(tok, gen, chunks=chunks, stop=stops, include_stop_str_in_output=include)
    expected = first_stop(full, stops)
    if expected is None:
        assert stop is None and "".join(deltas) == full
    else:
        start, end, want = expected
        assert stop == want and d.stop_reason == want
        assert "".join(deltas) == d.text == full[:end if include else start]
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("kind", KINDS)
@HYP
@given(text=st.text(STOP_ALPHABET, max_size=30), stop=st.text(STOP_ALPHABET, min_size=2, max_size=5))
def test_never_emits_a_stop_prefix_that_completes(toks: dict[str, Tokenizer], kind: str, text: str,
                                                  stop: str) -> None:
    """Step by step, the emitted text is always a prefix of the final output (nothing is taken back)."""
    tok = toks[kind]
    gen = tok.encode(text + stop, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    seen: list[str] = []
    for t in gen:
        delta, matched = d.add_tokens([t])
        seen.append(d.text)
        if matched:
            break
    final = d.text + d.flush()
    assert all(final.startswith(s) for s in seen)
    assert stop not in final


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel-stream"])
@pytest.mark.parametrize("after", ["a", "好", "\xa9"])
def test_prompt_ending_mid_character(toks: dict[str, Tokenizer], kind: str, after: str) -> None:
    """A prompt whose last token is half a character: the output reads as decode(prompt + output) minus
    decode(prompt), whether it completes the character or not (the byte path leaves such a prompt to the
    DecodeStream path: its U+FFFD belongs to the prompt)."""
    tok = toks[kind]
    pool = byte_token_ids(tok)
    prompt = tok.encode("say ", add_special_tokens=False) + [pool[b] for b in "好".encode()[:2]]
    tail = "好".encode()[2:] if after == "好" else after.encode()
    gen = [pool[b] for b in tail] + tok.encode(" ok", add_special_tokens=False)
    deltas, _, _ = run(tok, gen, prompt=prompt)
    before, full = tok.decode(prompt), tok.decode(prompt + gen)
    assert before.endswith("\ufffd")
    want = "好 ok" if after == "好" else full[len(before):]  # (the prompt's U+FFFD becomes the character)
    assert full.startswith(before[:-1]) and "".join(deltas) == want


def test_byte_table_only_where_decoding_is_per_token(tmp_path) -> None:
    """token_bytes exists only for a decoder that is exactly ByteLevel: one that also strips or replaces text is
    left to DecodeStream, and the table of a byte-level tokenizer reads back as its own decoding of every id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders
    path = make_bytelevel_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(path)
    table = tok.token_bytes
    assert table is not None and len(table) >= tok.vocab_size
    assert all(table[i].decode("utf-8", "replace") == tok.decode([i], skip_special_tokens=False)
               for i in range(tok.vocab_size))
    backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
    backend.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    assert Tokenizer(backend).token_bytes is None


@pytest.mark.parametrize("text", ["\ufffd\ufffd\u00ed", "\ufffd\ufffd\ufffd\u00ed\u00ed", "a\ufffd\ufffd\u00e9\u4e2d"])
def test_literal_replacement_characters_then_more(toks: dict[str, Tokenizer], text: str) -> None:
    """Text that itself holds U+FFFD (hypothesis found it): the held tokens pass MAX_UNREAD_TOKENS, and the context
    kept after the emission must not start inside a character's byte-fallback tokens (its text would read as
    extra U+FFFD, and the next character came out as two of them)."""
    tok = toks["sentencepiece"]
    gen = tok.encode(text, add_special_tokens=False)
    deltas, stop, d = run(tok, gen)
    assert stop is None
    assert "".join(deltas) == d.text == relative_decode(tok, [], gen) == text

"""Incremental detokenization with UTF-8 hold-back and stop strings.

Byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's, ...) decode a token by its bytes alone: for them a token
is one table lookup (`Tokenizer.token_bytes`) fed to Python's incremental UTF-8 decoder, which holds back an
unfinished character and writes U+FFFD for bad bytes exactly as the tokenizer's lossy decoding does (2.3-2.5x
less a token than DecodeStream, split characters included: bench/detokenizer.py). For other tokenizers (sentencepiece's),
the common path is `tokenizers`' own `DecodeStream` (in Rust: vLLM's prefix/read-offset scheme, decoding a window
of the last emitted token(s) plus the new one, and emitting what the new one added; ~0.7 us a token). It holds
back a window whose text ends in U+FFFD (an unfinished multi-byte character: split byte-level tokens or
<0xNN> byte-fallback tokens) by returning None. Two cases it does not handle are handled here, in Python, on a
window of our own: bytes that never complete (after MAX_UNREAD_TOKENS held tokens we emit what is settled,
invalid bytes as U+FFFD, so the window and the cost per token stay bounded), and a prompt context that ends
mid-character (its text is then not a prefix of the next window's, which DecodeStream rejects). After either,
the stream restarts from the tokens just emitted. Decoding in context keeps sentencepiece's leading spaces right.
"""
from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Optional

from tokenizers.decoders import DecodeStream

from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded in front of the output, so that the first generated word gets its leading space right.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 tokens. Past this many held tokens without a complete character the
# bytes are invalid (emit them as U+FFFD) or the window just decodes to nothing (out-of-vocab ids): stop
# waiting, so that the window, and the cost per token, stay bounded.
MAX_UNREAD_TOKENS = 8
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas; finds stop strings on the way."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend  # (DecodeStream.step takes it with every token)
        self._skip_special = params.skip_special_tokens
        self._dropped = tokenizer.all_special_ids if params.skip_special_tokens else frozenset()
        # Decoding state: _context = the last emitted ids (at first the prompt's tail), _context_text their text
        # (None until needed), _unread = ids fed since; _stream decodes them (None: the Python path does).
        self._context: list[int] = []
        self._context_text: Optional[str] = None
        self._unread: list[int] = []
        self._stream: Optional[DecodeStream] = None
        context = self._prompt_context(prompt_token_ids)
        # The byte path (None: DecodeStream and the Python window): the decoder is primed with the prompt's tail, and
        # left for the other path when that ends mid-character (its U+FFFD is the prompt's, not the output's).
        self._bytes = tokenizer.token_bytes
        self._utf8: Optional[codecs.IncrementalDecoder] = None
        if self._bytes is not None:
            utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            utf8.decode(b"".join(self._token_bytes(t) for t in context))
            if not utf8.getstate()[0]:
                self._utf8 = utf8
        if self._utf8 is None:
            self._restart(context)
        # Stop-string state.
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._recent = ""   # last _max_stop - 1 chars of decoded text: where a stop string may have begun
        self._pending = ""  # decoded text withheld because it may be the start of a stop string
        self._pieces: list[str] = []
        self._stop_reason: Optional[str] = None
        self._finished = False
        # As vLLM (its PR 22014): a stop string counts only where it ends in the text of a token after the first
        # min_tokens (one may begin before). The count includes tokens whose text is dropped (special tokens).
        self._min_tokens = params.min_tokens
        self._count = 0

    # ------------------------------------------------------------------ public API
    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Append newly generated token ids. Returns (text that is now safe to emit, matched stop string or None).
        After a stop string matched the request is over: the text after it is dropped and further calls fail."""
        if self._finished:
            raise RuntimeError("add_tokens() after the sequence finished (stop string matched or flushed)")
        self._count += len(token_ids)
        new = "".join(self._step(t) for t in token_ids if t not in self._dropped)
        return self._emit(self._scan_stops(new, final=False)), self._stop_reason

    def add_token(self, token_id: int) -> tuple[str, Optional[str]]:
        """`add_tokens([token_id])` without the list (the engine's call, once per sequence per step)."""
        if self._finished:
            raise RuntimeError("add_tokens() after the sequence finished (stop string matched or flushed)")
        self._count += 1
        if token_id in self._dropped:
            new = ""
        elif self._utf8 is not None:  # (_step's byte path, inlined: this runs for every token of every sequence)
            table = self._bytes
            new = self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")  # type: ignore[arg-type]
        else:
            new = self._step(token_id)
        if self._stops:
            new = self._scan_stops(new, final=False)
        if new:
            self._pieces.append(new)
        return new, self._stop_reason

    def flush(self) -> str:
        """The request finished for another reason (length, eos, stop token, abort): emit what is held back,
        including an unfinished character (as U+FFFD). A stop string completed by this text still truncates it:
        check `stop_reason` afterwards. Safe to call more than once."""
        if self._finished:
            return ""
        if self._utf8 is not None:
            new = self._utf8.decode(b"", final=True)
        else:
            new = _delta(self._prefix_text(), self._decode(self._context + self._unread)) if self._unread else ""
        out = self._scan_stops(new, final=True)
        self._finished = True
        return self._emit(out)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stop_reason(self) -> Optional[str]:
        """The stop string that ended the sequence, if any."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        return self._finished

    # ------------------------------------------------------------------ decoding
    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        tail = [t for t in prompt_token_ids[-8 * PROMPT_CONTEXT_TOKENS:] if t not in self._dropped]
        return tail[-PROMPT_CONTEXT_TOKENS:]

    def _tail(self, context: list[int]) -> tuple[list[int], str]:
        """The last PROMPT_CONTEXT_TOKENS ids of `context` and their text, reaching back further where the cut
        splits a character: the text must end the context's own (a tail starting inside a character's bytes reads
        as extra U+FFFD, and the next deltas would be measured against it)."""
        tail = context[-PROMPT_CONTEXT_TOKENS:]
        text = self._decode(tail)
        if len(tail) == len(context) or not text.startswith(_REPLACEMENT):
            return tail, text
        whole = self._decode(context)
        for start in range(len(context) - PROMPT_CONTEXT_TOKENS, max(len(context) - 4 * PROMPT_CONTEXT_TOKENS, 0) - 1,
                           -1):
            tail = context[start:]
            text = self._decode(tail)
            if whole.endswith(text):
                break
        return tail, text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _restart(self, context: list[int]) -> None:
        """Continue after the emitted ids `context`: through a DecodeStream, unless their text ends mid-character
        (a DecodeStream would then re-emit it), in which case the Python path runs until the next emission."""
        self._context, self._context_text = self._tail(context)
        self._unread = []
        self._stream = (None if self._context_text.endswith(_REPLACEMENT) else
                        DecodeStream(ids=list(self._context), skip_special_tokens=self._skip_special))

    def _token_bytes(self, token_id: int) -> bytes:
        table = self._bytes
        return table[token_id] if 0 <= token_id < len(table) else b""  # type: ignore[arg-type]

    def _step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is unfinished)."""
        if self._utf8 is not None:
            return self._utf8.decode(self._token_bytes(token_id))
        self._unread.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)
            except Exception:  # its prefix does not prefix the new text: let the Python path sort it out
                self._stream = None
            else:
                if text is not None:
                    self._context, self._context_text, self._unread = self._unread, None, []
                    return text
                if len(self._unread) < MAX_UNREAD_TOKENS:
                    return ""
        return self._python_step()

    def _python_step(self) -> str:
        """The held tokens in Python: emit them once they decode to a complete character; past MAX_UNREAD_TOKENS,
        emit up to the last token boundary that later tokens no longer change (invalid bytes as U+FFFD)."""
        window = self._context + self._unread
        prefix, text = self._prefix_text(), self._decode(window)
        unfinished = text.endswith(_REPLACEMENT)
        if not unfinished and (len(text) > len(prefix) or len(self._unread) >= MAX_UNREAD_TOKENS):
            self._restart(window)
            return _delta(prefix, text)
        if len(self._unread) < MAX_UNREAD_TOKENS:
            return ""
        cut = self._stable_cut(window, prefix, text)
        if cut is None:
            return ""
        held = window[cut:]
        self._restart(window[:cut])
        return _delta(prefix, self._decode(window[:cut])) + "".join(self._step(t) for t in held)

    def _prefix_text(self) -> str:
        if self._context_text is None:
            self._context_text = self._decode(self._context)
        return self._context_text

    def _stable_cut(self, window: list[int], prefix: str, text: str) -> Optional[int]:
        """The last token boundary whose decode is a strict prefix of the window's text (a cut inside the trailing
        unfinished character reads as long) and adds to the context's text."""
        for cut in range(len(window) - 1, len(self._context), -1):
            head = self._decode(window[:cut])
            if len(prefix) < len(head) < len(text) and text.startswith(head):
                return cut
        return None

    # ------------------------------------------------------------------ stop strings
    def _scan_stops(self, new: str, final: bool) -> str:
        """Return the part of pending + new text that may be emitted now; keep back a possible stop prefix."""
        if not self._stops:
            return new
        region = self._recent + new
        base = len(self._recent) - len(self._pending)  # region[base:] == pending + new
        match = self._first_stop(region, len(self._recent)) if self._count > self._min_tokens else None
        if match is not None:
            start, stop = match
            self._stop_reason, self._finished = stop, True
            return region[base:max(base, start + len(stop) if self._include_stop else start)]
        buffered = region[base:]
        keep = 0 if final or self._include_stop else self._stop_prefix_len(buffered)
        self._pending = buffered[len(buffered) - keep:]
        self._recent = region[max(0, len(region) - (self._max_stop - 1)):]
        return buffered[:len(buffered) - keep]

    def _first_stop(self, region: str, new_from: int) -> Optional[tuple[int, str]]:
        """The stop string that completes first in region (it must end past new_from); at equal ends the
        longer one (it started earlier)."""
        best: Optional[tuple[int, int, str]] = None
        for stop in self._stops:
            start = region.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key[:2] < best[:2] else best
        return (best[1], best[2]) if best is not None else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[len(text) - n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def _emit(self, out: str) -> str:
        if out:
            self._pieces.append(out)
        return out


def _delta(prefix: str, text: str) -> str:
    """What `text` adds to `prefix`; if the prefix ended mid-character, what differs from it."""
    if text.startswith(prefix):
        return text[len(prefix):]
    common = 0
    while common < min(len(text), len(prefix)) and text[common] == prefix[common]:
        common += 1
    return text[common:]

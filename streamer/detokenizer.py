"""Incremental detokenization with UTF-8 hold-back and stop strings.

Decoding uses vLLM's prefix/read-offset scheme: each step decodes only a short window of ids
(a few already-emitted "prefix" tokens + the unread ones) and emits what the unread ones added to the
prefix's text. Decoding in context keeps sentencepiece's leading spaces right, and the window keeps
the cost per token independent of the output length. A window whose text ends in U+FFFD is an
unfinished multi-byte character (split byte-level tokens or <0xNN> byte-fallback tokens): hold it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from streamer.sampling_params import SamplingParams
from streamer.tokenizer import Tokenizer

# Prompt tokens decoded in front of the output, so that the first generated word gets its leading space right.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 tokens. Past this many unread tokens without a complete character the
# bytes are invalid (emit them as U+FFFD) or the window just decodes to nothing (out-of-vocab ids): stop
# waiting, so that the window, and the cost per token, stay bounded.
MAX_UNREAD_TOKENS = 8
# The emitted prefix grows up to this many ids before it is cut back to the newest ones: a step then decodes
# once (the window) instead of twice (the window, then the new prefix) most of the time.
MAX_PREFIX_TOKENS = MAX_UNREAD_TOKENS
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas; finds stop strings on the way."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._dropped = tokenizer.all_special_ids if params.skip_special_tokens else frozenset()
        # Window state: _ids[:_read] were emitted already, _ids[_read:] not yet; _prefix_text = decode(_ids[:_read]).
        self._ids = self._prompt_context(prompt_token_ids)
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        # Stop-string state.
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._recent = ""   # last _max_stop - 1 chars of decoded text: where a stop string may have begun
        self._pending = ""  # decoded text withheld because it may be the start of a stop string
        self._pieces: list[str] = []
        self._stop_reason: Optional[str] = None
        self._finished = False

    # ------------------------------------------------------------------ public API
    def add_tokens(self, token_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Append newly generated token ids. Returns (text that is now safe to emit, matched stop string or None).
        After a stop string matched the request is over: the text after it is dropped and further calls fail."""
        if self._finished:
            raise RuntimeError("add_tokens() after the sequence finished (stop string matched or flushed)")
        new = "".join(self._step(t) for t in token_ids if t not in self._dropped)
        return self._emit(self._scan_stops(new, final=False)), self._stop_reason

    def flush(self) -> str:
        """The request finished for another reason (length, eos, stop token, abort): emit what is held back,
        including an unfinished character (as U+FFFD). A stop string completed by this text still truncates it:
        check `stop_reason` afterwards. Safe to call more than once."""
        if self._finished:
            return ""
        new = self._advance(self._decode(self._ids)) if self._read < len(self._ids) else ""
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

    # ------------------------------------------------------------------ decoding window
    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        tail = [t for t in prompt_token_ids[-8 * PROMPT_CONTEXT_TOKENS:] if t not in self._dropped]
        return tail[-PROMPT_CONTEXT_TOKENS:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        unfinished = text.endswith(_REPLACEMENT)
        if not unfinished and len(text) > len(self._prefix_text):
            return self._advance(text)
        if len(self._ids) - self._read < MAX_UNREAD_TOKENS:
            return ""
        return self._advance_to_cut(text) if unfinished else self._advance(text)

    def _advance_to_cut(self, text: str) -> str:
        """Many unread tokens and still no complete character: the bytes are invalid (or stay split).
        Emit up to the last token boundary whose text the later tokens no longer change: its decode is a
        strict prefix of the window's (a cut inside the trailing unfinished character reads as long)."""
        for cut in range(len(self._ids) - 1, self._read, -1):
            head = self._decode(self._ids[:cut])
            if len(self._prefix_text) < len(head) < len(text) and text.startswith(head):
                return self._advance(head, cut)
        return ""

    def _advance(self, text: str, upto: Optional[int] = None) -> str:
        """Emit `text` = decode(_ids[:upto]) past the prefix; _ids[_read:upto] become the next prefix."""
        if text.startswith(self._prefix_text):
            delta = text[len(self._prefix_text):]
        else:  # only if the prompt context ended mid-character: emit what differs
            common = 0
            while common < min(len(text), len(self._prefix_text)) and text[common] == self._prefix_text[common]:
                common += 1
            delta = text[common:]
        if upto is None and len(self._ids) <= MAX_PREFIX_TOKENS:
            # The whole window is emitted: it becomes the prefix as it is, its text is `text` (no decode).
            self._read, self._prefix_text = len(self._ids), text
            return delta
        upto = len(self._ids) if upto is None else upto
        del self._ids[:self._read]
        self._read = upto - self._read
        self._prefix_text = self._decode(self._ids[:self._read])
        return delta

    # ------------------------------------------------------------------ stop strings
    def _scan_stops(self, new: str, final: bool) -> str:
        """Return the part of pending + new text that may be emitted now; keep back a possible stop prefix."""
        if not self._stops:
            return new
        region = self._recent + new
        base = len(self._recent) - len(self._pending)  # region[base:] == pending + new
        match = self._first_stop(region, len(self._recent))
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

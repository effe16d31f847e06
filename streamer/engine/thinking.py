"""Reasoning models' think tags, and the thinking token budget (vLLM's `thinking_token_budget`).

The tags are the reasoning parsers' (`reasoning_parser` / `--reasoning-parser`): the engine holds a request with
a budget to at most that many tokens of reasoning, then makes it write the closing tag (one forced token a step,
masked like any other sampling rule, so logprobs and penalties see it as the model's own), after which the model
answers as usual. The server's parsers (server/reasoning.py) read the same tags out of the text.

Where the output starts is read from the prompt's token ids, as vLLM does: inside the reasoning when the prompt's
last tag opens it (DeepSeek-R1's and Qwen3-thinking's templates end the prompt with `<think>`), closed when it
closes it (Qwen3's `enable_thinking: false` renders `<think></think>`), and otherwise before it: the model may
open it itself (counted from there), except under deepseek_r1, whose output starts inside even without a tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

START, END = "<think>", "</think>"
# openai_gptoss (gpt-oss's channels) is read by server/harmony.py, not by think tags: it has no budget here.
PARSERS = ("deepseek_r1", "qwen3", "glm45", "deepseek_v3", "seed_oss", "mistral", "openai_gptoss")
# Parsers whose reasoning is delimited by other tags than <think> ... </think>
TAGS = {"seed_oss": ("<seed:think>", "</seed:think>"), "mistral": ("[THINK]", "[/THINK]")}
_NO_TAGS = frozenset({"openai_gptoss"})
_STARTS_INSIDE = frozenset({"deepseek_r1"})  # the output is reasoning until </think>, opened or not


@dataclass(frozen=True)
class ThinkTags:
    """A reasoning parser's tags as the vocabulary spells them (token ids, as the model writes them)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    starts_inside: bool  # no tag in the prompt: the output starts inside the reasoning

    @classmethod
    def of(cls, parser: str, encode: Callable[[str], list[int]]) -> Optional["ThinkTags"]:
        """None for a parser without think tags (gpt-oss's channels)."""
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {parser!r}")
        if parser in _NO_TAGS:
            return None
        start, end = TAGS.get(parser, (START, END))
        return cls(tuple(encode(start)), tuple(encode(end)), parser in _STARTS_INSIDE)

    def budget(self, prompt: Sequence[int], tokens: Optional[int]) -> "ThinkingBudget":
        """A sequence's budget of `tokens` thinking tokens (None: counted only), where its prompt leaves it."""
        last_start, last_end = _rfind(prompt, self.start), _rfind(prompt, self.end)
        if last_start > last_end:
            phase = INSIDE
        elif last_end > last_start:
            phase = CLOSED
        else:
            phase = INSIDE if self.starts_inside else BEFORE
        return ThinkingBudget(self, tokens, phase)


BEFORE, INSIDE, CLOSED = 0, 1, 2


class ThinkingBudget:
    """One sequence's reasoning: where it is, how many tokens it has taken (`used`, the tags left out) and what
    is left of its budget (None: no budget, only counted). `feed` after each output token; `forced` is the token
    the next step must write (the closing tag's next token once the budget is spent), or None. Once the reasoning
    closes it is done with: later tags are not counted."""

    __slots__ = ("tags", "left", "phase", "used")

    def __init__(self, tags: ThinkTags, left: Optional[int], phase: int) -> None:
        self.tags, self.left, self.phase, self.used = tags, left, phase, 0

    @property
    def active(self) -> bool:
        """A token of it may still be forced."""
        return self.left is not None and self.phase != CLOSED

    @property
    def pins_next(self) -> bool:
        """Whether the token after the one being sampled now may be forced, depending on that one: then the next
        step must wait for it (no async scheduling, no drafts). Otherwise it cannot be, whatever comes: the
        budget has two tokens or more left (one before the reasoning opens)."""
        if not self.active:
            return False
        return self.left <= (1 if self.phase == INSIDE else 0)  # type: ignore[operator]

    def feed(self, output: Sequence[int]) -> None:
        if self.phase == BEFORE:
            if _ends_with(output, self.tags.start):
                self.phase = INSIDE
        elif self.phase == INSIDE:
            if _ends_with(output, self.tags.end):
                self.phase = CLOSED
                self.used -= len(self.tags.end) - 1  # (the tag's first tokens were counted as they came)
            else:
                self.used += 1
                if self.left is not None:
                    self.left -= 1

    def forced(self, output: Sequence[int]) -> Optional[int]:
        if self.phase != INSIDE or self.left is None or self.left > 0:
            return None
        end = self.tags.end
        # The closing tag may be under way (the model began it, or earlier steps forced its first tokens).
        done = next(k for k in range(len(end) - 1, -1, -1) if k == 0 or _ends_with(output, end[:k]))
        return end[done]


def _ends_with(seq: Sequence[int], tail: Sequence[int]) -> bool:
    n = len(tail)
    return 0 < n <= len(seq) and tuple(seq[len(seq) - n:]) == tuple(tail)


def _rfind(seq: Sequence[int], sub: Sequence[int]) -> int:
    """The start of sub's last occurrence in seq, -1 if none."""
    n = len(sub)
    if not n:
        return -1
    first = sub[0]
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == first and tuple(seq[i:i + n]) == tuple(sub):
            return i
    return -1

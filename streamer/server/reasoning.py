"""Reasoning in chat output (`streamer serve --reasoning-parser deepseek_r1|qwen3`), as vLLM's parsers of those names
read it: the text between `<think>` and `</think>` is `message.reasoning_content` (streamed: `delta.reasoning_content`),
the rest stays `content`.

- deepseek_r1: the chat template often ends the prompt with `<think>`, so the output may start inside the reasoning
  without an opening tag: everything up to `</think>` is reasoning (a leading `<think>` is dropped). An output that
  never closes it (cut short, or a model that does not reason) is all reasoning.
- qwen3: reasoning only when the output starts with `<think>` (or the prompt opened it, as the Qwen3 thinking-2507
  templates do); `chat_template_kwargs: {"enable_thinking": false}` turns it off.
- glm45 (GLM-4.5 / 4.6): as qwen3.
- deepseek_v3 (DeepSeek-V3.1 / V3.2, which think only when asked): as deepseek_r1 when
  `chat_template_kwargs` has `thinking` (or `enable_thinking`) true, else no reasoning at all.
- seed_oss: as qwen3, with `<seed:think>` ... `</seed:think>`.
- mistral (Magistral): as qwen3, with `[THINK]` ... `[/THINK]`, special tokens of Mistral's vocabularies (the text
  keeps special tokens under this parser, as under the mistral tool-call parser).
- openai_gptoss: gpt-oss's harmony channels (server/harmony.py).

Which of the two the prompt left open is read from the rendered prompt: its last `<think>`/`</think>` tag (vLLM
reads the same from the prompt's token ids). A prompt that closed the reasoning already (`<think></think>`, as
Qwen3's template renders `enable_thinking: false`) leaves the output outside it. An output held to a grammar
(structured outputs) starts outside the reasoning: it only has reasoning if the grammar itself writes `<think>`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from streamer.engine.thinking import END, PARSERS, START, TAGS  # (the engine's thinking budget reads the same tags)

# Parsers whose tags are special tokens: the output's text keeps special tokens so that the tags are there to read
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


def held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """One choice's stream: feed() its text pieces, get back (reasoning, content). Text that may still become a tag
    (a partial `<think>` at the very start, a partial `</think>` at the end of the reasoning) is held back until it
    is known, so any split of the output into pieces gives the same result as the whole text at once."""

    def __init__(self, inside: bool, start: str = START, end: str = END) -> None:
        self._inside = inside  # the output starts inside the reasoning (the prompt opened it)
        self._start, self._end = start, end
        self._state = "start"  # "start" (a leading <think> still possible) | "reasoning" | "content"
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf = self._buf + text
        self._buf = ""
        reasoning = ""
        start, end = self._start, self._end
        if self._state == "start":
            if buf.startswith(start):
                buf = buf[len(start):]
                self._state = "reasoning"
            elif start.startswith(buf) and not final:  # "", "<", "<thi", ...: not known yet
                self._buf = buf
                return "", ""
            else:
                self._state = "reasoning" if self._inside else "content"
        if self._state == "reasoning":
            i = buf.find(end)
            if i < 0:
                keep = 0 if final else held(buf, end)
                self._buf = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:i], buf[i + len(end):]
            self._state = "content"
        return reasoning, buf


@dataclass(frozen=True)
class ReasoningMode:
    """How one chat request's output is read. split: look for <think>...</think> at all; inside: the output starts
    inside the reasoning; include: return the reasoning (vLLM's `include_reasoning`)."""

    split: bool
    inside: bool = False
    include: bool = True
    tags: tuple[str, str] = (START, END)  # (opening, closing)

    def splitter(self) -> Optional[ThinkSplitter]:
        return ThinkSplitter(self.inside, *self.tags) if self.split else None


def _last_tag(prompt: str, tags: tuple[str, str]) -> Optional[str]:
    """Which of the tags the prompt ends inside of: the opening one (reasoning open), the closing one, or None."""
    start, end = prompt.rfind(tags[0]), prompt.rfind(tags[1])
    if start < 0 and end < 0:
        return None
    return tags[0] if start > end else tags[1]


def reasoning_mode(parser: str, prompt: str, template_kwargs: dict[str, Any], *, constrained: bool = False,
                   forced_tool: bool = False, include: bool = True) -> ReasoningMode:
    """The mode for one request: parser (one of PARSERS), its rendered prompt and chat_template_kwargs; constrained:
    the output is held to a grammar (starts outside the reasoning); forced_tool: the output is a forced tool call's
    JSON (never read for reasoning)."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {PARSERS}, got {parser!r}")
    if parser == "deepseek_v3":
        if not (template_kwargs.get("thinking") or template_kwargs.get("enable_thinking")):
            return ReasoningMode(split=False, include=include)
        parser = "deepseek_r1"
    if forced_tool or (parser in ("qwen3", "glm45") and template_kwargs.get("enable_thinking") is False):
        return ReasoningMode(split=False, include=include)
    tags = TAGS.get(parser, (START, END))
    last = _last_tag(prompt, tags)
    if constrained:
        inside = False
    elif parser == "deepseek_r1":
        inside = last != tags[1]  # unless the prompt closed it already
    else:
        inside = last == tags[0]  # qwen3, glm45, seed_oss, mistral: only when the prompt opened it
    return ReasoningMode(split=True, inside=inside, include=include, tags=tags)


def split_all(text: str, inside: bool) -> tuple[str, str]:
    """A whole text at once (what streaming it in any pieces also gives): (reasoning, content)."""
    return ThinkSplitter(inside).feed(text, final=True)

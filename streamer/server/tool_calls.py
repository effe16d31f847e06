"""Tool calls in generated text, turned into OpenAI's `tool_calls` (`streamer serve --tool-call-parser hermes`).

The Hermes format, which Qwen2.5/Qwen3, Hermes and many other chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`HermesToolCalls` reads one choice's text as it streams: text outside the tags passes through as content, a
complete block becomes a tool call, and text that may be the start of a tag is held back until it is known not to
be. A block whose body is not a JSON object with a name stays content, as does an unfinished one at the end.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may still become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call(body: str) -> Optional[dict[str, Any]]:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"type": "function", "function": {
        "name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


class HermesToolCalls:
    """One choice's stream: feed() its text pieces, get back (content, completed tool calls)."""

    def __init__(self) -> None:
        self._buf = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            i = self._buf.find(START)
            if i < 0:
                keep = 0 if final else _held(self._buf, START)
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            out.append(self._buf[:i])
            rest = self._buf[i:]
            j = rest.find(END)
            if j < 0:  # the block is still being written (or, at the end, never closed: plain text)
                self._buf = "" if final else rest
                if final:
                    out.append(rest)
                break
            block, self._buf = rest[:j + len(END)], rest[j + len(END):]
            call = _call(rest[len(START):j])
            if call is None:
                out.append(block)
                continue
            calls.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}", **call})
            self.num_calls += 1
        return "".join(out), calls


def parse_all(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole text at once (what streaming it in any pieces also gives)."""
    return HermesToolCalls().feed(text, final=True)

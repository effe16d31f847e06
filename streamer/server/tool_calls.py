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
        return _call_object(json.loads(body))
    except ValueError:
        return None


def _call_object(obj: Any) -> Optional[dict[str, Any]]:
    """{"name", "arguments" (or "parameters")} as OpenAI's function call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"type": "function", "function": {
        "name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


class HermesToolCalls:
    """One choice's stream: feed() its text pieces, get back (content, completed tool calls)."""

    finish_reason = "tool_calls"  # a choice that called tools finishes so, not "stop"

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


class ForcedToolCalls:
    """A chat whose tool_choice forced a call, so that its output was held to JSON by a grammar (see
    server/structured.py). For a named function the whole output is the call's arguments, and it streams as
    OpenAI streams arguments: a first delta with the call's id and name, then pieces of `arguments` (a
    non-streamed response joins them). For "required" the output is a list of {"name", "arguments"}: the calls
    come out whole with the last piece. An output cut short (finish_reason "length") keeps a named call's partial
    arguments, as OpenAI does; a cut list stays content."""

    def __init__(self, name: Optional[str]) -> None:
        self.name = name
        # OpenAI: a call forced by name finishes with "stop"; "required" with "tool_calls".
        self.finish_reason = "stop" if name is not None else "tool_calls"
        self._buf: list[str] = []
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        if self.name is not None:
            if self.num_calls == 0:
                self.num_calls = 1
                return "", [{"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                             "function": {"name": self.name, "arguments": text}}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self._buf.append(text)
        if not final:
            return "", []
        body = "".join(self._buf)
        try:
            items = json.loads(body)
        except ValueError:
            return body, []
        found = [c for c in map(_call_object, items if isinstance(items, list) else []) if c is not None]
        if not found:
            return body, []
        calls = [{"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", **c} for i, c in enumerate(found)]
        self.num_calls = len(calls)
        return "", calls


def parse_all(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole text at once (what streaming it in any pieces also gives)."""
    return HermesToolCalls().feed(text, final=True)

"""Tool calls in generated text, turned into OpenAI's `tool_calls` (`streamer serve --tool-call-parser NAME`).

The formats vLLM's parsers of the same names read:

- hermes (Qwen2.5/Qwen3, Hermes and many other templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text;
- llama3_json (Llama 3.1/3.2 JSON tool calling): the output is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (and the newer `[TOOL_CALLS]name{...}` and
  `[TOOL_CALLS]name[ARGS]{...}`), after any text;
- pythonic (Llama 3.2/4): the output is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris"), f(x=1)]` (optionally inside `<|python_start|>` ... `<|python_end|>`), read with `ast`.

Each parser reads one choice's text as it streams: feed() its pieces, get back (content, completed tool calls). Text
that may still become a call (a partial tag, an unfinished JSON object or list) is held back until it is known; a
call is emitted once it is complete. What turns out not to be a call (invalid JSON, no name, not literals, an
unfinished call at the end) stays content, so any split of the text into pieces gives the whole text's answer.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from typing import Any, Optional

from streamer.server.reasoning import held as _held

START, END = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def _call(body: str) -> Optional[dict[str, Any]]:
    try:
        return _call_object(json.loads(body))
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: content
        return None


def _arguments(args: Any) -> Optional[str]:
    """Arguments as the JSON text OpenAI's calls carry, or None where they cannot be written (nested deeper than
    the interpreter's recursion limit: a model's output is no more trusted than a client's)."""
    try:
        return json.dumps(args, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        return None


def _call_object(obj: Any) -> Optional[dict[str, Any]]:
    """{"name", "arguments" (or "parameters")} as OpenAI's function call, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else _arguments(args)
    if arguments is None:
        return None
    return {"type": "function", "function": {"name": obj["name"], "arguments": arguments}}


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[pos] and the index after it, or None (not valid, or not complete yet)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _lead(text: str, tag: str, final: bool) -> Optional[tuple[int, bool]]:
    """Skip leading whitespace and an optional `tag` (and whitespace after it): (index of what follows, whether the
    tag was there), or None while that is not known yet (only whitespace so far, or a partial tag)."""
    p = len(text) - len(text.lstrip())
    matched = text.startswith(tag, p)
    if matched:
        p = len(text) - len(text[p + len(tag):].lstrip())
    elif not final and tag.startswith(text[p:]):  # also "" (only whitespace so far)
        return None
    if p == len(text) and not final:
        return None
    return p, matched


class ToolCallParser:
    """One choice's stream: feed() its text pieces, get back (content, completed tool calls)."""

    finish_reason = "tool_calls"  # a choice that called tools finishes so, not "stop"

    def __init__(self) -> None:
        self._buf = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def _numbered(self, call: dict[str, Any]) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", **call}


class BlockToolCalls(ToolCallParser):
    """Calls written as blocks, `START body END`, anywhere in the text: text outside them is content, and so is a block
    whose body `parse` rejects (None) or one still open at the end. `FRAMES` are tags around a group of blocks (a
    "calls section"), dropped from the content."""

    START, END = START, END
    FRAMES: tuple[str, ...] = ()

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        super().__init__()
        self.schemas = _schemas(tools)  # function name -> its parameters' JSON schema

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        return _call(body)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        tags = (self.START, *self.FRAMES)
        while True:
            found = [(i, tag) for tag in tags if (i := self._buf.find(tag)) >= 0]
            if not found:
                keep = 0 if final else max(_held(self._buf, tag) for tag in tags)
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            i, tag = min(found)
            out.append(self._buf[:i])
            rest = self._buf[i:]
            if tag != self.START:  # a frame: dropped
                self._buf = rest[len(tag):]
                continue
            j = rest.find(self.END, len(self.START))
            if j < 0:  # the block is still being written (or, at the end, never closed: plain text)
                self._buf = "" if final else rest
                if final:
                    out.append(self._unframed(rest))
                break
            block, self._buf = rest[:j + len(self.END)], rest[j + len(self.END):]
            call = self.parse(rest[len(self.START):j])
            if call is None:
                out.append(self._unframed(block))
                continue
            calls.append(self._numbered(call))
        return "".join(out), calls

    def _unframed(self, text: str) -> str:
        for frame in self.FRAMES:
            text = text.replace(frame, "")
        return text


class HermesToolCalls(BlockToolCalls):
    """`<tool_call>{json}</tool_call>` blocks anywhere: text outside them is content; a block whose body is not a
    JSON object with a name stays content, as does an unfinished one at the end."""


class Qwen3CoderToolCalls(BlockToolCalls):
    """Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
    (newlines around each part). Values are text, typed by the tool's JSON schema (`_typed`)."""

    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        m = self._FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        inner = m.group(2)
        params = self._PARAM.findall(inner)
        if self._PARAM.sub("", inner).strip():  # anything else between the parameters: not a call
            return None
        schema = self.schemas.get(name, {})
        args = {key.strip(): _typed(_trim_newline(value), schema.get(key.strip()), guess=False)
                for key, value in params}
        return _function(name, args)


class SeedOssToolCalls(Qwen3CoderToolCalls):
    """Seed-OSS's calls: Qwen3-Coder's XML inside `<seed:tool_call>` ... `</seed:tool_call>`."""

    START, END = "<seed:tool_call>", "</seed:tool_call>"


class Glm45ToolCalls(BlockToolCalls):
    """GLM-4.5 / 4.6's calls: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>...</tool_call>`.
    Values are text, typed by the tool's JSON schema (`_typed`; JSON where the schema does not say)."""

    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
    _NAME = re.compile(r"\s*([^\s<]+)")

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        m = self._NAME.match(body)
        if m is None:
            return None
        name, rest = m.group(1), body[m.end():]
        if self._PAIR.sub("", rest).strip():
            return None
        schema = self.schemas.get(name, {})
        return _function(name, {k.strip(): _typed(v, schema.get(k.strip()), guess=True)
                                for k, v in self._PAIR.findall(rest)})


class DeepSeekV3ToolCalls(BlockToolCalls):
    """DeepSeek-V3 / R1-0528's calls, inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`: each
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`."""

    START, END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    FRAMES = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"
    _BODY = re.compile(r"\s*function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\s*(.*?)\s*```\s*\Z", re.S)

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        m = self._BODY.match(body)
        return None if m is None else _named_json(m.group(1).strip(), m.group(2))


class DeepSeekV31ToolCalls(DeepSeekV3ToolCalls):
    """DeepSeek-V3.1 / V3.2's calls: as V3's, each `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        name, sep, args = body.partition(self.SEP)
        return _named_json(name.strip(), args) if sep and name.strip() else None


class KimiK2ToolCalls(BlockToolCalls):
    """Kimi K2's calls, inside `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>`: each
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`."""

    START, END = "<|tool_call_begin|>", "<|tool_call_end|>"
    FRAMES = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    _ID = re.compile(r"\s*(?:functions\.)?([^\s:<]+):\d+\s*<\|tool_call_argument_begin\|>(.*)\Z", re.S)

    def parse(self, body: str) -> Optional[dict[str, Any]]:
        m = self._ID.match(body)
        return None if m is None else _named_json(m.group(1), m.group(2))


def _schemas(tools: Optional[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The request's tools as {function name: {parameter: its JSON schema}}."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _trim_newline(value: str) -> str:
    """Qwen3-Coder writes each value on lines of its own: one newline each side is the format's, not the value's."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _typed(value: str, schema: Any, guess: bool) -> Any:
    """A parameter's text as its schema's type (as vLLM's XML parsers convert it): "null" is None; strings stay
    text; integers, numbers and booleans are read as such, objects and arrays as JSON (or Python literals). Text
    that does not read as its type, and a parameter the schema does not name, stay text (guess: try JSON first)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
    if value.strip().lower() == "null" and kind is not None:
        return None
    if kind in _STRING_TYPES or (kind is None and not guess):
        return value
    text = value.strip()
    try:
        if kind in ("integer", "int"):
            return int(text)
        if kind in ("number", "float"):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind in ("boolean", "bool"):
            return {"true": True, "false": False}[text.lower()]
        return json.loads(text)
    except (ValueError, KeyError, RecursionError):
        pass
    if kind is not None:
        try:
            return ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            pass
    return value


def _function(name: str, args: dict[str, Any]) -> Optional[dict[str, Any]]:
    arguments = _arguments(args)
    return None if arguments is None else {"type": "function", "function": {"name": name, "arguments": arguments}}


def _named_json(name: str, args: str) -> Optional[dict[str, Any]]:
    """A call of `name` whose arguments are the JSON object `args` (None if they are not one)."""
    try:
        value = json.loads(args)
    except (ValueError, RecursionError):
        return None
    return _function(name, value) if isinstance(value, dict) and name else None


class Llama3JsonToolCalls(ToolCallParser):
    """The output is calls when it starts (after whitespace) with `<|python_tag|>` or `{`: JSON objects
    `{"name", "parameters" (or "arguments")}` separated by `;`, each emitted when its closing brace arrives. Anything
    else (text first, an object that is not a call, text after the calls) is content from there on."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "call" (an object expected at self._pos) | "sep" (after one) | "text"
        self._pos = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        calls: list[dict[str, Any]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                lead = _lead(buf, self.TAG, final)
                if lead is None:
                    break
                self._pos = lead[0]
                self._state = "call" if buf.startswith("{", lead[0]) else "text"
            elif self._state == "call":
                p = len(buf) - len(buf[self._pos:].lstrip())
                if p == len(buf):  # only a ";" so far (dropped at the end, as the whitespace)
                    if final:
                        self._buf = ""
                    break
                if not buf.startswith("{", p):
                    self._state = "text"
                    continue
                if not final and "}" not in text and text:  # an object can only be completed by a "}"
                    break
                found = _json_at(buf, p)
                if found is None:
                    if not final:
                        break
                    self._state = "text"
                    continue
                call = _call_object(found[0])
                if call is None:
                    self._state = "text"
                    continue
                calls.append(self._numbered(call))
                self._buf, self._state = buf[found[1]:], "sep"
            elif self._state == "sep":
                stripped = buf.lstrip()
                if stripped.startswith(";"):
                    self._pos, self._state = len(buf) - len(stripped) + 1, "call"
                elif stripped:
                    self._state = "text"
                else:  # only whitespace after the calls so far (dropped at the end)
                    if final:
                        self._buf = ""
                    break
            else:  # text
                content, self._buf = self._buf, ""
                return content, calls
        return "", calls


class GraniteToolCalls(ToolCallParser):
    """IBM Granite 3.x: the output is calls when it starts (after whitespace) with `<|tool_call|>` (3.0) or
    `<tool_call>` (3.1+), or directly with `[`: then a JSON array of `{"name", "arguments"}` objects, read once it is
    complete. Anything else (text first, an array that is not all calls, an unfinished one) is content; text after
    the array is content too."""

    TAGS = ("<|tool_call|>", "<tool_call>")

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "array" (expected at self._pos) | "after" (the calls) | "text"
        self._pos = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        buf = self._buf
        if self._state == "start":
            p = len(buf) - len(buf.lstrip())
            tag = next((t for t in self.TAGS if buf.startswith(t, p)), None)
            if tag is None and not final and (p == len(buf) or any(t.startswith(buf[p:]) for t in self.TAGS)):
                return "", []  # only whitespace, or a partial tag, so far
            if tag is not None:
                p = len(buf) - len(buf[p + len(tag):].lstrip())
                if p == len(buf) and not final:
                    return "", []
            self._state, self._pos = ("array", p) if buf.startswith("[", p) else ("text", 0)
        if self._state == "array":
            found = _json_at(buf, self._pos)
            if found is None and not final:
                return "", []
            calls = [_call_object(c) for c in found[0]] if found and isinstance(found[0], list) else [None]
            if found is None or not calls or any(c is None for c in calls):
                self._state = "text"
            else:
                self._state, self._buf = "after", buf[found[1]:]
                return self._after(), [self._numbered(c) for c in calls]  # type: ignore[arg-type]
        if self._state == "after":
            return self._after(), []
        return self._take(), []

    def _after(self) -> str:
        """Whitespace right after the calls is dropped; text after that is content."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"
        return self._take()

    def _take(self) -> str:
        content, self._buf = self._buf, ""
        return content


class MistralToolCalls(ToolCallParser):
    """Text until `[TOOL_CALLS]` is content. After it: a JSON list of {"name", "arguments"} (all emitted when the
    list closes), or a name and a JSON object (`name{...}`, `name[ARGS]{...}`, v11's `name[CALL_ID]ID[ARGS]{...}`,
    emitted when the object closes); then text again. A list that is not all calls, or anything else after the
    tag, stays content. Call ids are the model's own (v11's [CALL_ID], a listed call's "id"), else 9 random
    letters and digits: Mistral's chat templates refuse any other shape when the call comes back."""

    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"
    _NAME = re.compile(r"[A-Za-z_][\w.\-]*")
    _ID = re.compile(r"[A-Za-z0-9]+")

    def __init__(self) -> None:
        super().__init__()
        self._after_tag = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            buf = self._buf
            if not self._after_tag:
                i = buf.find(self.TAG)
                if i < 0:
                    keep = 0 if final else _held(buf, self.TAG)
                    out.append(buf[:len(buf) - keep])
                    self._buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:i])
                self._buf, self._after_tag = buf[i:], True
                continue
            step = self._after(buf, text, final)
            if step is None:  # not known yet
                break
            end, found = step
            if found:
                calls += [self._numbered(c) for c in found]
            else:
                out.append(buf[:end])
            self._buf, self._after_tag = buf[end:], False
        return "".join(out), calls

    def _after(self, buf: str, text: str, final: bool) -> Optional[tuple[int, list[dict[str, Any]]]]:
        """buf starts with the tag: (end of what was read, the calls in it; none: buf[:end] is content), or None
        while it is not known yet. text: the piece just fed (a list or object can only close with a bracket)."""
        p = len(buf) - len(buf[len(self.TAG):].lstrip())
        if p == len(buf):
            return (len(buf), []) if final else None
        if buf[p] == "[":
            if not final and text and "]" not in text:
                return None
            found = _json_at(buf, p)
            if found is None:
                return (len(buf), []) if final else None
            items = found[0] if isinstance(found[0], list) else []
            calls = [_call_object(x) for x in items]
            if not calls or any(c is None for c in calls):
                return found[1], []
            for call, item in zip(calls, items):
                if isinstance(item.get("id"), str):
                    call["id"] = item["id"]  # type: ignore[index]
            return found[1], calls  # type: ignore[return-value]
        m = self._NAME.match(buf, p)
        if m is None:
            return len(self.TAG), []
        q = m.end()
        call_id = None
        if buf.startswith(self.CALL_ID, q):
            found_id = self._ID.match(buf, q + len(self.CALL_ID))
            if found_id is None or found_id.end() == len(buf):
                return (len(buf), []) if final else None
            call_id, q = found_id.group(0), found_id.end()
            if not buf.startswith(self.ARGS, q) and not (self.ARGS.startswith(buf[q:]) and not final):
                return len(self.TAG), []
        elif self.CALL_ID.startswith(buf[q:]) and buf[q:] and not final:
            return None
        if buf.startswith(self.ARGS, q):
            q += len(self.ARGS)
        elif self.ARGS.startswith(buf[q:]) and not final:  # also "": the name may go on
            return None
        if q == len(buf):
            return (len(buf), []) if final else None
        if buf[q] != "{":
            return len(self.TAG), []
        if not final and text and "}" not in text:
            return None
        found = _json_at(buf, q)
        if found is None:
            return (len(buf), []) if final else None
        call = _call_object({"name": m.group(0), "arguments": found[0]}) if isinstance(found[0], dict) else None
        if call is not None and call_id is not None:
            call["id"] = call_id
        return (found[1], [call]) if call is not None else (found[1], [])

    def _numbered(self, call: dict[str, Any]) -> dict[str, Any]:
        given = call.pop("id", None)
        numbered = super()._numbered(call)
        numbered["id"] = given if isinstance(given, str) and given else \
            "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return numbered


_CALL_OPENING = re.compile(r"\s*[A-Za-z_]\w*\s*\(")
_CALL_OPENING_PREFIX = re.compile(r"\s*(?:[A-Za-z_]\w*\s*)?")


class PythonicToolCalls(ToolCallParser):
    """The output is calls when it starts (after whitespace, and an optional `<|python_start|>`) with a Python list
    of calls: `[f(a=1, b="x"), g()]`, keyword arguments with literal values only (read with `ast.literal_eval`,
    never run). The calls are emitted when the list closes; a list that is not all such calls, or any other start,
    is content, as is the text after the list (a `<|python_end|>` right after it is dropped)."""

    START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # "start" | "list" (a list opens at self._pos) | "after" | "text"
        self._pos = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        calls: list[dict[str, Any]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                lead = _lead(buf, self.START_TAG, final)
                if lead is None:
                    break
                self._pos = lead[0]
                self._state = "list" if buf.startswith("[", lead[0]) else "text"
            elif self._state == "list":
                head = buf[self._pos + 1:]
                if not _CALL_OPENING.match(head):
                    if _CALL_OPENING_PREFIX.fullmatch(head) and not final:
                        break  # "[", "[get_wea": may still open a call
                    self._state = "text"
                    continue
                if not final and "]" not in text and text:  # the list can only be closed by a "]"
                    break
                end = _bracket_end(buf, self._pos)
                if end is None:
                    if not final:
                        break
                    self._state = "text"
                    continue
                found = _pythonic_calls(buf[self._pos:end]) if end > 0 else None
                if not found:
                    self._state = "text"
                    continue
                calls += [self._numbered(c) for c in found]
                self._buf, self._state = buf[end:], "after"
            elif self._state == "after":
                lead = _lead(buf, self.END_TAG, final)
                if lead is None:
                    break
                if lead[1]:
                    self._buf = buf[lead[0]:]
                self._state = "text"
            else:  # text
                content, self._buf = self._buf, ""
                return content, calls
        return "", calls


def _bracket_end(text: str, pos: int) -> Optional[int]:
    """The index after the bracket that closes the one at text[pos] (Python strings skipped), None if it is not
    closed yet, -1 if the brackets do not match."""
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    quote = ""
    i = pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in "([{":
            stack.append(c)
        elif c in closing:
            if not stack or stack.pop() != closing[c]:
                return -1
            if not stack:
                return i + 1
        i += 1
    return None


def _pythonic_calls(source: str) -> Optional[list[dict[str, Any]]]:
    """`[f(a=1), ...]` as OpenAI function calls, or None unless it is a non-empty list of calls of plain names with
    literal keyword arguments only."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        try:
            arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # sets, bytes, complex numbers, nan; too deep
            return None
        calls.append({"type": "function", "function": {"name": node.func.id, "arguments": arguments}})
    return calls


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCalls, "llama3_json": Llama3JsonToolCalls, "mistral": MistralToolCalls,
    "pythonic": PythonicToolCalls, "qwen3_coder": Qwen3CoderToolCalls, "qwen3_xml": Qwen3CoderToolCalls,
    "glm45": Glm45ToolCalls, "deepseek_v3": DeepSeekV3ToolCalls, "deepseek_v31": DeepSeekV31ToolCalls,
    "kimi_k2": KimiK2ToolCalls, "seed_oss": SeedOssToolCalls, "granite": GraniteToolCalls,
    "llama4_pythonic": PythonicToolCalls, "llama4_json": Llama3JsonToolCalls}
# Every name --tool-call-parser takes: "openai" is gpt-oss's harmony format, read by server/harmony.py.
TOOL_CALL_PARSERS = (*PARSERS, "openai")


def make_parser(name: str, tools: Optional[list[dict[str, Any]]] = None) -> ToolCallParser:
    """A parser for one choice; tools: the request's, whose schemas type the XML formats' values."""
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {tuple(PARSERS)}, got {name!r}")
    cls = PARSERS[name]
    return cls(tools) if issubclass(cls, BlockToolCalls) else cls()


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
        except (ValueError, RecursionError):  # not JSON, or nested too deep to read: content
            return body, []
        found = [c for c in map(_call_object, items if isinstance(items, list) else []) if c is not None]
        if not found:
            return body, []
        calls = [{"index": i, "id": f"call_{uuid.uuid4().hex[:24]}", **c} for i, c in enumerate(found)]
        self.num_calls = len(calls)
        return "", calls


def parse_all(text: str, parser: str = "hermes",
              tools: Optional[list[dict[str, Any]]] = None) -> tuple[str, list[dict[str, Any]]]:
    """A whole text at once (what streaming it in any pieces also gives)."""
    return make_parser(parser, tools).feed(text, final=True)

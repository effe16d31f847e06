"""gpt-oss's chat output, OpenAI's "harmony" format, read into reasoning, content and tool calls
(`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`; on by default for gpt-oss checkpoints).

The output is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|call|>

or `...<|channel|>final<|message|>It is sunny.` (`<|return|>`). The header names the channel and, for a tool call,
the recipient (`to=functions.NAME`, before or after the channel). The channels: `analysis` is reasoning, `final`
is content, `commentary` is content unless it has a recipient (a preamble the user may see); a message to
`functions.NAME` is a call of NAME with the body as its JSON arguments. Messages to other recipients (the
built-in browser or python tools, which this server does not run) are reasoning. `<|call|>` and `<|return|>` are
gpt-oss's stop tokens, so the output usually ends inside its last body.

The text must keep the special tokens (the server decodes such requests with `skip_special_tokens=False`). A
body's text streams as it arrives (a suffix that may still become a tag is held back); a call is emitted whole
when its message ends. Any split of the text into pieces gives the whole text's answer.
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from streamer.server.reasoning import held

TOOL_PARSER, REASONING_PARSER = "openai", "openai_gptoss"  # the parser names that choose this format (vLLM's)
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_BODY_STOPS = (*ENDS, START)  # a body also ends where a new message starts (a model that skipped <|end|>)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser:
    """One choice's stream: feed() its text pieces, get back (reasoning, content, completed tool calls).
    tools: whether the request has tools (a call otherwise stays content, its body as text)."""

    finish_reason = "tool_calls"

    def __init__(self, tools: bool = True) -> None:
        self.tools = tools
        self.num_calls = 0
        self._buf = ""
        self._state = "start"  # "start" | "header" | "body"
        self._kind = "content"  # the current body's: "reasoning" | "content" | "call"
        self._name = ""  # the called function's (kind "call")
        self._args: list[str] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[dict[str, Any]]]:
        self._buf += text
        out = {"reasoning": [], "content": []}
        calls: list[dict[str, Any]] = []
        while True:
            buf = self._buf
            if self._state == "start":  # the output's first text: a header, or (a model ignoring the format) text
                lead = buf.lstrip()
                if lead.startswith((START, CHANNEL)) or buf.startswith(MESSAGE):
                    self._state = "header"
                elif not final and any(tag.startswith(lead) for tag in (START, CHANNEL)) or \
                        not final and MESSAGE.startswith(buf):
                    break  # "", "<|", "<|chan": not known yet
                else:
                    self._state, self._kind = "body", "content"
                continue
            if self._state == "header":
                i = buf.find(MESSAGE)
                if i < 0:
                    if final:  # a header cut short shows nothing; text that was never a header is content
                        self._buf = ""
                        if START not in buf and CHANNEL not in buf:
                            out["content"].append(buf)
                    break
                self._open(buf[:i])
                self._buf, self._state = buf[i + len(MESSAGE):], "body"
                continue
            found = [(j, tag) for tag in _BODY_STOPS if (j := buf.find(tag)) >= 0]
            if not found:
                keep = 0 if final else max(held(buf, tag) for tag in _BODY_STOPS)
                self._body(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                if final:
                    self._close(out, calls)
                break
            j, tag = min(found)
            self._body(buf[:j], out)
            self._close(out, calls)
            self._buf = buf[j + (0 if tag == START else len(tag)):]
            self._state = "header"
        return "".join(out["reasoning"]), "".join(out["content"]), calls

    def _open(self, header: str) -> None:
        """A message starts: its header says where its body goes."""
        m = _CHANNEL.search(header)
        channel = m.group(1) if m else "final"
        m = _RECIPIENT.search(header)
        recipient = m.group(1) if m else ""
        self._name, self._args = "", []
        if recipient.startswith("functions.") and self.tools:
            self._kind, self._name = "call", recipient[len("functions."):]
        elif recipient and not recipient.startswith("functions."):
            self._kind = "reasoning"  # a built-in tool's (browser, python): not run here
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _body(self, text: str, out: dict[str, list[str]]) -> None:
        if not text:
            return
        if self._kind == "call":
            self._args.append(text)
        else:
            out[self._kind].append(text)

    def _close(self, out: dict[str, list[str]], calls: list[dict[str, Any]]) -> None:
        """A message ends: a call's arguments are complete."""
        if self._kind != "call":
            return
        args = "".join(self._args).strip()  # (passed on as the model wrote them, as OpenAI does)
        self._kind, self._args = "content", []
        self.num_calls += 1
        calls.append({"index": self.num_calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": self._name, "arguments": args}})


def parse_all(text: str, tools: bool = True) -> tuple[str, str, list[dict[str, Any]]]:
    """A whole text at once (what streaming it in any pieces also gives): (reasoning, content, calls)."""
    return HarmonyParser(tools).feed(text, final=True)


def is_harmony_model(architecture: str) -> bool:
    """Models whose chat output is harmony-formatted."""
    return architecture == "GptOssForCausalLM"

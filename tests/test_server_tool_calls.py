"""Tool calls in chat output (`--tool-call-parser hermes`): the parser on whole texts and on any split of them,
the chat response shapes built from streamed pieces, and the live server's plumbing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.outputs import StreamOutput
from streamer.server.responses import ChatFormat, Choice
from streamer.server.tool_calls import HermesToolCalls, parse_all

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_whole_texts():
    content, calls = parse_all("Let me look.\n" + CALL)
    assert content == "Let me look.\n"
    assert _names_args(calls) == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["index"] == 0
    two = parse_all(CALL + "\n" + CALL.replace("get_weather", "get_time"))[1]
    assert [c["index"] for c in two] == [0, 1] and _names_args(two)[1][0] == "get_time"
    assert len({c["id"] for c in two}) == 2
    # Not a call: text stays text.
    for text in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f"', "a < b, <tool and <tool_call", "plain text"]:
        assert parse_all(text) == (text, [])
    # Arguments already a JSON string are passed through.
    assert parse_all('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0]["function"][
        "arguments"] == '{"x": 1}'


pieces = st.lists(st.sampled_from(["Hi ", "<", "tool", "call>", CALL, "\n", "x<y", "</tool_call>", "{}"]),
                  max_size=8)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(parts=pieces, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_split_gives_the_whole_texts_answer(parts, cuts):
    text = "".join(parts)
    cuts = sorted({c for c in cuts if c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = HermesToolCalls()
    content, calls = [], []
    for i, chunk in enumerate(chunks or [""]):
        c, k = stream.feed(chunk, final=i == len(chunks or [""]) - 1)
        content.append(c)
        calls += k
    want_content, want_calls = parse_all(text)
    assert "".join(content) == want_content
    assert _names_args(calls) == _names_args(want_calls)
    assert [c["index"] for c in calls] == list(range(len(calls)))


def _outs(texts, finish="stop"):
    return [StreamOutput("r", 0, [i], t, finish_reason=finish if i == len(texts) - 1 else None)
            for i, t in enumerate(texts)]


@pytest.mark.parametrize("texts", [
    ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", \"argu", "ments\": {\"city\": \"Paris\"}}\n</tool_call>"],
    ["<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", "<tool_call>{\"name\": \"b\", \"arguments\": {}}",
     "</tool_call>"],
])
def test_chat_shapes_streamed_and_not(texts):
    fmt = ChatFormat(1, None, False, tool_calls=True)
    choice, chunks = Choice(), []
    for out in _outs(texts):
        piece = fmt.piece(0, 0, out)
        choice.add(piece)
        chunk = fmt.chunk_choice(piece)
        if chunk is not None:
            chunks.append(chunk)
    final = fmt.final_choice(0, choice)
    msg = final["message"]
    assert final["finish_reason"] == "tool_calls" and chunks[-1]["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in (msg["content"] or "")
    streamed_calls = [tc for ch in chunks for tc in ch["delta"].get("tool_calls", [])]
    assert [tc["function"] for tc in streamed_calls] == [tc["function"] for tc in msg["tool_calls"]]
    assert all("index" not in tc for tc in msg["tool_calls"]) and all("index" in tc for tc in streamed_calls)
    assert "".join(ch["delta"].get("content", "") for ch in chunks) == choice.text
    assert msg["content"] == (choice.text if choice.text.strip() else None)


def test_without_a_call_the_text_is_content():
    fmt = ChatFormat(1, None, False, tool_calls=True)
    choice = Choice()
    for out in _outs(["The answer", " is 4 < 5."]):
        choice.add(fmt.piece(0, 0, out))
    final = fmt.final_choice(0, choice)
    assert final["message"] == {"role": "assistant", "content": "The answer is 4 < 5."}
    assert final["finish_reason"] == "stop"

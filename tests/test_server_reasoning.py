"""Reasoning in chat output (`--reasoning-parser deepseek_r1|qwen3`) and the tool-call formats read from the content
after it: the splitter on whole texts and on every split of them, the modes a prompt selects, the chat response
shapes, and the live server (outputs forced with guided_choice, streamed and not, through the real openai client)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.outputs import StreamOutput
from streamer.server.reasoning import ReasoningMode, ThinkSplitter, reasoning_mode, split_all
from streamer.server.responses import ChatFormat, Choice
from tests.server_utils import LiveServer

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- the splitter
@pytest.mark.parametrize("text,inside,want", [
    ("<think>Let me see.</think>The answer.", False, ("Let me see.", "The answer.")),
    ("<think>Let me see.</think>The answer.", True, ("Let me see.", "The answer.")),
    ("Let me see.</think>The answer.", True, ("Let me see.", "The answer.")),   # the prompt opened it
    ("Let me see.</think>The answer.", False, ("", "Let me see.</think>The answer.")),
    ("<think>\nstill thinking", False, ("\nstill thinking", "")),             # cut short: all reasoning
    ("no tags at all", True, ("no tags at all", "")),
    ("no tags at all", False, ("", "no tags at all")),
    (" <think>a</think>b", False, ("", " <think>a</think>b")),               # not at the start: content
    ("<think></think>", False, ("", "")),
    ("<think>a</think>b</think>c<think>d", False, ("a", "b</think>c<think>d")),
    ("<thin", False, ("", "<thin")),
    ("<thin", True, ("<thin", "")),
    ("a</thi", True, ("a</thi", "")),
    ("", True, ("", "")),
])
def test_split_whole_and_every_split(text, inside, want):
    assert split_all(text, inside) == want
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]:
        s = ThinkSplitter(inside)
        got = [s.feed(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want, chunks


def test_split_three_ways_and_nothing_leaks_early():
    text = "<think>a<b</thin</think>c</think>"
    for inside in (False, True):
        want = split_all(text, inside)
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                s = ThinkSplitter(inside)
                parts = [s.feed(text[:i]), s.feed(text[i:j]), s.feed(text[j:], final=True)]
                assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want
                # Before the end, no tag text is ever emitted as reasoning.
                assert "<think" not in parts[0][0] + parts[1][0] and "</think" not in parts[0][0] + parts[1][0]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "x", " ", "<th", "ink>"]),
                      max_size=10), cuts=st.lists(st.integers(0, 80), max_size=6), inside=st.booleans())
def test_split_any_pieces(parts, cuts, inside):
    text = "".join(parts)
    cuts = sorted({c for c in cuts if c <= len(text)})
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s = ThinkSplitter(inside)
    got = [s.feed(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
    reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
    assert (reasoning, content) == split_all(text, inside)
    # Only the tags that delimit the reasoning are removed.
    assert len(reasoning) + len(content) in (len(text), len(text) - 7, len(text) - 8, len(text) - 15)


def test_modes_from_the_prompt():
    gen = "<|assistant|>\n"
    assert reasoning_mode("deepseek_r1", gen, {}) == ReasoningMode(True, inside=True)
    assert reasoning_mode("deepseek_r1", gen + "<think>\n", {}).inside
    assert not reasoning_mode("deepseek_r1", "<think>\n\n</think>\n\n", {}).inside  # the prompt closed it
    assert reasoning_mode("qwen3", gen, {}) == ReasoningMode(True, inside=False)
    assert reasoning_mode("qwen3", gen + "<think>\n", {}).inside  # Qwen3 thinking-2507 templates open it
    assert reasoning_mode("qwen3", gen, {"enable_thinking": False}).split is False
    assert reasoning_mode("qwen3", gen, {"enable_thinking": True}).split
    # Held to a grammar: only a <think> the grammar writes; a forced tool call is never read for reasoning.
    assert reasoning_mode("deepseek_r1", gen, {}, constrained=True) == ReasoningMode(True, inside=False)
    assert reasoning_mode("deepseek_r1", gen, {}, forced_tool=True).split is False
    assert reasoning_mode("qwen3", gen, {}, include=False).include is False
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning_mode("granite", gen, {})


def test_more_modes_from_the_prompt():
    """glm45 reads as qwen3; deepseek_v3 (V3.1 / V3.2) reasons only when the request asks it to think, then as
    deepseek_r1 (its template ends the prompt with <think>, or </think> when not thinking)."""
    gen = "<|assistant|>"
    assert reasoning_mode("glm45", gen, {}) == ReasoningMode(True, inside=False)
    assert reasoning_mode("glm45", gen + "<think>", {}).inside
    assert reasoning_mode("glm45", gen + "<think></think>", {}) == ReasoningMode(True, inside=False)
    assert reasoning_mode("glm45", gen, {"enable_thinking": False}).split is False
    v3 = "<｜Assistant｜>"
    assert reasoning_mode("deepseek_v3", v3 + "</think>", {}).split is False
    assert reasoning_mode("deepseek_v3", v3 + "<think>", {}).split is False  # not asked to think
    assert reasoning_mode("deepseek_v3", v3 + "<think>", {"thinking": True}) == ReasoningMode(True, inside=True)
    assert reasoning_mode("deepseek_v3", v3 + "</think>", {"thinking": True}) == ReasoningMode(True, inside=False)
    assert reasoning_mode("deepseek_v3", v3 + "<think>", {"enable_thinking": True}).inside


# ---------------------------------------------------------------------------------------------- response shapes
def _run_format(fmt, texts, finish="stop"):
    choice, chunks = Choice(), []
    for i, t in enumerate(texts):
        out = StreamOutput("r", 0, [i], t, finish_reason=finish if i == len(texts) - 1 else None)
        piece = fmt.piece(0, 0, out)
        choice.add(piece)
        chunk = fmt.chunk_choice(piece)
        if chunk is not None:
            chunks.append(chunk)
    return fmt.final_choice(0, choice), chunks


def _joined(chunks, key):
    return "".join(ch["delta"].get(key, "") for ch in chunks)


THOUGHT_AND_CALL = ('<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris"}}\n</tool_call>')


@pytest.mark.parametrize("cut", range(len(THOUGHT_AND_CALL) + 1))
def test_reasoning_then_tool_call_at_every_chunk_boundary(cut):
    pieces = [THOUGHT_AND_CALL[:cut], THOUGHT_AND_CALL[cut:]]
    fmt = ChatFormat(1, None, False, tool_calls="hermes", reasoning=ReasoningMode(True, inside=True))
    final, chunks = _run_format(fmt, pieces)
    msg = final["message"]
    assert msg["reasoning_content"] == "I need the weather." == _joined(chunks, "reasoning_content")
    assert msg["content"] is None and _joined(chunks, "content") == "\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    assert final["finish_reason"] == "tool_calls" == chunks[-1]["finish_reason"]
    assert not any("<think" in ch["delta"].get("reasoning_content", "") + ch["delta"].get("content", "")
                   for ch in chunks)


def test_a_call_inside_the_reasoning_is_not_a_call():
    text = '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>?</think>No call.'
    fmt = ChatFormat(1, None, False, tool_calls="hermes", reasoning=ReasoningMode(True))
    final, _ = _run_format(fmt, [text[:20], text[20:]])
    assert final["message"]["reasoning_content"].startswith("maybe <tool_call>")
    assert final["message"]["content"] == "No call." and "tool_calls" not in final["message"]
    assert final["finish_reason"] == "stop"


def test_include_reasoning_false_and_no_parser():
    fmt = ChatFormat(1, None, False, reasoning=ReasoningMode(True, include=False))
    final, chunks = _run_format(fmt, ["<think>secret</th", "ink>Answer."])
    assert final["message"] == {"role": "assistant", "content": "Answer.", "reasoning_content": None}
    assert _joined(chunks, "reasoning_content") == "" and _joined(chunks, "content") == "Answer."
    # Without a reasoning parser the text is untouched and the message has no reasoning_content.
    final, _ = _run_format(ChatFormat(1, None, False), ["<think>secret</think>Answer."])
    assert final["message"] == {"role": "assistant", "content": "<think>secret</think>Answer."}
    # Cut short inside the reasoning: no content.
    final, chunks = _run_format(ChatFormat(1, None, False, reasoning=ReasoningMode(True, inside=True)),
                                ["still", " thinking"], finish="length")
    assert final["message"]["content"] is None and final["message"]["reasoning_content"] == "still thinking"
    assert final["finish_reason"] == "length" == chunks[-1]["finish_reason"]


# ---------------------------------------------------------------------------------------------- live server
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def live(llama_dir):
    # No jump-forward: a forced output arrives token by token, so tags are split across chunks as a model's are.
    with LiveServer(llama_dir, jump_forward=False) as server:
        yield server


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _client(live):
    return openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


class _Parsers:
    """Set the server's parsers for one test (as `--reasoning-parser` / `--tool-call-parser` do)."""

    def __init__(self, live, reasoning=None, tools=None):
        self.server, self.values = live.app.state.server, (reasoning, tools)

    def __enter__(self):
        self.server.reasoning_parser, self.server.tool_call_parser = self.values

    def __exit__(self, *exc):
        self.server.reasoning_parser = self.server.tool_call_parser = None


async def _both(c, **kw):
    """The non-streamed message and the streamed deltas joined (reasoning, content, calls, finish, chunks)."""
    full = await c.chat.completions.create(model="llama", messages=MSG, **kw)
    reasoning, content, calls, finish, n = "", "", {}, None, 0
    async for chunk in await c.chat.completions.create(model="llama", messages=MSG, stream=True,
                                                       stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            usage = chunk.usage
            continue
        n += 1
        d = chunk.choices[0].delta
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            # each call arrives once, whole, with an id (mistral's: 9 letters and digits, as its templates want)
            assert tc.index not in calls and re.fullmatch(r"call_\w+|[A-Za-z0-9]{9}", tc.id)
            calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.completion_tokens_details == full.usage.completion_tokens_details
    return full, (reasoning, content, list(calls.values()), finish, n)


def _calls(message):
    return [(tc.function.name, json.loads(tc.function.arguments)) for tc in message.tool_calls or []]


def test_live_reasoning_of_the_models_own_output(live):
    """The random model writes no tags: deepseek_r1 reads all of it as reasoning (the template may have opened it),
    qwen3 as content; include_reasoning false drops it; a prompt that opened <think> makes qwen3 read reasoning."""
    kw = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})

    async def main():
        async with _client(live) as c:
            plain = await c.chat.completions.create(model="llama", messages=MSG, **kw)
            with _Parsers(live, "deepseek_r1"):
                r1 = await _both(c, **kw)
                dropped = await c.chat.completions.create(model="llama", messages=MSG, max_tokens=12,
                                                          temperature=0.0,
                                                          extra_body={"ignore_eos": True, "include_reasoning": False})
            with _Parsers(live, "qwen3"):
                q3 = await _both(c, **kw)
                opened = await c.chat.completions.create(
                    model="llama", max_tokens=12, temperature=0.0,
                    messages=MSG + [{"role": "assistant", "content": "<think>Hmm"}],
                    extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
            return plain, r1, dropped, q3, opened

    plain, (r1, r1_stream), dropped, (q3, q3_stream), opened = _run(main())
    text = plain.choices[0].message.content
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    assert "think>" not in text and text
    m = r1.choices[0].message
    assert m.model_extra["reasoning_content"] == text and m.content is None
    assert r1_stream[:2] == (text, "") and r1.choices[0].finish_reason == r1_stream[3] == "length"
    assert dropped.choices[0].message.model_extra["reasoning_content"] is None
    assert dropped.choices[0].message.content is None
    m = q3.choices[0].message
    assert m.content == text and m.model_extra["reasoning_content"] is None and q3_stream[:2] == ("", text)
    m = opened.choices[0].message
    assert m.model_extra["reasoning_content"] and m.content is None
    # usage.completion_tokens_details.reasoning_tokens: all 12 where all is reasoning, none where none is; no
    # details without a parser.
    assert r1.usage.completion_tokens_details.reasoning_tokens == 12 == dropped.usage.completion_tokens_details \
        .reasoning_tokens == opened.usage.completion_tokens_details.reasoning_tokens
    assert q3.usage.completion_tokens_details.reasoning_tokens == 0 and plain.usage.completion_tokens_details is None


FORCED = [
    # (reasoning parser, tool parser, chat_template_kwargs, forced output, reasoning, content, calls)
    ("deepseek_r1", "hermes", None,
     '<think>The user wants weather.</think>Checking.<tool_call>{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}</tool_call>', "The user wants weather.", "Checking.", [("get_weather", {"city": "Paris"})]),
    ("qwen3", None, None, "<think>\nShort.\n</think>\n\nIt is sunny.", "\nShort.\n", "\n\nIt is sunny.", []),
    ("qwen3", None, {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y", []),
    # Held to a grammar: the output starts outside the reasoning even where deepseek_r1 reads the prompt as opening it.
    ("deepseek_r1", None, None, '{"answer": 4}', None, '{"answer": 4}', []),
    ("deepseek_r1", "llama3_json", None,
     '<think>ok</think>{"name": "get_weather", "parameters": {"city": "Paris"}}', "ok", None,
     [("get_weather", {"city": "Paris"})]),
    (None, "llama3_json", None, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_weather", '
     '"parameters": {"city": "Rome"}}', None, None, [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
    ("qwen3", "mistral", None, '<think>a</think>Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}]', "a", "Sure. ", [("get_weather", {"city": "Paris"})]),
    (None, "pythonic", None, '[get_weather(city="Paris"), get_weather(city=\'Oslo\')]', None, None,
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    (None, "pythonic", None, "[get_weather(city=Paris)]", None, "[get_weather(city=Paris)]", []),  # not a literal
]


@pytest.mark.parametrize("reasoning,tools,kwargs,output,want_reasoning,want_content,want_calls", FORCED)
def test_live_forced_outputs(live, reasoning, tools, kwargs, output, want_reasoning, want_content, want_calls):
    """guided_choice makes the random model write exactly `output`; the response (and the stream joined) reads it."""
    extra = {"guided_choice": [output]}
    if kwargs:
        extra["chat_template_kwargs"] = kwargs
    kw = dict(max_tokens=400, temperature=0.0, tools=TOOLS, extra_body=extra)

    async def main():
        async with _client(live) as c:
            with _Parsers(live, reasoning, tools):
                return await _both(c, **kw)

    full, (s_reasoning, s_content, s_calls, s_finish, n_chunks) = _run(main())
    m, choice = full.choices[0].message, full.choices[0]
    assert (m.model_extra or {}).get("reasoning_content") == want_reasoning
    assert m.content == want_content
    assert _calls(m) == want_calls
    assert choice.finish_reason == s_finish == ("tool_calls" if want_calls else "stop")
    # The stream carries the same, without a tag.
    assert s_reasoning == (want_reasoning or "") and s_calls == want_calls
    assert s_content.strip() == (want_content or "").strip()
    assert "think>" not in s_reasoning and ("think>" in s_content) == ("think>" in (want_content or ""))
    # Reasoning tokens: the tokens between the tags (the tags' own left out), counted where the text was read.
    reasoning_tokens = full.usage.completion_tokens_details.reasoning_tokens if reasoning else None
    if want_reasoning:
        assert 0 < reasoning_tokens < full.usage.completion_tokens - 2
    elif reasoning:
        assert reasoning_tokens == 0
    # One token a step (no jump-forward): the tags and calls were written across many pieces.
    assert full.usage.completion_tokens > 10 and n_chunks >= 1 + bool(want_reasoning) + bool(want_calls)


def test_live_bad_include_reasoning_is_a_400(live):
    r = httpx.post(live.base_url + "/chat/completions", timeout=60,
                   json={"model": "llama", "messages": MSG, "max_tokens": 2, "include_reasoning": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"


def test_cli_unknown_parser_exits_2():
    for flag in ("--reasoning-parser", "--tool-call-parser"):
        p = subprocess.run([sys.executable, "-m", "streamer", "serve", "--port", "0", flag, "nope"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert p.returncode == 2 and "invalid choice: 'nope'" in p.stderr and "Traceback" not in p.stderr


def test_live_mistral_keeps_special_tokens_in_the_text(live):
    """As vLLM: with the mistral parser (and tools) the text keeps special tokens, since [TOOL_CALLS] is one in
    Mistral's vocabularies. Here logit_bias makes the model write <|pad|>, a special token of this tokenizer."""
    pad = live.engine.tokenizer.pad_token_id
    kw = dict(model="llama", messages=MSG, tools=TOOLS, max_tokens=3, temperature=0.0,
              logit_bias={str(pad): 100}, extra_body={"ignore_eos": True})

    async def main():
        async with _client(live) as c:
            with _Parsers(live, None, "mistral"):
                kept = await c.chat.completions.create(**kw)
                without_tools = await c.chat.completions.create(**{k: v for k, v in kw.items() if k != "tools"})
            with _Parsers(live, None, "hermes"):
                hermes = await c.chat.completions.create(**kw)
            return kept, without_tools, hermes

    kept, without_tools, hermes = _run(main())
    assert kept.choices[0].message.content == "<|pad|>" * 3
    assert without_tools.choices[0].message.content == hermes.choices[0].message.content == ""


@pytest.mark.parametrize("parser, prompt, tags, reasoning", [
    ("seed_oss", "<seed:bos>assistant\n", ("<seed:think>", "</seed:think>"), "Let me see."),
    ("mistral", "[INST]hi[/INST]", ("[THINK]", "[/THINK]"), "Let me see [the] list."),  # (Magistral)
])
def test_parsers_with_their_own_tags(parser, prompt, tags, reasoning):
    """seed_oss and mistral read as qwen3, with their own tags; <think> is then plain text."""
    mode = reasoning_mode(parser, prompt, {})
    assert mode == ReasoningMode(True, inside=False, tags=tags)
    assert reasoning_mode(parser, prompt + tags[0], {}).inside
    assert not reasoning_mode(parser, prompt + "<think>", {}).inside
    text = f"{tags[0]}{reasoning}{tags[1]}The answer <think>x</think>."
    for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        s = mode.splitter()
        got = [s.feed(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == \
            (reasoning, "The answer <think>x</think>."), chunks
    assert mode.splitter().feed(tags[0][:3] + " is not a tag", final=True) == ("", tags[0][:3] + " is not a tag")


def test_live_mistral_reasoning_keeps_special_tokens(live):
    """Under the mistral reasoning parser the text keeps special tokens ([THINK] is one in Mistral's vocabularies):
    here the model is made to write <|pad|>, a special token of this tokenizer."""
    pad = live.engine.tokenizer.pad_token_id
    kw = dict(model="llama", messages=MSG, max_tokens=3, temperature=0.0, logit_bias={str(pad): 100},
              extra_body={"ignore_eos": True})

    async def main():
        async with _client(live) as c:
            with _Parsers(live, "mistral", None):
                kept = await c.chat.completions.create(**kw)
            with _Parsers(live, "qwen3", None):
                dropped = await c.chat.completions.create(**kw)
            return kept, dropped

    kept, dropped = _run(main())
    assert kept.choices[0].message.content == "<|pad|>" * 3 and dropped.choices[0].message.content is None

"""gpt-oss's harmony channels in chat output (server/harmony.py): the parser on whole texts and on every split of
them, the chat response shapes, the live server with the parsers named (`--reasoning-parser openai_gptoss`,
`--tool-call-parser openai`) and with a gpt-oss checkpoint, where they are on by default."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.server.harmony import HarmonyParser, parse_all
from tests.server_utils import LiveServer

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny."

# (text, tools, reasoning, content, [(name, arguments text)])
CASES = [
    (ANALYSIS + FINAL, True, "The user wants the weather.", "It is sunny.", []),
    (ANALYSIS + CALL, True, "The user wants the weather.", "", [("get_weather", '{"city": "Paris"}')]),
    (ANALYSIS + CALL + "<|call|>", True, "The user wants the weather.", "", [("get_weather", '{"city": "Paris"}')]),
    # the recipient in the role part, the content type without <|constrain|>; two calls
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
     "<|call|><|start|>assistant to=functions.g<|channel|>commentary<|message|> {\"x\": 1} ", True, "a", "",
     [("f", "{}"), ("g", '{"x": 1}')]),
    # a preamble on commentary (no recipient) is content; a built-in tool's message is not a function call
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>analysis to=browser.search"
     "<|message|>{\"q\": 1}<|end|>" + FINAL, True, "{\"q\": 1}", "Let me look.It is sunny.", []),
    # without tools in the request a call's body stays content
    (ANALYSIS + CALL, False, "The user wants the weather.", '{"city": "Paris"}', []),
    # cut short inside the reasoning, inside a header, or a model that ignores the format
    ("<|channel|>analysis<|message|>still thinking", True, "still thinking", "", []),
    (ANALYSIS + "<|start|>assistant<|chan", True, "The user wants the weather.", "", []),
    ("Just text.", True, "", "Just text.", []),
    ("", True, "", "", []),
    ("<|chan", True, "", "<|chan", []),
]


def _feed(parser, chunks):
    reasoning, content, calls = [], [], []
    for i, chunk in enumerate(chunks):
        r, c, k = parser.feed(chunk, final=i == len(chunks) - 1)
        reasoning.append(r)
        content.append(c)
        calls += k
    return "".join(reasoning), "".join(content), [(k["function"]["name"], k["function"]["arguments"]) for k in calls]


@pytest.mark.parametrize("text,tools,reasoning,content,calls", CASES)
def test_whole_and_every_split(text, tools, reasoning, content, calls):
    r, c, k = parse_all(text, tools)
    assert (r, c) == (reasoning, content)
    assert [(x["function"]["name"], x["function"]["arguments"]) for x in k] == calls
    assert [x["index"] for x in k] == list(range(len(calls))) and all(x["id"].startswith("call_") for x in k)
    for i in range(len(text) + 1):
        assert _feed(HarmonyParser(tools), [text[:i], text[i:]]) == (reasoning, content, calls), i
    assert _feed(HarmonyParser(tools), list(text) or [""]) == (reasoning, content, calls)


def test_a_call_comes_out_when_its_message_ends():
    """One character at a time: the call is emitted with the tag that ends its message (or at the end of the
    output, where gpt-oss's stop token <|call|> left it), never before."""
    text = ANALYSIS + CALL + "<|end|>" + FINAL
    parser = HarmonyParser()
    at = [i for i, ch in enumerate(text) if parser.feed(ch)[2]]
    assert at == [len(ANALYSIS + CALL + "<|end|>") - 1]
    parser = HarmonyParser()
    assert not any(parser.feed(ch)[2] for ch in ANALYSIS + CALL)
    assert len(parser.feed("", final=True)[2]) == 1


def test_no_tag_leaks_into_a_stream():
    """Streamed token by token, no piece of reasoning or content holds any part of a tag."""
    text = ANALYSIS + CALL + "<|call|>"
    parser = HarmonyParser()
    for i in range(0, len(text), 3):
        r, c, _ = parser.feed(text[i:i + 3])
        assert "<|" not in r + c and "|>" not in r + c


VOCAB = ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", "<|message|>", "<|end|>", "<|start|>",
         "assistant", "<|call|>", "<|return|>", "<|constrain|>", "json", "{}", "hi", " ", "<|", "|>"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_split_gives_the_whole_texts_answer(data):
    text = "".join(data.draw(st.lists(st.sampled_from(VOCAB), max_size=12)))
    tools = data.draw(st.booleans())
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=6))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    r, c, k = parse_all(text, tools)
    assert _feed(HarmonyParser(tools), chunks) == (r, c, [(x["function"]["name"], x["function"]["arguments"])
                                                          for x in k])


# ---------------------------------------------------------------------------------------------- live servers
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MSG = [{"role": "user", "content": "Weather in Paris?"}]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


async def _both(live, **kw):
    """The non-streamed message, and the streamed deltas joined: (reasoning, content, calls, finish)."""
    async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
        full = await c.chat.completions.create(model=live.model_name, messages=MSG, **kw)
        reasoning, content, calls, finish = "", "", [], None
        async for chunk in await c.chat.completions.create(model=live.model_name, messages=MSG, stream=True, **kw):
            d = chunk.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            calls += [(tc.function.name, json.loads(tc.function.arguments)) for tc in d.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
    return full, (reasoning, content, calls, finish)


def _forced(output, tools=True):
    # guided_choice makes the random model write exactly `output` (the test tokenizer spells the tags as text)
    kw = dict(max_tokens=300, temperature=0.0, extra_body={"guided_choice": [output]})
    return {**kw, "tools": TOOLS} if tools else kw


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir, jump_forward=False) as server:
        yield server


def test_live_named_parsers(live):
    """Another model's server with the parsers named reads the channels as gpt-oss's does."""
    output, reasoning, content, calls = ANALYSIS + CALL, "The user wants the weather.", None, [
        ("get_weather", {"city": "Paris"})]
    server = live.app.state.server
    server.reasoning_parser, server.tool_call_parser = "openai_gptoss", "openai"
    try:
        full, (s_reasoning, s_content, s_calls, s_finish) = _run(_both(live, **_forced(output)))
    finally:
        server.reasoning_parser = server.tool_call_parser = None
    m = full.choices[0].message
    assert m.model_extra["reasoning_content"] == reasoning == s_reasoning
    assert m.content == content and s_content == (content or "")
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in m.tool_calls or []] == calls == s_calls
    assert full.choices[0].finish_reason == s_finish == ("tool_calls" if calls else "stop")


@pytest.fixture(scope="module")
def gpt_oss_live(make_ckpt):
    with LiveServer(make_ckpt("gpt_oss", family="gpt_oss"), jump_forward=False) as server:
        yield server


def test_live_gpt_oss_reads_its_channels_by_default(gpt_oss_live):
    """A gpt-oss checkpoint, no parser flags: reasoning, content and calls come out of the channels, and the
    request keeps special tokens in its text (so that real gpt-oss tags, special tokens, are there to read)."""
    server = gpt_oss_live.app.state.server
    assert (server.reasoning_parser, server.tool_call_parser) == ("openai_gptoss", "openai")
    full, (s_reasoning, s_content, s_calls, _) = _run(_both(gpt_oss_live, **_forced(ANALYSIS + CALL)))
    m = full.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants the weather." == s_reasoning
    assert m.content is None and s_content == ""
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in m.tool_calls] == s_calls == [
        ("get_weather", {"city": "Paris"})]
    # include_reasoning false drops the analysis channel; without tools a call's arguments are content
    dropped, _ = _run(_both(gpt_oss_live, **{**_forced(ANALYSIS + FINAL),
                                              "extra_body": {"guided_choice": [ANALYSIS + FINAL],
                                                             "include_reasoning": False}}))
    assert dropped.choices[0].message.model_extra["reasoning_content"] is None
    assert dropped.choices[0].message.content == "It is sunny."
    no_tools, _ = _run(_both(gpt_oss_live, **_forced(ANALYSIS + CALL, tools=False)))
    assert no_tools.choices[0].message.content == '{"city": "Paris"}' and not no_tools.choices[0].message.tool_calls
    # The parsers switched off (as for a server started with other ones): the channels stay text.
    server.reasoning_parser = server.tool_call_parser = None
    try:
        plain, _ = _run(_both(gpt_oss_live, **_forced(ANALYSIS + FINAL)))
    finally:
        server.reasoning_parser, server.tool_call_parser = "openai_gptoss", "openai"
    assert plain.choices[0].message.content == ANALYSIS + FINAL

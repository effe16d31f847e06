"""/v1/messages with the real anthropic client: the same answer as the equivalent chat completion (system prompt,
turns, text blocks), streamed as Anthropic's events that add up to it; stop reasons and sequences; forced tool use
and a tool_result turn; output_config's JSON schema; thinking blocks from a reasoning parser and budget_tokens;
count_tokens; Anthropic's error bodies; x-api-key; every KV block comes back."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tests.server_utils import LiveServer, metric

GREEDY = {"temperature": 0.0}  # (the anthropic SDK no longer sends sampling fields: they go in extra_body)
KEY = "s3cret"
WEATHER = {"name": "get_weather", "description": "weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir, api_key=KEY) as server:
        yield server


def _clients(live: LiveServer) -> tuple[anthropic.AsyncAnthropic, openai.AsyncOpenAI]:
    return (anthropic.AsyncAnthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=60),
            openai.AsyncOpenAI(base_url=live.base_url, api_key=KEY, max_retries=0, timeout=60))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _assert_idle(live: LiveServer) -> None:
    state = live.wait_idle()
    assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == state["streams"] == 0


async def _streamed(a: anthropic.AsyncAnthropic, **kw):
    """(the events, the final message the SDK assembled from them)."""
    async with a.messages.stream(**kw) as s:
        events = [e async for e in s]
        return events, await s.get_final_message()


def test_same_answer_as_chat_streamed_and_not(live):
    cases = [  # (messages kwargs, the equivalent chat messages)
        ({"messages": [{"role": "user", "content": "hello"}]}, [{"role": "user", "content": "hello"}]),
        ({"system": "be brief", "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]},
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]),
        ({"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
          "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                       {"role": "user", "content": [{"type": "text", "text": "again"}]}]},
         [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]),
    ]

    async def main():
        a, o = _clients(live)
        for kwargs, messages in cases:
            chat = await o.chat.completions.create(model=live.model_name, messages=messages, max_tokens=10, **GREEDY)
            want = chat.choices[0].message.content
            r = await a.messages.create(model=live.model_name, max_tokens=10, extra_body=GREEDY, **kwargs)
            assert r.type == "message" and r.role == "assistant" and r.model == live.model_name
            assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
            assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
            u = r.usage
            assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
            assert u.output_tokens == chat.usage.completion_tokens and u.output_tokens_details is None
            assert u.cache_read_input_tokens > 0  # the chat request before it cached the prompt's blocks
            events, final = await _streamed(a, model=live.model_name, max_tokens=10, extra_body=GREEDY, **kwargs)
            types = [e.type for e in events]
            assert types[0] == "message_start" and types[-1] == "message_stop"
            deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            assert deltas == want == final.content[0].text and final.stop_reason == r.stop_reason
            assert final.usage.output_tokens == r.usage.output_tokens
            n = await a.messages.count_tokens(model=live.model_name, **kwargs)
            assert n.input_tokens == chat.usage.prompt_tokens
    _run(main())
    _assert_idle(live)


def test_stop_sequences(live):
    async def main():
        a, _ = _clients(live)
        free = await a.messages.create(model=live.model_name, max_tokens=12, extra_body=GREEDY,
                                       messages=[{"role": "user", "content": "hello"}])
        text = free.content[0].text
        stop = text[4:6]
        assert stop.strip() and stop not in text[:5], text
        r = await a.messages.create(model=live.model_name, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop],
                                    messages=[{"role": "user", "content": "hello"}])
        assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop and r.content[0].text == text[:4]
        _, final = await _streamed(a, model=live.model_name, max_tokens=12, extra_body=GREEDY,
                                   stop_sequences=[stop], messages=[{"role": "user", "content": "hello"}])
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
        assert final.content[0].text == text[:4]
    _run(main())


def test_forced_tool_use_and_its_result(live):
    async def main():
        a, o = _clients(live)
        ask = [{"role": "user", "content": "weather in Paris?"}]
        r = await a.messages.create(model=live.model_name, max_tokens=60, extra_body=GREEDY, messages=ask,
                                    tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
        use = r.content[0]
        assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id
        events, final = await _streamed(a, model=live.model_name, max_tokens=60, extra_body=GREEDY, messages=ask,
                                        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
        partial = "".join(e.delta.partial_json for e in events
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        assert json.loads(partial) == use.input == final.content[0].input and final.stop_reason == "tool_use"
        # "any": some tool, as chat's "required"
        r_any = await a.messages.create(model=live.model_name, max_tokens=60, extra_body=GREEDY, messages=ask,
                                        tools=[WEATHER], tool_choice={"type": "any"})
        assert [b.type for b in r_any.content] == ["tool_use"] and r_any.content[0].name == "get_weather"
        # The call and its result go back as blocks, rendered as the chat template renders tool turns.
        follow = await a.messages.create(
            model=live.model_name, max_tokens=6, extra_body=GREEDY, tools=[WEATHER], messages=[
                *ask, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                         "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
        chat = await o.chat.completions.create(
            model=live.model_name, max_tokens=6, **GREEDY, tools=[{"type": "function", "function": {
                "name": "get_weather", "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}}], messages=[
                *ask, {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function",
                       "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "sunny"}])
        assert follow.content[0].text == chat.choices[0].message.content
    _run(main())
    _assert_idle(live)


def test_output_config_json_schema(live):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}

    async def main():
        a, _ = _clients(live)
        return await a.messages.create(model=live.model_name, max_tokens=40, extra_body=GREEDY,
                                       messages=[{"role": "user", "content": "a number"}],
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
    r = _run(main())
    assert r.stop_reason == "end_turn" and isinstance(json.loads(r.content[0].text)["n"], int)


def test_thinking_blocks_and_budget(llama_dir):
    """deepseek_r1 reads the output as reasoning until </think>: a thinking block, then text; budget_tokens
    closes it after that many tokens (the same as thinking_token_budget on chat); display omitted blanks it."""
    with LiveServer(llama_dir, reasoning_parser="deepseek_r1") as live:
        async def main():
            a = anthropic.AsyncAnthropic(base_url=live.url, api_key="x", max_retries=0, timeout=60)
            o = openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=60)
            msgs = [{"role": "user", "content": "hello"}]
            thinking = {"type": "enabled", "budget_tokens": 3}
            chat = await o.chat.completions.create(model=live.model_name, messages=msgs, max_tokens=12, **GREEDY,
                                                   extra_body={"thinking_token_budget": 3})
            r = await a.messages.create(model=live.model_name, max_tokens=12, extra_body=GREEDY, messages=msgs,
                                        thinking=thinking)
            events, final = await _streamed(a, model=live.model_name, max_tokens=12, extra_body=GREEDY,
                                            messages=msgs, thinking=thinking)
            omitted = await a.messages.create(model=live.model_name, max_tokens=12, extra_body=GREEDY,
                                              messages=msgs, thinking={**thinking, "display": "omitted"})
            unbounded = await a.messages.create(model=live.model_name, max_tokens=12, extra_body=GREEDY,
                                                messages=msgs, thinking={"type": "adaptive"})
            return chat, r, events, final, omitted, unbounded

        chat, r, events, final, omitted, unbounded = _run(main())
        m = chat.choices[0].message
        assert [b.type for b in r.content] == ["thinking", "text"]
        assert r.content[0].thinking == m.model_extra["reasoning_content"] and r.content[1].text == m.content
        assert r.usage.output_tokens_details.thinking_tokens == 3
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
            [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content]
        assert "signature_delta" in [e.delta.type for e in events if e.type == "content_block_delta"]
        assert omitted.content[0].type == "thinking" and omitted.content[0].thinking == ""
        assert omitted.content[1].text == m.content
        # No budget: all 12 tokens are reasoning (the random model never closes it).
        assert [b.type for b in unbounded.content] == ["thinking"]
        assert unbounded.usage.output_tokens_details.thinking_tokens == 12 and unbounded.stop_reason == "max_tokens"
        _assert_idle(live)


@pytest.mark.parametrize("body, fragment", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens is required"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages must be a non-empty array"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     'messages[0].content[0] has type "document"'),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only custom tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "huge"}},
     "output_config.effort"),
])
def test_bad_requests_have_anthropic_error_bodies(live, body, fragment):
    r = httpx.post(live.url + "/v1/messages", json={"model": live.model_name, **body}, timeout=60,
                   headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"], err


def test_auth_and_unknown_model(live):
    async def main():
        wrong = anthropic.AsyncAnthropic(base_url=live.url, api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model=live.model_name, max_tokens=2,
                                        messages=[{"role": "user", "content": "x"}])
        a, _ = _clients(live)
        with pytest.raises(anthropic.NotFoundError) as e:
            await a.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "not_found_error"
    _run(main())
    _assert_idle(live)


def test_streams_dropped_mid_way_leak_nothing(live):
    """Clients that leave mid-stream (and one that never reads) abort their requests: every KV block comes back."""
    async def one(a: anthropic.AsyncAnthropic, i: int) -> int:
        seen = 0
        async with a.messages.stream(model=live.model_name, max_tokens=400, messages=[
                {"role": "user", "content": f"story {i}"}], extra_body={"ignore_eos": True, "temperature": 1.0}) as s:
            async for _ in s:
                seen += 1
                if seen == 3 + i % 4:
                    break
        return seen

    def aborts() -> float:
        text = httpx.get(live.url + "/metrics", headers={"x-api-key": KEY}, timeout=60).text
        return metric(text, "vllm:request_success_total", finished_reason="abort")

    async def main():
        a, _ = _clients(live)
        return await asyncio.gather(*(one(a, i) for i in range(8)))
    before = aborts()
    assert all(n >= 3 for n in _run(main()))
    _assert_idle(live)
    assert aborts() - before == 8  # each was aborted, not run to its 400 tokens

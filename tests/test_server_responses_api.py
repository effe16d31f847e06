"""/v1/responses with the real openai client: the same answer as the equivalent chat completion, streamed as typed
events that add up to it; instructions, input items, text.format, forced and parsed function calls; 4xx errors."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.server_utils import LiveServer

GREEDY = {"temperature": 0.0}
WEATHER = {"type": "function", "name": "get_weather", "description": "weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def live(llama_dir):
    with LiveServer(llama_dir) as server:
        yield server


def _run(coro):
    return asyncio.run(coro)


def _client(live: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)


async def _chat_text(c, live, messages, max_tokens):
    r = await c.chat.completions.create(model=live.model_name, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_same_answer_as_chat_streamed_and_not(live):
    async def main():
        c = _client(live)
        cases = [  # (responses kwargs, the equivalent chat messages)
            ({"input": "hello"}, [{"role": "user", "content": "hello"}]),
            ({"input": "2+2?", "instructions": "be brief"},
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]),
            ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]},
                        {"role": "developer", "content": "again"}]},
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
              {"role": "system", "content": "again"}]),
        ]
        for kwargs, messages in cases:
            want, finish = await _chat_text(c, live, messages, 10)
            r = await c.responses.create(model=live.model_name, max_output_tokens=10, **GREEDY, **kwargs)
            assert r.output_text == want and r.object == "response" and r.model == live.model_name
            assert r.status == ("incomplete" if finish == "length" else "completed")
            assert (r.incomplete_details is not None) == (finish == "length")
            assert r.usage.output_tokens == 10 if finish == "length" else r.usage.output_tokens <= 10
            assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
            stream = await c.responses.create(model=live.model_name, max_output_tokens=10, stream=True, **GREEDY,
                                              **kwargs)
            events = [e async for e in stream]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            types = [e.type for e in events]
            assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert types[-1] in ("response.completed", "response.incomplete")
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            done = next(e for e in events if e.type == "response.output_text.done")
            assert deltas == done.text == want == events[-1].response.output_text
            assert events[-1].response.usage.output_tokens == r.usage.output_tokens
    _run(main())


def test_text_format_and_forced_function_call(live):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}

    async def main():
        c = _client(live)
        r = await c.responses.create(model=live.model_name, input="a number", max_output_tokens=40, **GREEDY,
                                     text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
        assert isinstance(json.loads(r.output_text)["n"], int)
        for stream in (False, True):
            r = await c.responses.create(model=live.model_name, input="weather in Paris?", tools=[WEATHER],
                                         tool_choice={"type": "function", "name": "get_weather"},
                                         max_output_tokens=60, stream=stream, **GREEDY)
            if stream:
                events = [e async for e in r]
                assert "response.function_call_arguments.done" in [e.type for e in events]
                r = events[-1].response
            calls = [o for o in r.output if o.type == "function_call"]
            assert len(calls) == 1 and calls[0].name == "get_weather"
            assert isinstance(json.loads(calls[0].arguments)["city"], str)
            # The call and its output go back as input items (rendered as the chat template renders tool turns).
            follow = await c.responses.create(
                model=live.model_name, tools=[WEATHER], max_output_tokens=5, **GREEDY,
                input=[{"role": "user", "content": "weather in Paris?"},
                       {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                        "arguments": calls[0].arguments},
                       {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
            want, _ = await _chat_text(c, live, [
                {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}], 5)
            assert follow.output_text == want
    _run(main())


def test_bad_requests_are_4xx(live):
    async def main():
        c = _client(live)
        cases = [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                 ({"input": []}, "input"),
                 ({"input": [{"type": "image", "url": "x"}]}, "input"),
                 ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                 ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
                 ({"input": "x", "max_output_tokens": 0}, "max_tokens"),
                 ({"input": "x", "temperature": -1}, "temperature")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model=live.model_name, **kwargs)
            assert e.value.body["param"] == param, (kwargs, e.value.body)
        with pytest.raises(openai.NotFoundError):
            await c.responses.create(model="nope", input="x")
    _run(main())
    state = live.pool_state()
    assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == 0


def test_mixed_load_with_disconnects_leaks_nothing(live):
    """Streamed responses dropped mid-stream, embeddings and chat at once: every request ends and every KV block
    comes back."""
    import httpx

    async def main():
        c = _client(live)

        async def dropped(i: int) -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
                body = {"model": live.model_name, "input": f"story {i}", "max_output_tokens": 200, "stream": True,
                        "temperature": 1.0}
                async with http.stream("POST", "/v1/responses", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 4 + i % 3:  # leave after a few events
                            break

        async def full(i: int) -> None:
            r = await c.responses.create(model=live.model_name, input=f"hi {i}", max_output_tokens=6, **GREEDY)
            assert r.status in ("completed", "incomplete")

        async def embed(i: int) -> None:
            r = await c.embeddings.create(model=live.model_name, input=[f"text {i}", "more"])
            assert len(r.data) == 2

        await asyncio.gather(*(f(i) for i in range(6) for f in (dropped, full, embed)))
    _run(main())
    import time
    for _ in range(100):  # the server learns of a dropped stream on its own time: wait for it (10 s at most)
        state = live.pool_state()
        if state["streams"] == 0:
            break
        time.sleep(0.1)
    assert state["free"] == state["blocks"] and state["running"] == state["waiting"] == state["streams"] == 0

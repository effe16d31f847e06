"""/v1/responses with the real openai client: the same answer as the equivalent chat completion, streamed as typed
events that add up to it; instructions, input items, text.format, forced and parsed function calls; 4xx errors.
The store: retrieve / delete / input_items, previous_response_id (the conversation goes on, as the equivalent chat
shows), background responses and their cancellation, LRU eviction; every KV block comes back."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from streamer.server.response_store import ResponseStore, StoredResponse
from tests.server_utils import LiveServer

GREEDY = {"temperature": 0.0}
WEATHER = {"type": "function", "name": "get_weather", "description": "weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"]}}


# Background responses that are cancelled generate this many tokens unless stopped (the tiny model decodes one in
# about a millisecond, so they run for a minute: nothing finishes while a test holds it).
LONG = 60000


@pytest.fixture(scope="module")
def live(make_ckpt):
    long_dir = make_ckpt("server_disconnect_long", family="llama", max_position_embeddings=65536)
    with LiveServer(long_dir, num_kv_blocks=8192) as server:
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


def test_logprobs_match_chat_streamed_and_not(live):
    """include=["message.output_text.logprobs"] / top_logprobs: the output text's tokens with their logprobs and
    alternatives, as the equivalent chat completion scores them; streamed, the deltas carry them piece by piece."""
    messages = [{"role": "user", "content": "count"}]

    async def main():
        c = _client(live)
        chat = await c.chat.completions.create(model=live.model_name, messages=messages, max_tokens=8, logprobs=True,
                                               top_logprobs=3, **GREEDY)
        want = [(e.token, round(e.logprob, 4), [(t.token, round(t.logprob, 4)) for t in e.top_logprobs])
                for e in chat.choices[0].logprobs.content]
        assert len(want) == 8

        def entries(lps):
            return [(e.token, round(e.logprob, 4), [(t.token, round(t.logprob, 4)) for t in e.top_logprobs])
                    for e in lps]

        for kwargs in ({"include": ["message.output_text.logprobs"], "top_logprobs": 3}, {"top_logprobs": 3}):
            r = await c.responses.create(model=live.model_name, input="count", max_output_tokens=8, **GREEDY,
                                         **kwargs)
            part = r.output[0].content[0]
            assert entries(part.logprobs) == want and r.top_logprobs == 3
            assert "".join(e.token for e in part.logprobs) == part.text == chat.choices[0].message.content
            stream = await c.responses.create(model=live.model_name, input="count", max_output_tokens=8,
                                              stream=True, **GREEDY, **kwargs)
            events = [e async for e in stream]
            sent = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
            done = next(e for e in events if e.type == "response.output_text.done")
            assert entries(sent) == entries(done.logprobs) == want
            assert entries(events[-1].response.output[0].content[0].logprobs) == want
        # Only the chosen tokens without top_logprobs; none unless asked for.
        r = await c.responses.create(model=live.model_name, input="count", max_output_tokens=8, **GREEDY,
                                     include=["message.output_text.logprobs", "reasoning.encrypted_content"])
        assert [(e.token, round(e.logprob, 4), e.top_logprobs) for e in r.output[0].content[0].logprobs] == \
            [(t, lp, []) for t, lp, _ in want]
        r = await c.responses.create(model=live.model_name, input="count", max_output_tokens=8, **GREEDY)
        assert r.output[0].content[0].logprobs == []
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
                 ({"input": "x", "store": "yes"}, "store"),
                 ({"input": "x", "background": True, "store": False}, "background"),
                 ({"input": "x", "background": True, "stream": True}, "stream"),
                 ({"input": []}, "input"),
                 ({"input": [{"type": "image", "url": "x"}]}, "input"),
                 ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                 ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
                 ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                 ({"input": "x", "temperature": -1}, "temperature"),
                 ({"input": "x", "include": ["message.output_text.bogus"]}, "include"),
                 ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
                 ({"input": "x", "top_logprobs": 21}, "top_logprobs")]
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


# ---------------------------------------------------------------------------------------------- the store
def _assert_idle(live: LiveServer) -> None:
    state = live.wait_idle()
    assert state["free"] == state["blocks"]


async def _until(c: openai.AsyncOpenAI, rid: str, statuses: set[str]):
    """The stored response once its status is one of `statuses` (polled; 60 s at most)."""
    for _ in range(1200):
        r = await c.responses.retrieve(rid)
        if r.status in statuses:
            return r
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} stayed {r.status}")


def test_previous_response_id_continues_the_conversation(live):
    """Each turn is answered as the whole conversation would be by chat (same text, same prompt length), without
    the earlier turn's instructions; streamed turns are stored too, and input_items lists the conversation."""
    async def main():
        c = _client(live)
        first = await c.responses.create(model=live.model_name, input="hello", instructions="be brief",
                                         max_output_tokens=8, **GREEDY)
        assert first.store is True and first.previous_response_id is None
        second = await c.responses.create(model=live.model_name, input="and again", previous_response_id=first.id,
                                          max_output_tokens=8, **GREEDY)
        history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "and again"}]
        chat = await c.chat.completions.create(model=live.model_name, messages=history, max_tokens=8, **GREEDY)
        assert second.output_text == chat.choices[0].message.content
        assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
        assert second.previous_response_id == first.id and second.instructions is None

        stream = await c.responses.create(model=live.model_name, input="third", previous_response_id=second.id,
                                          max_output_tokens=8, stream=True, **GREEDY)
        third = [e async for e in stream][-1].response
        history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "third"}]
        want, _ = await _chat_text(c, live, history, 8)
        assert third.output_text == want and third.previous_response_id == second.id
        stored = await c.responses.retrieve(third.id)
        assert stored.output_text == want and stored.usage.input_tokens == third.usage.input_tokens

        # Every earlier turn's input and output, oldest first with order=asc (fetched 2 a page, following `after`).
        items = [i async for i in c.responses.input_items.list(third.id, order="asc", limit=2)]
        texts = [(i.role, i.content[0].text) for i in items]
        assert texts == [(m["role"], m["content"]) for m in history]
        assert items[1].id == first.output[0].id and len({i.id for i in items}) == len(items)
        newest = await c.responses.input_items.list(third.id, limit=2)
        assert [i.id for i in newest.data] == [items[-1].id, items[-2].id] and newest.has_more
    _run(main())
    _assert_idle(live)


def test_function_call_then_its_output_by_previous_response_id(live):
    async def main():
        c = _client(live)
        r = await c.responses.create(model=live.model_name, input="weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                     **GREEDY)
        call = next(o for o in r.output if o.type == "function_call")
        follow = await c.responses.create(model=live.model_name, tools=[WEATHER], max_output_tokens=5, **GREEDY,
                                          previous_response_id=r.id,
                                          input=[{"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "sunny"}])
        stateless = await c.responses.create(model=live.model_name, tools=[WEATHER], max_output_tokens=5, **GREEDY,
                                             input=[{"role": "user", "content": "weather in Paris?"},
                                                    {"type": "function_call", "call_id": call.call_id,
                                                     "name": "get_weather", "arguments": call.arguments},
                                                    {"type": "function_call_output", "call_id": call.call_id,
                                                     "output": "sunny"}])
        assert follow.output_text == stateless.output_text
        assert follow.usage.input_tokens == stateless.usage.input_tokens
        kinds = [i.type async for i in c.responses.input_items.list(follow.id, order="asc")]
        assert kinds == ["message", "function_call", "function_call_output"]

        # Text before a call (as a parser leaves it) and the call are one assistant turn, as in chat.
        said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]}
        r = await c.responses.create(model=live.model_name, tools=[WEATHER], max_output_tokens=5, **GREEDY,
                                     input=[{"role": "user", "content": "weather in Paris?"}, said,
                                            {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
        chat = await c.chat.completions.create(model=live.model_name, tools=[{"type": "function", "function": {
            k: WEATHER[k] for k in ("name", "description", "parameters")}}], max_tokens=5, **GREEDY, messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": "let me see", "tool_calls": [{"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
        assert r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens == chat.usage.prompt_tokens
    _run(main())


def test_retrieve_delete_store_false_and_unknown_ids(live):
    async def main():
        c = _client(live)
        r = await c.responses.create(model=live.model_name, input="keep me", max_output_tokens=4, **GREEDY)
        got = await c.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
        await c.responses.delete(r.id)
        for call in (c.responses.retrieve, c.responses.delete, c.responses.input_items.list):
            with pytest.raises(openai.NotFoundError) as e:
                await call(r.id)
            assert e.value.body["code"] == "response_not_found"
        with pytest.raises(openai.BadRequestError) as e:  # a deleted response cannot be continued
            await c.responses.create(model=live.model_name, input="x", previous_response_id=r.id)
        assert e.value.body["code"] == "previous_response_not_found"

        unstored = await c.responses.create(model=live.model_name, input="forget me", store=False,
                                            max_output_tokens=4, **GREEDY)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(unstored.id)
        kept = await c.responses.create(model=live.model_name, input="x", max_output_tokens=2, **GREEDY)
        with pytest.raises(openai.BadRequestError) as e:  # only background responses can be cancelled
            await c.responses.cancel(kept.id)
        assert e.value.body["param"] == "response_id"
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.input_items.list(kept.id, order="sideways")  # type: ignore[arg-type]
        assert e.value.body["param"] == "order"
    _run(main())
    _assert_idle(live)


def test_background_response_finishes_and_cancel_frees_its_blocks(live):
    async def main():
        c = _client(live)
        want = await c.responses.create(model=live.model_name, input="in the back", max_output_tokens=6, **GREEDY)
        r = await c.responses.create(model=live.model_name, input="in the back", max_output_tokens=6, background=True,
                                     **GREEDY)
        assert r.status in ("queued", "in_progress") and r.background and r.output == []
        done = await _until(c, r.id, {"completed", "incomplete", "failed"})
        assert done.output_text == want.output_text and done.usage.output_tokens == want.usage.output_tokens

        long = await c.responses.create(model=live.model_name, input="go on", max_output_tokens=LONG,
                                        background=True, extra_body={"ignore_eos": True})
        await _until(c, long.id, {"in_progress"})
        held = live.pool_state()
        assert held["running"] == 1 and held["free"] < held["blocks"]
        cancelled = await c.responses.cancel(long.id)
        assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < LONG
        assert (await c.responses.retrieve(long.id)).status == "cancelled"
        assert (await c.responses.cancel(long.id)).status == "cancelled"  # again: the same answer
        _assert_idle(live)

        # Deleting a running background response cancels it too.
        doomed = await c.responses.create(model=live.model_name, input="go on", max_output_tokens=LONG,
                                          background=True, extra_body={"ignore_eos": True})
        await _until(c, doomed.id, {"in_progress"})
        await c.responses.delete(doomed.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(doomed.id)
    _run(main())
    _assert_idle(live)


def test_lru_eviction_keeps_chains_whole(live):
    """A store of 2: older responses go, but a response keeps its whole conversation, so a chain goes on after its
    first link is evicted; a store of 0 keeps nothing (and refuses background responses)."""
    api = live.app.state.responses
    default = api.store

    async def main():
        c = _client(live)
        first = await c.responses.create(model=live.model_name, input="one", max_output_tokens=3, **GREEDY)
        second = await c.responses.create(model=live.model_name, input="two", previous_response_id=first.id,
                                          max_output_tokens=3, **GREEDY)
        await c.responses.create(model=live.model_name, input="other", max_output_tokens=3, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(first.id)
        third = await c.responses.create(model=live.model_name, input="three", previous_response_id=second.id,
                                         max_output_tokens=3, **GREEDY)
        texts = [i.content[0].text async for i in c.responses.input_items.list(third.id, order="asc")]
        assert texts == ["one", first.output_text, "two", second.output_text, "three"]

    live.call(lambda: setattr(api, "store", ResponseStore(2)))
    try:
        _run(main())
        live.call(lambda: setattr(api, "store", ResponseStore(0)))

        async def disabled():
            c = _client(live)
            r = await c.responses.create(model=live.model_name, input="x", max_output_tokens=2, **GREEDY)
            assert r.store is False
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(r.id)
            with pytest.raises(openai.BadRequestError) as e:
                await c.responses.create(model=live.model_name, input="x", background=True)
            assert "--responses-store-size" in e.value.body["message"]
        _run(disabled())
    finally:
        live.call(lambda: setattr(api, "store", default))


def test_store_bounds():
    def entry(rid: str, text: str = "x") -> StoredResponse:
        return StoredResponse({"id": rid, "output": []}, [{"type": "message", "content": text}])

    store = ResponseStore(max_count=2)
    for rid in "abc":
        store.put(entry(rid))
        store.get("a")  # a use keeps "a" recent
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    size = entry("a", "y" * 100).measure()
    store = ResponseStore(max_count=10, max_bytes=2 * size + size // 2)  # room for two
    for rid in "abcd":
        store.put(entry(rid, "y" * 100))
    assert len(store) == 2 and store.get("c") and store.get("d") and store.bytes == 2 * size
    assert store.pop("d") is not None and store.pop("d") is None
    assert store.bytes == store.get("c").size  # type: ignore[union-attr]
    nothing = ResponseStore(0)
    nothing.put(entry("a"))
    assert len(nothing) == 0 and not nothing.enabled
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_evicting_a_running_background_response_cancels_it():
    async def main():
        store = ResponseStore(1)
        running = StoredResponse({"id": "a", "output": []}, [])
        running.task = asyncio.ensure_future(asyncio.sleep(60))
        store.put(running)
        store.put(StoredResponse({"id": "b", "output": []}, []))
        await asyncio.wait({running.task}, timeout=60)
        assert running.task.cancelled()
    _run(main())


def test_serve_refuses_a_negative_store_size():
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "streamer", "serve", "--port", "0", "--responses-store-size", "-1"],
                       cwd=repo, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert p.returncode == 2 and "--responses-store-size must be >= 0" in p.stderr


def test_background_cancelled_before_it_starts_still_aborts_its_request():
    """The store may cancel a background generation in the tick that created it (evicted at once): the engine
    request is aborted all the same, and the response says "cancelled"."""
    from streamer.server.responses_api import ResponseBuilder, ResponsesAPI

    class FakeGeneration:
        closed: list = []

        def usage(self) -> dict:
            return {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}

        def close(self, reason=None) -> None:
            self.closed.append(reason)

    async def main():
        api = ResponsesAPI(None, store_size=1)  # type: ignore[arg-type]
        gen = FakeGeneration()
        builder = ResponseBuilder({"background": True}, "m", store=True)
        response = api._start_background(gen, None, builder, [])  # type: ignore[arg-type]
        entry = api.store.pop(response["id"])
        await asyncio.wait({entry.task})  # (as the cancel endpoint does: the entry is settled once it returns)
        assert gen.closed == ["cancelled"] and entry.response["status"] == "cancelled" and entry.task is None
    _run(main())

"""The load generator's HTTP/SSE client, driven byte by byte with a scripted clock: exact timings, any framing."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamer.bench.client as client
from streamer.bench.client import RawResponse, _Conn, interpret, sse_events
from streamer.bench.datasets import SampleRequest
from streamer.bench.runner import to_result


class FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True

    close = abort


def event(obj: Any, sep: bytes = b"\n") -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + sep + sep


def text(t: str, finish: Optional[str] = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def usage(p: int, c: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def drive(reads: list[tuple[float, bytes]], monkeypatch: pytest.MonkeyPatch, lose: bool = False) -> RawResponse:
    """Feeds `reads` (time, bytes) into a connection, with perf_counter returning each read's time."""
    async def go() -> RawResponse:
        conn = _Conn()
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        fut = conn.start(b"POST / HTTP/1.1\r\n\r\n")
        clock: Iterator[float] = iter(t for t, _ in reads)
        monkeypatch.setattr(client, "perf_counter", lambda: next(clock))
        for _, data in reads:
            conn.data_received(data)
        if lose:
            conn.connection_lost(None)
        return await fut

    return asyncio.run(go())


def test_exact_timings_from_read_times(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = [(1.0, HEAD_CHUNKED + chunked(event(text("a")))),
             (1.5, chunked(event(text("b")))),
             (1.75, chunked(event(text("c")) + event(text("d", "length")))),  # two events in one read
             (2.0, chunked(event(usage(9, 4)))),
             (2.25, chunked(event(b"[DONE]")) + b"0\r\n\r\n")]
    resp = drive(reads, monkeypatch)
    assert resp.complete and resp.status == 200 and not resp.error
    res, pending = to_result(resp, SampleRequest("p", 3, 4), sent=0.5)
    assert res.success and pending is None
    assert res.ttft == 0.5
    assert res.itl == [0.5, 0.25, 0.0]
    assert res.latency == 1.75
    assert (res.prompt_len, res.output_len, res.output_len_source) == (9, 4, "usage")
    assert res.tpot == pytest.approx(1.25 / 3)


def test_event_split_across_reads_gets_time_of_completing_read(monkeypatch: pytest.MonkeyPatch) -> None:
    e1, e2 = event(text("x")), event(text("y"))
    body = chunked(e1 + e2) + chunked(event(b"[DONE]")) + b"0\r\n\r\n"
    cut = len(chunked(b"")) // 2 + len(e1) + 3  # inside e2
    reads = [(1.0, HEAD_CHUNKED + body[:cut]), (2.0, body[cut:])]
    out = interpret(drive(reads, monkeypatch))
    assert out.token_times == [1.0, 2.0] and out.text == "xy" and out.done


def test_chat_role_and_finish_chunks_are_not_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    def delta(d: dict[str, Any], finish: Optional[str] = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    body = b"".join([event(delta({"role": "assistant", "content": ""})), event(delta({"content": "Hi"})),
                     event(delta({"content": ""})),  # e.g. a special token or held-back bytes: still a token
                     event(delta({"content": "!"})), event(delta({}, "stop")), event(b"[DONE]")])
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    out = interpret(drive([(1.0, head + body[:10]), (2.0, body[10:])], monkeypatch))
    assert out.text == "Hi!" and len(out.token_times) == 3 and out.completion_tokens is None


def test_crlf_separators_comments_and_multiline_data() -> None:
    body = (b": ping\r\n\r\n" + event(text("a"), b"\r\n")
            + b"event: x\ndata: {\"choices\": [{\"text\":\ndata: \"b\"}]}\n\n"
            + b"data: [DONE]")  # last event without its blank line
    events = sse_events(body)
    assert [d for _, d in events] == [json.dumps(text("a")).encode(), b'{"choices": [{"text":\n"b"}]}', b"[DONE]"]
    assert events[-1][0] == len(body)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), max_size=12), st.booleans())
def test_any_read_boundaries_give_the_same_stream(cuts: list[int], crlf: bool) -> None:
    sep = b"\r\n" if crlf else b"\n"
    body = b"".join(chunked(event(text(f"w{i} é"), sep)) for i in range(6)) + chunked(event(usage(1, 6), sep))
    raw = HEAD_CHUNKED + body + chunked(event(b"[DONE]", sep)) + b"0\r\n\r\n"
    points = sorted({min(c, len(raw) - 1) for c in cuts} | {0, len(raw)})
    reads = [(float(i), raw[a:b]) for i, (a, b) in enumerate(zip(points, points[1:]))]
    mp = pytest.MonkeyPatch()
    try:
        resp = drive(reads, mp)
    finally:
        mp.undo()
    out = interpret(resp)
    assert resp.complete and out.done and out.completion_tokens == 6
    assert out.text == "".join(f"w{i} é" for i in range(6))
    assert out.token_times == sorted(out.token_times) and len(out.token_times) == 6


def test_close_delimited_body(monkeypatch: pytest.MonkeyPatch) -> None:
    head = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"
    resp = drive([(1.0, head + event(text("a"))), (2.0, event(b"[DONE]"))], monkeypatch, lose=True)
    assert resp.complete and interpret(resp).done


def test_disconnect_mid_stream_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    resp = drive([(1.0, HEAD_CHUNKED + chunked(event(text("a"))))], monkeypatch, lose=True)
    res, _ = to_result(resp, SampleRequest("p", 1, 4), sent=0.0)
    assert not res.success and "closed the connection after the headers" in res.error


@pytest.mark.parametrize("reads,error", [
    ([b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 44\r\n\r\n"
      b'{"error": {"message": "queue full, retry"}} '], "HTTP 429: queue full, retry"),
    ([b"HTTP/1.1 500 Oops\r\ncontent-length: 4\r\n\r\nboom"], "HTTP 500: boom"),
    ([HEAD_CHUNKED + chunked(event(text("a")) + event({"error": {"message": "engine died"}}))],
     "error in stream: engine died"),
    ([HEAD_CHUNKED + chunked(event(text("a"))) + b"0\r\n\r\n"], "stream ended without data: [DONE]"),
    ([HEAD_CHUNKED + chunked(event(usage(1, 0)) + event(b"[DONE]")) + b"0\r\n\r\n"], "no token chunks"),
    ([HEAD_CHUNKED + chunked(b"data: {not json\n\n") + b"0\r\n\r\n"], "invalid JSON in stream"),
    ([b"HTTX 200\r\n\r\n"], "malformed status line"),
])
def test_failures_are_described(reads: list[bytes], error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    resp = drive([(1.0 + i, r) for i, r in enumerate(reads)], monkeypatch, lose=True)
    res, _ = to_result(resp, SampleRequest("p", 1, 4), sent=0.0)
    assert not res.success and error in res.error


def test_text_without_usage_is_left_for_the_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    resp = drive([(1.0, HEAD_CHUNKED + chunked(event(text("ab")) + event(text("cd")) + event(b"[DONE]"))
                   + b"0\r\n\r\n")], monkeypatch)
    res, pending = to_result(resp, SampleRequest("p", 5, 4), sent=0.0)
    assert res.success and pending == "abcd"
    assert (res.prompt_len, res.output_len, res.output_len_source) == (5, 2, "chunks")


def anthropic(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\n" + event({"type": kind, **fields})


def test_anthropic_messages_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """--endpoint messages: each content_block_delta is a token chunk (text, thinking, tool JSON alike), usage comes
    from message_start (input) and message_delta (output), message_stop ends it."""
    start = anthropic("message_start", message={"id": "m", "usage": {"input_tokens": 7, "output_tokens": 0}})
    block = anthropic("content_block_start", index=0, content_block={"type": "text", "text": ""})
    reads = [(1.0, HEAD_CHUNKED + chunked(start + block)),
             (1.25, chunked(anthropic("content_block_delta", index=0, delta={"type": "thinking_delta",
                                                                              "thinking": "hm"}))),
             (1.5, chunked(anthropic("content_block_delta", index=0, delta={"type": "text_delta", "text": "a"}))),
             (2.0, chunked(anthropic("content_block_delta", index=1, delta={"type": "input_json_delta",
                                                                             "partial_json": "{}"}))),
             (2.5, chunked(anthropic("content_block_stop", index=1)
                           + anthropic("message_delta", delta={"stop_reason": "max_tokens"},
                                       usage={"output_tokens": 3}))),
             (3.0, chunked(anthropic("message_stop")) + b"0\r\n\r\n")]
    resp = drive(reads, monkeypatch)
    out = interpret(resp, messages=True)
    assert out.done and not out.error and out.text == "hma{}"
    assert out.token_times == [1.25, 1.5, 2.0]
    res, pending = to_result(resp, SampleRequest("p", 1, 3), sent=1.0, endpoint="messages")
    assert res.success and pending is None
    assert (res.ttft, res.itl, res.latency) == (0.25, [0.25, 0.5], 2.0)
    assert (res.prompt_len, res.output_len, res.output_len_source) == (7, 3, "usage")
    # no message_stop: a broken stream; an error event: its message
    cut = drive(reads[:-1] + [(3.0, b"0\r\n\r\n")], monkeypatch)
    assert to_result(cut, SampleRequest("p", 1, 3), 1.0, "messages")[0].error == "stream ended without message_stop"
    busy = anthropic("error", error={"type": "overloaded_error", "message": "busy"})
    err = drive([(1.0, HEAD_CHUNKED + chunked(start + busy) + b"0\r\n\r\n")], monkeypatch)
    assert to_result(err, SampleRequest("p", 1, 3), 1.0, "messages")[0].error == "error in stream: busy"

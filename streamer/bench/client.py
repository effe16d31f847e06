"""A small HTTP/1.1 keep-alive client on asyncio protocols, built for load generation.

Why not httpx/aiohttp: the generator must not be the bottleneck. Here a read costs one timestamp plus body
de-framing; SSE events and their JSON are parsed once per request, after the stream ends, and each event gets
the timestamp of the read that completed it. All clients share one event loop (uvloop when available).
"""
from __future__ import annotations

import asyncio
import json
import re
import ssl
from bisect import bisect_left
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

try:  # faster JSON when present; never required
    import orjson

    _loads: Callable[[bytes], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

_MAX_HEADER = 64 * 1024
_MAX_ERROR_BODY = 4096
# States of the chunked-transfer decoder.
_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


@dataclass(slots=True)
class RawResponse:
    """One response as received: de-framed body plus (time, body length) for every read that grew it."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    read_times: list[float] = field(default_factory=list)
    read_ends: list[int] = field(default_factory=list)
    error: str = ""  # transport-level failure (connect, timeout, disconnect mid-body)
    complete: bool = False  # body framing ended properly

    def time_at(self, offset: int) -> float:
        """Time of the read that delivered body byte `offset - 1` (i.e. completed everything before offset)."""
        i = bisect_left(self.read_ends, offset)
        return self.read_times[min(i, len(self.read_times) - 1)]


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self.used = False  # has carried a request before (a stale keep-alive may fail; retry once)
        self._fut: Optional[asyncio.Future[RawResponse]] = None
        self._resp = RawResponse()
        self._head = bytearray()
        self._in_body = False
        self._mode = ""  # "chunked" | "length" | "close"
        self._left = 0  # bytes left of the current chunk / of Content-Length
        self._cstate = _SIZE
        self._cbuf = bytearray()
        self._keep_alive = True

    # asyncio.Protocol callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        if self._fut is None or self._fut.done():
            return
        if self._in_body and self._mode == "close":
            self._finish()
        else:
            got = "after the headers" if self._in_body else "before the response"
            self._fail(f"server closed the connection {got}" + (f" ({exc})" if exc else ""))

    def data_received(self, data: bytes) -> None:
        t = perf_counter()
        if self._fut is None or self._fut.done():
            return  # bytes after a finished response: ignore (the connection will not be reused)
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEADER:
                    self._fail("response headers too large")
                return
            rest = bytes(self._head[end + 4:])
            if not self._parse_head(bytes(self._head[:end])):
                return
            data = rest
            if self._mode == "length" and self._left == 0:
                self._finish()
                return
        self._feed_body(data, t)

    # request side -------------------------------------------------------------------------------
    def start(self, payload: bytes) -> "asyncio.Future[RawResponse]":
        assert self.transport is not None
        self._fut = asyncio.get_running_loop().create_future()
        self._resp = RawResponse()
        self._head.clear()
        self._cbuf.clear()
        self._in_body, self._mode, self._left, self._cstate, self._keep_alive = False, "", 0, _SIZE, True
        self.used = True
        self.transport.write(payload)
        return self._fut

    def abort(self, reason: str) -> None:
        self._fail(reason)
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self.closed and self.transport is not None and not self.transport.is_closing()

    # parsing ------------------------------------------------------------------------------------
    def _parse_head(self, head: bytes) -> bool:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            self._fail(f"malformed status line {lines[0][:80]!r}")
            return False
        resp = self._resp
        resp.status = int(parts[1])
        for line in lines[1:]:
            k, _, v = line.partition(":")
            resp.headers[k.strip().lower()] = v.strip()
        if resp.headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self._keep_alive = False
        if "chunked" in resp.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in resp.headers:
            self._mode, self._left = "length", int(resp.headers["content-length"])
        else:
            self._mode, self._keep_alive = "close", False
        self._in_body = True
        return True

    def _feed_body(self, data: bytes, t: float) -> None:
        resp = self._resp
        before = len(resp.body)
        if self._mode == "chunked":
            done = self._dechunk(data)
        elif self._mode == "length":
            resp.body += data[: self._left]
            self._left -= min(len(data), self._left)
            done = self._left == 0
        else:
            resp.body += data
            done = False
        if len(resp.body) > before:
            resp.read_times.append(t)
            resp.read_ends.append(len(resp.body))
        if done:
            self._finish()

    def _dechunk(self, data: bytes) -> bool:
        """Incremental Transfer-Encoding: chunked decoder; returns True at the terminal chunk."""
        buf, body = self._cbuf, self._resp.body
        buf += data
        pos = 0
        while pos < len(buf):
            if self._cstate == _SIZE:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(bytes(buf[pos:nl]).split(b";", 1)[0].strip() or b"0", 16)
                pos = nl + 2
                self._left, self._cstate = size, (_DATA if size else _TRAILER)
            elif self._cstate == _DATA:
                take = min(self._left, len(buf) - pos)
                body += buf[pos:pos + take]
                pos += take
                self._left -= take
                if self._left == 0:
                    self._cstate = _CRLF
            elif self._cstate == _CRLF:
                if len(buf) - pos < 2:
                    break
                pos += 2
                self._cstate = _SIZE
            else:  # _TRAILER: zero or more header lines, then an empty line
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                if nl == pos:
                    self._cstate = _DONE
                    del buf[:]
                    return True
                pos = nl + 2
        del buf[:pos]
        return False

    def _finish(self) -> None:
        self._resp.complete = True
        if self._fut is not None and not self._fut.done():
            self._fut.set_result(self._resp)

    def _fail(self, reason: str) -> None:
        self._keep_alive = False
        if self._fut is not None and not self._fut.done():
            self._resp.error = reason
            self._fut.set_result(self._resp)


class HttpClient:
    """Keep-alive connection pool to one origin; every call returns a RawResponse (errors inside it)."""

    def __init__(self, base_url: str, *, timeout: float, api_key: Optional[str] = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port][/path], got {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        path = u.path.rstrip("/")
        self.prefix = path if path.endswith("/v1") else path + "/v1"  # OpenAI routes live under /v1
        self.ssl: Optional[ssl.SSLContext] = ssl.create_default_context() if u.scheme == "https" else None
        self.timeout = timeout
        host_hdr = u.netloc.rpartition("@")[2]
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self._common = (f"Host: {host_hdr}\r\nUser-Agent: streamer-bench\r\nAccept: */*\r\n{auth}").encode()
        self._idle: list[_Conn] = []

    def url(self, path: str, root: bool = False) -> str:
        """`root`: a path beside /v1, not under it (vLLM's /reset_prefix_cache)."""
        return f"{self.prefix.removesuffix('/v1') if root else self.prefix}{path}"

    async def post(self, path: str, body: bytes, root: bool = False,
                   content_type: str = "application/json") -> RawResponse:
        """`content_type`: the body's (e.g. "multipart/form-data; boundary=..." for an upload); JSON by default."""
        head = (f"POST {self.url(path, root)} HTTP/1.1\r\n").encode() + self._common
        head += b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (content_type.encode("latin-1"), len(body))
        return await self._send(head + body)

    async def get(self, path: str) -> RawResponse:
        return await self._send(f"GET {self.url(path)} HTTP/1.1\r\n".encode() + self._common + b"\r\n")

    async def _send(self, payload: bytes) -> RawResponse:
        for _attempt in range(2):
            try:
                conn = await self._acquire()
            except (OSError, asyncio.TimeoutError) as e:
                return RawResponse(error=f"connect failed: {type(e).__name__}: {e}")
            reused = conn.used
            resp = await self._exchange(conn, payload)
            # A keep-alive connection the server closed while idle fails before any byte: retry once, fresh.
            if reused and resp.error and resp.status == 0 and not resp.body:
                continue
            return resp
        return resp

    async def _exchange(self, conn: _Conn, payload: bytes) -> RawResponse:
        loop = asyncio.get_running_loop()
        fut = conn.start(payload)
        timer = loop.call_later(self.timeout, conn.abort, f"timed out after {self.timeout:g} s")
        try:
            resp = await fut
        except asyncio.CancelledError:
            conn.abort("cancelled")
            raise
        finally:
            timer.cancel()
        if conn.reusable and resp.complete and not resp.error:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()
        return resp

    async def _acquire(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl,
                                   server_hostname=self.host if self.ssl else None),
            timeout=self.timeout)
        return conn

    async def close(self) -> None:
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()


# --- SSE ------------------------------------------------------------------------------------------
_LINE = re.compile(rb"([^\r\n]*)(\r\n|\r|\n)")


def sse_events(body: bytes) -> list[tuple[int, bytes]]:
    """(end offset, data) of every SSE event in `body`; multi-line data joined by newlines, comments dropped."""
    events: list[tuple[int, bytes]] = []
    data: list[bytes] = []
    end = 0
    for m in _LINE.finditer(body):
        line = m.group(1)
        end = m.end()
        if not line:
            if data:
                events.append((end, b"\n".join(data)))
                data = []
        elif line.startswith(b"data:"):
            v = line[5:]
            data.append(v[1:] if v[:1] == b" " else v)
    tail = body[end:]
    if tail.startswith(b"data:"):  # a last line without its newline
        data.append(tail[6:] if tail[5:6] == b" " else tail[5:])
    if data:  # a last event without its blank line: accept it rather than lose the [DONE]
        events.append((len(body), b"\n".join(data)))
    return events


@dataclass(slots=True)
class StreamOutcome:
    """What one OpenAI streaming response said, with arrival times of its token-carrying chunks."""

    token_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    done: bool = False  # saw `data: [DONE]`
    end_time: float = 0.0  # arrival of the last event
    error: str = ""


def interpret(resp: RawResponse, messages: bool = False) -> StreamOutcome:
    """Turn a completed 200 response into token times, text and usage (completions and chat alike; `messages`:
    Anthropic's Messages API events instead, `interpret_messages`).

    A chunk counts as a token chunk when it has choices and carries text, or carries none while not being a
    role announcement or a bare finish (special tokens and held-back bytes arrive as empty text).
    """
    if messages:
        return interpret_messages(resp)
    out = StreamOutcome()
    parts: list[str] = []
    for obj in _json_events(resp, out):
        if "error" in obj or obj.get("object") == "error":
            out.error = "error in stream: " + _error_text(obj)
            return out
        usage = obj.get("usage")
        if isinstance(usage, dict):
            out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
            out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
        choices = obj.get("choices")
        if choices:
            ch = choices[0]
            delta = ch.get("delta")
            text = (delta.get("content") if isinstance(delta, dict) else ch.get("text")) or ""
            if text or not (ch.get("finish_reason") or (isinstance(delta, dict) and "role" in delta)):
                out.token_times.append(out.end_time)
                parts.append(text)
    if not out.error:
        out.text = "".join(parts)
    return out


def _json_events(resp: RawResponse, out: StreamOutcome) -> Iterator[dict[str, Any]]:
    """An OpenAI-style stream's JSON objects in order, each with `out.end_time` at its arrival; `data: [DONE]`
    sets `out.done`. Data that is not JSON sets `out.error` and ends the stream."""
    for end, data in sse_events(bytes(resp.body)):
        out.end_time = resp.time_at(end)
        if data == b"[DONE]":
            out.done = True
            continue
        try:
            obj = _loads(data)
        except ValueError:
            out.error = f"invalid JSON in stream: {data[:120]!r}"
            return
        if isinstance(obj, dict):
            yield obj


def interpret_messages(resp: RawResponse) -> StreamOutcome:
    """Anthropic's stream: each `content_block_delta` (text, thinking or a tool call's JSON) is a token chunk;
    `message_start` carries the prompt's tokens, `message_delta` the output's, `message_stop` ends it (no [DONE])."""
    out = StreamOutcome()
    parts: list[str] = []
    for end, data in sse_events(bytes(resp.body)):
        out.end_time = resp.time_at(end)
        try:
            obj = _loads(data)
        except ValueError:
            out.error = f"invalid JSON in stream: {data[:120]!r}"
            return out
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == "error":
            out.error = "error in stream: " + _error_text(obj)
            return out
        if kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            out.prompt_tokens = usage.get("input_tokens", out.prompt_tokens)
        elif kind == "message_delta":
            out.completion_tokens = (obj.get("usage") or {}).get("output_tokens", out.completion_tokens)
        elif kind == "message_stop":
            out.done = True
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            out.token_times.append(out.end_time)
            parts.append(delta.get("text") or delta.get("thinking") or delta.get("partial_json") or "")
    out.text = "".join(parts)
    return out


def interpret_transcription(resp: RawResponse) -> StreamOutcome:
    """A transcription's answer. Streamed (OpenAI's events): every `transcript.text.delta` with text is a token
    chunk, `transcript.text.done` (or `data: [DONE]`) ends it; vLLM's chat-style chunks (`choices[0].delta.content`,
    usage with token counts) are read too. A JSON answer (a server that does not stream) is one chunk: its text,
    at the read that completed it."""
    out = StreamOutcome()
    body = bytes(resp.body)
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            obj = json.loads(body)
        except ValueError:
            out.error = f"neither an event stream nor JSON: {body[:120]!r}"
            return out
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            out.error = "no text in the response" if not isinstance(obj, dict) or "error" not in obj else \
                "error in response: " + _error_text(obj)
            return out
        out.end_time = resp.read_times[-1] if resp.read_times else 0.0
        out.text, out.done = obj["text"], True
        if out.text:
            out.token_times.append(out.end_time)
        _transcription_usage(out, obj.get("usage"))
        return out
    parts: list[str] = []
    final: Optional[str] = None
    for obj in _json_events(resp, out):
        kind = obj.get("type")
        if "error" in obj or obj.get("object") == "error" or kind == "error":
            out.error = "error in stream: " + _error_text(obj)
            return out
        _transcription_usage(out, obj.get("usage"))
        text = ""
        if kind == "transcript.text.delta":
            text = obj.get("delta") or ""
        elif kind == "transcript.text.done":
            out.done = True
            final = obj.get("text") if isinstance(obj.get("text"), str) else None
            if final and not parts:  # the whole text at once (a server that sends no deltas)
                text = final
        elif obj.get("choices"):  # vLLM's transcription chunks
            delta = obj["choices"][0].get("delta")
            text = (delta.get("content") if isinstance(delta, dict) else None) or ""
        if text:
            out.token_times.append(out.end_time)
            parts.append(text)
    if not out.error:
        out.text = "".join(parts) if parts or final is None else final
    return out


def _transcription_usage(out: StreamOutcome, usage: Any) -> None:
    """Token counts where the usage has them (vLLM's); OpenAI's `{"type": "duration", "seconds": N}` has none."""
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens", usage.get("input_tokens")), int):
            out.prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
        if isinstance(usage.get("completion_tokens", usage.get("output_tokens")), int):
            out.completion_tokens = usage.get("completion_tokens", usage.get("output_tokens"))


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


def error_of(resp: RawResponse) -> str:
    """A one-line description of a failed (non-200 or broken) response."""
    if resp.error:
        return resp.error
    text = bytes(resp.body[:_MAX_ERROR_BODY]).decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            text = _error_text(obj)
    except ValueError:
        pass
    return f"HTTP {resp.status}: {' '.join(text.split())[:300]}"

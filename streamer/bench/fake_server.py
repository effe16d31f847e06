"""A scripted OpenAI-compatible streaming server on raw asyncio, for tests and the load generator's self-benchmark.

Each request gets a Plan (status, text pieces, delay before each piece, usage, mid-stream disconnect or error)
from a script function; by default it streams max_tokens one-token pieces instantly. /v1/audio/transcriptions
takes OpenAI's multipart form (a WAV `file`) and streams `transcript.text.delta` events (by default one word per
second of audio), then `transcript.text.done` with a duration usage, then [DONE]; with stream=false, one JSON
answer. Its script sees the form as a dict: the text fields plus `file` (name, content type, WAV parameters,
seconds and a SHA-1 of the bytes). Responses use chunked transfer encoding and keep-alive, as uvicorn does.
`python -m streamer.bench.fake_server --port P` serves the instant script (optionally with --ttft-ms/--itl-ms
delays) until interrupted.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import math
import threading
import wave
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass
class Plan:
    status: int = 200
    pieces: Optional[Sequence[str]] = None  # text of each token chunk; None: max_tokens pieces " t0", " t1", ...
    delays: Sequence[float] = ()  # seconds before piece i (i = 0 is before the first token); missing = 0
    done_delay: float = 0.0  # seconds between the last piece and the usage chunk / [DONE]
    usage: Optional[bool] = None  # None: as stream_options.include_usage asks
    prompt_tokens: Optional[int] = None  # None: whitespace words of the prompt
    completion_tokens: Optional[int] = None  # None: number of pieces
    disconnect_after: Optional[int] = None  # drop the connection after this many pieces
    error_after: Optional[int] = None  # send an error event after this many pieces (then [DONE])
    error_body: str = '{"error": {"message": "scripted failure", "type": "server_error"}}'


Script = Callable[[int, dict[str, Any]], Plan]


def instant(_i: int, _body: dict[str, Any]) -> Plan:
    return Plan()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog")
TRANSCRIPTIONS = "/v1/audio/transcriptions"


def transcript_pieces(form: dict[str, Any]) -> list[str]:
    """The default transcript of an upload: one word per (started) second of audio, the first without a space."""
    n = max(1, math.ceil((form.get("file") or {}).get("seconds", 1.0)))
    return [("" if i == 0 else " ") + _WORDS[i % len(_WORDS)] for i in range(n)]


def parse_form(content_type: str, raw: bytes) -> dict[str, Any]:
    """A multipart/form-data body as {field: text} plus, for a file part, {field: {"filename", "content_type",
    "bytes", "sha1", and for a WAV "rate", "channels", "sampwidth", "seconds"}}. ValueError for a malformed body."""
    ctype, _, params = content_type.partition(";")
    if ctype.strip().lower() != "multipart/form-data":
        raise ValueError("the request must be multipart/form-data")
    boundary = next((v.strip().strip('"') for k, _, v in (x.partition("=") for x in params.split(";"))
                     if k.strip().lower() == "boundary"), "")
    if not boundary:
        raise ValueError("multipart/form-data without a boundary")
    sep = b"--" + boundary.encode()
    chunks = raw.split(sep)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise ValueError("the multipart body does not end with its closing boundary")
    form: dict[str, Any] = {}
    for part in chunks[1:-1]:
        if not part.startswith(b"\r\n") or not part.endswith(b"\r\n"):
            raise ValueError("a multipart part is not framed by CRLFs")
        head, sep2, data = part[2:-2].partition(b"\r\n\r\n")
        if not sep2:
            raise ValueError("a multipart part has no header end")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (ln.partition(":") for ln in head.decode("utf-8").split("\r\n"))}
        disp = dict((k.strip().lower(), v.strip().strip('"')) for k, _, v in
                    (x.partition("=") for x in headers.get("content-disposition", "").split(";")[1:]))
        name = disp.get("name")
        if not name:
            raise ValueError("a multipart part has no name")
        if "filename" not in disp:
            form[name] = data.decode("utf-8")
            continue
        info: dict[str, Any] = {"filename": disp["filename"], "content_type": headers.get("content-type", ""),
                                "bytes": len(data), "sha1": hashlib.sha1(data).hexdigest()}
        try:
            with wave.open(io.BytesIO(data), "rb") as w:
                info.update(rate=w.getframerate(), channels=w.getnchannels(), sampwidth=w.getsampwidth(),
                            seconds=w.getnframes() / w.getframerate())
        except (wave.Error, EOFError) as e:
            info["wav_error"] = str(e)
        form[name] = info
    return form


class _Stream:
    """Renders one plan as OpenAI SSE chunks for the completions or chat endpoint."""

    def __init__(self, plan: Plan, body: dict[str, Any], chat: bool, model: str) -> None:
        self.plan, self.chat, self.model = plan, chat, model
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        self.pieces = list(plan.pieces) if plan.pieces is not None else [f" t{i}" for i in range(n)]
        prompt = body["messages"][-1].get("content", "") if chat and body.get("messages") else body.get("prompt", "")
        self.prompt_tokens = plan.prompt_tokens if plan.prompt_tokens is not None else len(str(prompt).split())
        want = (body.get("stream_options") or {}).get("include_usage", False)
        self.usage = plan.usage if plan.usage is not None else bool(want)
        self.head = {"id": "cmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": model}

    def piece(self, i: int) -> bytes:
        last = i == len(self.pieces) - 1 and not self.chat
        if self.chat:
            choice = {"index": 0, "delta": {"content": self.pieces[i]}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": self.pieces[i], "logprobs": None, "finish_reason": "length" if last else None}
        out = b""
        if i == 0 and self.chat:  # OpenAI and vLLM announce the role first
            out = _event({**self.head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None}]})
        return out + _event({**self.head, "choices": [choice]})

    def tail(self) -> bytes:
        out = b""
        if self.chat:
            out += _event({**self.head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if self.usage:
            c = self.plan.completion_tokens if self.plan.completion_tokens is not None else len(self.pieces)
            out += _event({**self.head, "choices": [], "usage": {
                "prompt_tokens": self.prompt_tokens, "completion_tokens": c, "total_tokens": self.prompt_tokens + c}})
        return out + _DONE


class _TranscriptStream:
    """Renders one plan as OpenAI's transcription events (same interface as _Stream, for the pacing loop)."""

    def __init__(self, plan: Plan, form: dict[str, Any]) -> None:
        self.plan = plan
        self.pieces = list(plan.pieces) if plan.pieces is not None else transcript_pieces(form)
        self.seconds = math.ceil(form["file"].get("seconds", 0.0))

    def piece(self, i: int) -> bytes:
        return _event({"type": "transcript.text.delta", "delta": self.pieces[i], "logprobs": None})

    def text(self) -> str:
        return "".join(self.pieces)

    def usage(self) -> dict[str, Any]:
        return {"type": "duration", "seconds": self.seconds}

    def tail(self) -> bytes:
        return _event({"type": "transcript.text.done", "text": self.text(), "logprobs": None,
                       "usage": self.usage()}) + _DONE


class _Proto(asyncio.Protocol):
    def __init__(self, server: "FakeServer") -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: Optional[asyncio.Transport] = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        """Serve the next complete request in the buffer, if any (one at a time per connection)."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        size = int(headers.get("content-length", "0"))
        if len(self.buf) < end + 4 + size:
            return
        body = bytes(self.buf[end + 4:end + 4 + size])
        del self.buf[:end + 4 + size]
        method, path = (lines[0].split(" ") + ["", ""])[:2]
        self.busy = True
        self.server.route(self, method, path, headers, body)

    def done(self) -> None:
        self.busy = False
        if self.buf:
            self._next()

    def send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        assert self.transport is not None
        reason = _REASONS.get(status, "Status")
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, reason.encode(), ctype.encode(), len(body), body))
        self.done()

    def start_stream(self) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")


class FakeServer:
    """An OpenAI-compatible fake on 127.0.0.1; `with FakeServer(script) as s:` runs it on a thread."""

    def __init__(self, script: Script = instant, *, host: str = "127.0.0.1", port: int = 0, model: str = "fake",
                 api_key: Optional[str] = None, record: bool = True, max_model_len: Optional[int] = None) -> None:
        """max_model_len: reported in GET /v1/models (as vLLM and streamer do) when given."""
        self.script, self.host, self.port, self.model, self.api_key = script, host, port, model, api_key
        self.record, self.max_model_len = record, max_model_len
        self.received: list[dict[str, Any]] = []  # request bodies, in arrival order
        self.count = 0
        self.in_flight = self.max_in_flight = 0  # streaming requests being answered (for concurrency checks)
        self._server: Optional[asyncio.AbstractServer] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # routing ------------------------------------------------------------------------------------
    def route(self, proto: _Proto, method: str, path: str, headers: dict[str, str], raw: bytes) -> None:
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return proto.send(401, b'{"error": {"message": "bad api key"}}')
        if method == "GET" and path in ("/health", "/v1/health"):
            return proto.send(200, b"")
        if method == "GET" and path == "/v1/models":
            card: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "streamer"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return proto.send(200, json.dumps({"object": "list", "data": [card]}).encode())
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions", TRANSCRIPTIONS):
            return proto.send(404, b'{"error": {"message": "not found"}}')
        try:
            if path == TRANSCRIPTIONS:
                body = parse_form(headers.get("content-type", ""), raw)
                if not isinstance(body.get("file"), dict) or "seconds" not in body["file"]:
                    raise ValueError("`file` (a WAV file part) is required")
            else:
                body = json.loads(raw)
        except ValueError as e:
            msg = str(e) if path == TRANSCRIPTIONS else "invalid JSON"
            return proto.send(400, json.dumps({"error": {"message": msg}}).encode())
        index = self.count
        self.count += 1
        if self.record:
            self.received.append(body)
        plan = self.script(index, body)
        if plan.status != 200:
            return proto.send(plan.status, plan.error_body.encode())
        stream: Any
        if path == TRANSCRIPTIONS:
            stream = _TranscriptStream(plan, body)
            if body.get("stream", "false").lower() not in ("true", "1"):  # one JSON answer, after the delays
                task = asyncio.get_running_loop().create_task(self._whole(proto, stream))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return None
        else:
            stream = _Stream(plan, body, path.endswith("chat/completions"), self.model)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if not plan.delays and not plan.done_delay and plan.disconnect_after is None and plan.error_after is None:
            proto.start_stream()  # instant: the whole response in one write
            assert proto.transport is not None
            proto.transport.write(b"".join(stream.piece(i) for i in range(len(stream.pieces))) + stream.tail())
            self.in_flight -= 1
            return proto.done()
        task = asyncio.get_running_loop().create_task(self._paced(proto, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _whole(self, proto: _Proto, s: _TranscriptStream) -> None:
        delay = sum(s.plan.delays) + s.plan.done_delay
        if delay:
            await asyncio.sleep(delay)
        proto.send(200, json.dumps({"text": s.text(), "usage": s.usage()}).encode())

    async def _paced(self, proto: _Proto, s: Any) -> None:
        try:
            await self._paced_inner(proto, s)
        finally:
            self.in_flight -= 1

    async def _paced_inner(self, proto: _Proto, s: Any) -> None:
        plan, tr = s.plan, proto.transport
        assert tr is not None
        proto.start_stream()
        for i in range(len(s.pieces)):
            if plan.disconnect_after is not None and i >= plan.disconnect_after:
                tr.abort()
                return
            if plan.error_after is not None and i >= plan.error_after:
                tr.write(_event(json.loads(plan.error_body)) + _DONE)
                return proto.done()
            delay = plan.delays[i] if i < len(plan.delays) else 0.0
            if delay:
                await asyncio.sleep(delay)
            if tr.is_closing():
                return
            tr.write(s.piece(i))
        if plan.done_delay:
            await asyncio.sleep(plan.done_delay)
        if plan.disconnect_after is not None:  # asked to drop after every piece: before [DONE]
            tr.abort()
            return
        tr.write(s.tail())
        proto.done()

    # lifecycle ----------------------------------------------------------------------------------
    async def start_async(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Proto(self), self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]

    def __enter__(self) -> "FakeServer":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self.start_async())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="fake-openai-server")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        loop.close()


def _cli(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m streamer.bench.fake_server", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="fake")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    ap.add_argument("--itl-ms", type=float, default=0.0, help="delay before each later token")
    args = ap.parse_args(argv)

    def script(_i: int, body: dict[str, Any]) -> Plan:
        if not (args.ttft_ms or args.itl_ms):
            return Plan()
        n = len(transcript_pieces(body)) if "file" in body else \
            int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        return Plan(delays=[args.ttft_ms / 1e3] + [args.itl_ms / 1e3] * (n - 1))

    async def serve() -> None:
        srv = FakeServer(script, host=args.host, port=args.port, model=args.model, record=False)
        await srv.start_async()
        print(f"fake OpenAI server on {srv.base_url}", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:  # pragma: no cover
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    _cli()

"""Slow and abusive HTTP clients: deadlines, a header-size limit and a connection limit for uvicorn's h11 server.

uvicorn times out only the gap between a response and a kept-alive connection's next request. A connection that
sends nothing, sends its headers a byte at a time, or drips its body is otherwise held forever, with its file
descriptor, and enough of them exhaust the process's descriptors (EMFILE): nobody else can connect. Here:

- header deadline: from the connection's start (and, on a kept-alive connection, from the first byte of its next
  request) until the request's headers are complete. Past it: 408 if some bytes of a request came, then close; a
  connection that sent nothing is closed without a word.
- body deadline: the whole body within `body_timeout_s` of the headers (a total, not per read: a byte every few
  seconds is cut). Past it: 408 if no response started, then close; the application's pending receive() sees
  `http.disconnect`.
- header size: a request head over `max_header_bytes` gets 431 (h11 alone would say 400); other malformed requests
  keep uvicorn's 400.
- connection limit: past `max_connections` open connections a new one gets 503 and is closed (uvicorn's
  `limit_concurrency` still 503s requests past the limit of running request tasks).
- the soft open-file limit is raised to the hard one, so that the connection limit, not EMFILE, is what bites.

Responses written here close the connection the way nginx's lingering close does: the answer, then a half-close,
then whatever the client still sends is read and dropped until it closes or `LINGER_S` passes, so that the client
reads the answer rather than a reset.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

logger = logging.getLogger("streamer.server")

LINGER_S = 2.0  # at most this long reading (and dropping) what a client sends after an answer that closes
MIN_HEADER_BYTES = 1024
_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection deadlines and limits of the HTTP server (see the module's docstring)."""

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10
    max_connections: int = 1024
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            _check_seconds(name, getattr(self, name))
        _check_int("max_header_bytes", self.max_header_bytes, MIN_HEADER_BYTES)
        _check_int("max_connections", self.max_connections, 1)


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# argparse `type=` functions for the serve flags (the same checks as HttpLimits')
def seconds_arg(text: str) -> float:
    try:
        value = float(text)
        _check_seconds("", value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}") from None
    return value


def _int_arg(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def header_bytes_arg(text: str) -> int:
    return _int_arg(text, MIN_HEADER_BYTES)


def connections_arg(text: str) -> int:
    return _int_arg(text, 1)


# ---------------------------------------------------------------------------------------------- the protocol
def _error_body(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


def _head_size(request: h11.Request) -> int:
    """The bytes of a parsed request head: its request line, header lines and blank line (as sent, give or take
    optional whitespace)."""
    size = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n\r\n")
    for name, value in request.headers:
        size += len(name) + len(value) + 4
    return size


class _Connection(h11.Connection):
    """h11's server connection that reports a request head over the limit, whether h11 saw it incomplete and too
    long (its `max_incomplete_event_size`, error_status_hint 431) or it came whole in one read and parsed."""

    def __init__(self, max_head: int, on_head_too_large: Callable[[], None]) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head
        self.on_head_too_large: Optional[Callable[[], None]] = on_head_too_large

    def next_event(self) -> Any:
        reading_head = self.their_state is h11.IDLE
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            if not (reading_head and e.error_status_hint == 431 and self.on_head_too_large is not None):
                raise  # uvicorn answers 400
            self.on_head_too_large()
            return h11.NEED_DATA  # uvicorn's event loop stops here; the connection is closing
        if type(event) is h11.Request and self.on_head_too_large is not None and _head_size(event) > self.max_head:
            self.on_head_too_large()
            return h11.NEED_DATA
        return event


class _LogLimiter:
    """One log line per kind of event per `_LOG_EVERY_S`, with how many were not logged since."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def __call__(self, level: int, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -math.inf) < _LOG_EVERY_S:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return
        self.last[kind] = now
        skipped = self.skipped.pop(kind, 0)
        logger.log(level, msg + (f" ({skipped} more since the last such line)" if skipped else ""), *args)


_log = _LogLimiter()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and limits of `HttpLimits`. uvicorn makes one per connection as
    `http_protocol_class(config=..., server_state=..., app_state=..., _loop=...)`: `uvicorn_config` passes a
    functools.partial carrying `limits`."""

    def __init__(self, *args: Any, limits: Optional[HttpLimits] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or HttpLimits()
        self.conn = _Connection(self.limits.max_header_bytes, self._head_too_large)
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._body_timer: Optional[asyncio.TimerHandle] = None
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._closing_after_answer = False  # an answer of ours is out: what the client sends now is dropped
        self._rejected = False  # past max_connections: not one of server_state.connections

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._rejected = True
            self.transport = transport
            _log(logging.WARNING, "limit", "%d connections open (--max-connections): a new one gets 503",
                 len(self.connections))
            self._answer_and_close(503, _error_body(
                f"too many connections: this server holds at most {self.limits.max_connections} at once; "
                "try again shortly", "too_many_connections", "service_unavailable"), retry_after=True)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self.conn.on_head_too_large = None  # type: ignore[attr-defined]
        if self._rejected:
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing_after_answer or self._rejected:
            return  # read and dropped until the client closes or the linger ends
        super().data_received(data)

    def eof_received(self) -> Optional[bool]:
        if self._closing_after_answer or self._rejected:
            self.transport.close()
            return None
        return super().eof_received()  # type: ignore[func-returns-value]

    def handle_events(self) -> None:
        super().handle_events()
        self._sync_timers()

    def shutdown(self) -> None:
        if self._closing_after_answer or self._rejected:
            self.transport.close()
            return
        super().shutdown()

    # ------------------------------------------------------------------ deadlines
    def _sync_timers(self) -> None:
        """The deadline that fits where the request stands: its head incomplete (some bytes came, or the
        connection is new), its body incomplete, or none (the application's turn, or an idle kept-alive
        connection, which uvicorn's keep-alive timeout covers)."""
        if self.transport is None or self.transport.is_closing() or self._closing_after_answer:
            self._cancel_timers()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            self._cancel_body_timer()
            if self._header_timer is None and self.conn.trailing_data[0]:  # a kept-alive connection's next request
                self._arm_header_timer()
        elif state is h11.SEND_BODY:
            self._cancel_header_timer()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timeout)
        else:
            self._cancel_timers()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._unset_keepalive_if_required()
        if not self.conn.trailing_data[0]:  # nothing of a request came: no one to answer
            logger.debug("%s: nothing received in %gs; closed", self._peer(), self.limits.header_timeout_s)
            self.transport.close()
            return
        _log(logging.INFO, "header", "%s: request headers incomplete after %gs (--header-timeout): 408",
             self._peer(), self.limits.header_timeout_s)
        self._answer_and_close(408, _error_body(
            f"the request's headers did not arrive within {self.limits.header_timeout_s:g}s", "request_timeout"))

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started
        if cycle is not None:  # the application's receive() now returns http.disconnect, and its send()s go nowhere
            cycle.keep_alive = False
            cycle.disconnected = True
            cycle.message_event.set()
        if answered:
            self.transport.close()
            return
        _log(logging.INFO, "body", "%s: request body incomplete after %gs (--body-timeout): 408", self._peer(),
             self.limits.body_timeout_s)
        self._answer_and_close(408, _error_body(
            f"the request's body did not arrive within {self.limits.body_timeout_s:g}s", "request_timeout"))

    def _head_too_large(self) -> None:
        _log(logging.INFO, "431", "%s: request headers over %d bytes (--max-header-bytes): 431", self._peer(),
             self.limits.max_header_bytes)
        self._answer_and_close(431, _error_body(
            f"the request's headers are over {self.limits.max_header_bytes} bytes",
            "request_header_fields_too_large"))

    # ------------------------------------------------------------------ answers of our own
    def _answer_and_close(self, status: int, body: bytes, retry_after: bool = False) -> None:
        """Write a complete `Connection: close` answer (bytes of our own: h11's state machine has no room for an
        answer before or in the middle of a request), half-close, and drop what the client still sends until it
        closes or LINGER_S passes."""
        self._cancel_timers()
        self._unset_keepalive_if_required()
        self._closing_after_answer = True
        transport = self.transport
        headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        if retry_after:
            headers.append((b"retry-after", b"1"))
        head = b"HTTP/1.1 %d %s\r\n" % (status, STATUS_PHRASES[status])
        head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        transport.write(head + b"\r\n" + body)
        if self.flow is not None:
            self.flow.resume_reading()  # read (and drop) what comes, so that the close is a FIN, not a reset
        try:
            if transport.can_write_eof():
                transport.write_eof()
            else:  # TLS: close_notify after the answer
                transport.close()
                return
        except (OSError, RuntimeError):
            transport.close()
            return
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"


def uvicorn_config(app: Any, *, host: str, port: int, limits: Optional[HttpLimits] = None,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config serving `app` with LimitedH11Protocol under `limits`; `kwargs` are any other Config
    arguments. Raises the soft open-file limit as a side effect (see raise_open_file_limit)."""
    limits = limits or HttpLimits()
    ours = {"http", "h11_max_incomplete_event_size", "limit_concurrency", "timeout_keep_alive"} & kwargs.keys()
    if ours:
        raise TypeError(f"uvicorn_config sets {sorted(ours)} from `limits`")
    open_files = raise_open_file_limit()
    if open_files is not None and open_files < limits.max_connections + 64:
        logger.warning("the open-file limit (%d) is below max_connections (%d) + 64: past it connections fail "
                       "with EMFILE rather than a 503", open_files, limits.max_connections)
    return uvicorn.Config(app, host=host, port=port,
                          http=functools.partial(LimitedH11Protocol, limits=limits),  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          # uvicorn counts the connection asking among `connections`: +1 serves max_connections.
                          # Its count of running request tasks (ones whose client left included) is held to it too.
                          limit_concurrency=limits.max_connections + 1,
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                          **kwargs)


def raise_open_file_limit() -> Optional[int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; the soft limit now (None where unknown)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
        return None if soft == resource.RLIM_INFINITY else soft
    except (ImportError, ValueError, OSError):  # Windows has no `resource`
        return None

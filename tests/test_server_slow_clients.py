"""Slow and abusive clients (issue 49, item 4): connections that send nothing, headers a byte at a time, or a body a
byte every few seconds are cut at their deadlines (408 where a request began); a header block over the limit gets
431; past the connection limit a new connection gets 503; and the server's descriptors come back. Raw sockets to
the live server, under small limits so that the deadlines pass quickly. Every time bound asserted is a generous
one: it fails only where a deadline is not enforced at all."""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import time
from typing import Iterable

import httpx
import pytest

from streamer.server.connections import HttpLimits, LimitedH11Protocol, uvicorn_config
from tests.server_utils import LiveServer

HEADER_S, BODY_S, KEEP_ALIVE_S = 1.0, 1.5, 1.0
LIMITS = HttpLimits(header_timeout_s=HEADER_S, body_timeout_s=BODY_S, keep_alive_s=KEEP_ALIVE_S,
                    max_connections=400)
WAIT_S = 20.0  # a socket's read timeout: far past every deadline, so no assert here hangs on timing
COMPLETION = json.dumps({"model": "llama", "prompt": "hello", "max_tokens": 2}).encode()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def logs():
    """What uvicorn and the server log (uvicorn's loggers do not reach pytest's caplog)."""
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "streamer.server")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.records
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.fixture(scope="module")
def live(llama_dir, logs):
    with LiveServer(llama_dir, http_limits=LIMITS) as server:
        yield server


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer ends the read too)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length on a connection that stays open (one request at a time: bytes past the
    response are not kept)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {raw!r}"
        raw += chunk
    status, headers, body = parse(raw)
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return status, headers, body


def drip(sock: socket.socket, pieces: Iterable[bytes], interval: float) -> None:
    """Send the pieces `interval` apart, until the server answers (or closes)."""
    for piece in pieces:
        if select.select([sock], [], [], 0)[0]:
            return
        try:
            sock.sendall(piece)
        except OSError:
            return
        time.sleep(interval)


def assert_error(raw: bytes, status: int, code: str) -> dict:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    assert len(body) == int(headers["content-length"])
    err = json.loads(body)["error"]
    assert err["code"] == code and err["type"] and err["message"] and err["param"] is None
    return err


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def server_connections(server: LiveServer) -> int:
    return server.call(lambda: len(server.server.server_state.connections))  # type: ignore[union-attr]


def wait_for(predicate, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------------------- deadlines
def test_silent_connection_is_closed_without_a_word(live):
    with connect(live) as s:
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # the server closed it: a connection that sent nothing gets no answer
        assert time.monotonic() - t0 < WAIT_S


def test_headers_dripped_get_408_and_close(live):
    with connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        drip(s, (b"X-Slow: %d\r\n" % i for i in range(100)), 0.2)  # 20 s of headers if nobody stops it
        assert_error(read_until_closed(s), 408, "request_timeout")


def test_body_dripped_gets_408_the_app_sees_a_disconnect_and_the_server_goes_on(live, logs):
    before = len(logs)
    with connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(COMPLETION))
        drip(s, (COMPLETION[i:i + 1] for i in range(len(COMPLETION) - 1)), 0.2)  # never the last byte
        assert_error(read_until_closed(s), 408, "request_timeout")
    live.wait_idle()
    time.sleep(0.2)  # the application's task ends on the disconnect
    bad = [r for r in logs[before:] if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]
    assert not live.call(lambda: len(live.server.server_state.tasks))  # type: ignore[union-attr]
    with httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", content=COMPLETION, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_request_in_pieces_within_the_deadlines_is_served(live):
    """Headers and body in separate writes, a pause between them, both inside their deadlines: a normal answer."""
    with connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        time.sleep(0.2)
        s.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(COMPLETION))
        time.sleep(0.3)
        s.sendall(COMPLETION[:10])
        time.sleep(0.3)
        s.sendall(COMPLETION[10:])
        status, _, body = read_response(s)
        assert status == 200, body
        assert json.loads(body)["object"] == "text_completion"


def test_body_still_dripping_after_an_early_answer_is_cut(live):
    """A body the server answered without reading (413 on its Content-Length) and the client keeps dripping: each
    byte would restart uvicorn's keep-alive timer; the body deadline closes the connection."""
    with connect(live) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{" % (64 << 20))
        assert read_response(s)[0] == 413
        drip(s, (b" " for _ in range(100)), 0.2)  # 20 s of body if nobody stops it
        assert read_until_closed(s) == b""


def test_pipelined_requests_are_answered(live):
    with connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n" * 2
                  + b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw = read_until_closed(s)  # three answers, then the close the third asked for
        assert raw.count(b"HTTP/1.1 ") == raw.count(b"HTTP/1.1 200 OK\r\n") == 3, raw


def test_kept_alive_connection_is_closed_after_keep_alive_and_its_next_request_has_a_header_deadline(live):
    with connect(live) as s:
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_response(s)[0] == 200
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # idle past --timeout-keep-alive
        assert time.monotonic() - t0 < WAIT_S
    with connect(live) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_response(s)[0] == 200
        time.sleep(KEEP_ALIVE_S / 2)
        s.sendall(b"GET /health HTTP/1.1\r\n")  # the next request starts, and stalls
        assert_error(read_until_closed(s), 408, "request_timeout")


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("piece", [None, 4096], ids=["one-write", "in-pieces"])
def test_header_block_over_the_limit_gets_431(live, piece):
    """100 KiB of headers against the 64 KiB default: 431 with an OpenAI error body, whether the block comes in one
    write (parsed whole) or in pieces (h11's incomplete-event limit)."""
    head = b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-Filler-%03d: %s\r\n" % (i, b"a" * 1024)
                                                         for i in range(100)) + b"\r\n"
    assert len(head) > 100 << 10 > LIMITS.max_header_bytes
    with connect(live) as s:
        if piece is None:
            s.sendall(head)
        else:
            drip(s, (head[i:i + piece] for i in range(0, len(head), piece)), 0.005)
        err = assert_error(read_until_closed(s), 431, "request_header_fields_too_large")
        assert err["type"] == "invalid_request_error"


def test_headers_under_the_limit_and_malformed_requests_keep_their_answers(live):
    with connect(live) as s:  # 30 KiB of headers: served
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"X-Big: " + b"a" * (30 << 10) + b"\r\n\r\n")
        assert read_response(s)[0] == 200
    with connect(live) as s:  # not HTTP: uvicorn's 400, not a 431
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert parse(read_until_closed(s))[0] == 400


# ---------------------------------------------------------------------------------------------- descriptors
def test_200_silent_connections_are_closed_and_descriptors_come_back(live):
    assert wait_for(lambda: server_connections(live) == 0)
    baseline = open_fds()
    socks = [connect(live) for _ in range(200)]
    try:
        assert open_fds() >= baseline + 200
        for s in socks:
            assert s.recv(16) == b""  # each closed by the server at its header deadline
        # Only our 200 client ends are left open: the server's 200 ends are closed.
        assert wait_for(lambda: open_fds() <= baseline + 200 + 5), (open_fds(), baseline)
        assert wait_for(lambda: server_connections(live) == 0)
    finally:
        for s in socks:
            s.close()
    assert wait_for(lambda: open_fds() <= baseline + 5), (open_fds(), baseline)


def test_connections_past_the_limit_get_503(llama_dir):
    limits = HttpLimits(header_timeout_s=30.0, max_connections=4)
    with LiveServer(llama_dir, http_limits=limits) as server:
        held = [connect(server) for _ in range(4)]
        try:
            assert wait_for(lambda: server_connections(server) == 4)
            with connect(server) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                raw = read_until_closed(s)
            err = assert_error(raw, 503, "too_many_connections")
            assert parse(raw)[1]["retry-after"] == "1" and "4" in err["message"]
            assert server_connections(server) == 4
        finally:
            for s in held:
                s.close()
        assert wait_for(lambda: server_connections(server) == 0)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field,value", [("header_timeout_s", 0), ("header_timeout_s", float("nan")),
                                         ("body_timeout_s", -1.0), ("keep_alive_s", float("inf")),
                                         ("keep_alive_s", True), ("max_header_bytes", 100),
                                         ("max_header_bytes", 65536.0), ("max_connections", 0),
                                         ("max_connections", "10")])
def test_bad_limits_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HttpLimits(**{field: value})


def test_uvicorn_config_carries_the_limits():
    import resource

    limits = HttpLimits(header_timeout_s=2.0, body_timeout_s=3.0, max_header_bytes=8192, max_connections=10,
                        keep_alive_s=7.0)
    config = uvicorn_config(object(), host="127.0.0.1", port=0, limits=limits, log_level="warning")
    assert config.http.func is LimitedH11Protocol and config.http.keywords == {"limits": limits}  # type: ignore
    assert config.h11_max_incomplete_event_size == 8192 and config.timeout_keep_alive == 7.0
    assert config.limit_concurrency == 11  # uvicorn counts the asking connection among the open ones
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY
    with pytest.raises(TypeError, match="timeout_keep_alive"):
        uvicorn_config(object(), host="127.0.0.1", port=0, timeout_keep_alive=3)


def test_serve_flags():
    from streamer.cli import build_parser
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.header_timeout, defaults.body_timeout, defaults.max_header_bytes, defaults.max_connections,
            defaults.timeout_keep_alive) == (30.0, 60.0, 65536, 1024, 5.0) == (
        HttpLimits().header_timeout_s, HttpLimits().body_timeout_s, HttpLimits().max_header_bytes,
        HttpLimits().max_connections, HttpLimits().keep_alive_s)
    args = build_parser().parse_args(["serve", "--header-timeout", "2.5", "--body-timeout", "9",
                                      "--max-header-bytes", "16384", "--max-connections", "50",
                                      "--timeout-keep-alive", "1"])
    assert (args.header_timeout, args.body_timeout, args.max_header_bytes, args.max_connections,
            args.timeout_keep_alive) == (2.5, 9.0, 16384, 50, 1.0)
    for flag, value in (("--header-timeout", "0"), ("--body-timeout", "nan"), ("--max-header-bytes", "10"),
                        ("--max-connections", "0"), ("--timeout-keep-alive", "x")):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", flag, value])
        assert exc.value.code == 2

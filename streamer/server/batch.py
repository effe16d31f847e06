"""`streamer run-batch -i IN.jsonl -o OUT.jsonl [MODEL]`: OpenAI's Batch API file format, run offline.

Each input line is a request: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}.
Each goes through the server's own handlers (the same Starlette app, called in-process through ASGI: no sockets),
so validation, defaults and errors are exactly the HTTP server's; many run at once and the engine batches them.
Each output line answers one input line, in input order:
{"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200, "request_id": ..., "body": {...}},
"error": null}. A request the server refuses gets its status and OpenAI-style error body in "response"; a line that
is not a request at all (bad JSON, no custom_id, an unknown url) gets "response": null and "error": {code, message}.
"""
from __future__ import annotations

import asyncio
import json
import sys
import uuid
from dataclasses import dataclass
from typing import IO, Any, Iterable, Optional

from starlette.types import ASGIApp, Message

# What a batch line may ask for: OpenAI's batch endpoints plus vLLM's pooling ones (never the LoRA admin routes).
BATCH_URLS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
                        "/v1/score", "/v1/rerank", "/v1/classify"})


@dataclass
class BatchLine:
    custom_id: Optional[str]
    url: str = ""
    body: bytes = b""
    error: Optional[tuple[str, str]] = None  # (code, message): not a request; answered without running


def parse_line(text: str, seen: set[str]) -> BatchLine:
    """One input line, checked as OpenAI checks a batch file's lines (custom_id unique, method POST, a known url,
    a JSON object body, no streaming)."""
    try:
        item = json.loads(text)
    except ValueError as e:
        return BatchLine(None, error=("invalid_json", f"the line is not valid JSON: {e}"))
    if not isinstance(item, dict):
        return BatchLine(None, error=("invalid_request", "the line must be a JSON object"))
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(None, error=("missing_custom_id", "custom_id must be a non-empty string"))
    if cid in seen:
        return BatchLine(cid, error=("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line"))
    seen.add(cid)
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        return BatchLine(cid, error=("invalid_method", f"method must be POST, got {method!r}"))
    if url not in BATCH_URLS:
        return BatchLine(cid, error=("invalid_url", f"url must be one of {sorted(BATCH_URLS)}, got {url!r}"))
    if not isinstance(body, dict):
        return BatchLine(cid, error=("invalid_body", "body must be a JSON object"))
    if body.get("stream"):
        return BatchLine(cid, error=("invalid_body", "body.stream: a batch request cannot stream"))
    return BatchLine(cid, url, json.dumps(body).encode())


async def call_app(app: ASGIApp, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` to `path` of an ASGI app, in-process: (status, response body). The client never disconnects."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    delivered = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # nobody ever hangs up
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def output_line(line: BatchLine, status: Optional[int] = None, body: bytes = b"") -> dict[str, Any]:
    out: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                           "response": None, "error": None}
    if line.error is not None:
        out["error"] = {"code": line.error[0], "message": line.error[1]}
        return out
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode("utf-8", "replace")
    out["response"] = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": parsed}
    return out


@dataclass
class BatchSummary:
    total: int = 0
    succeeded: int = 0
    failed: int = 0


async def run_batch(app: ASGIApp, lines: Iterable[str], out: IO[str], concurrency: int,
                    progress: bool = False) -> BatchSummary:
    """Answer every non-blank line of `lines` into `out`, one JSON line each, in input order; at most
    `concurrency` requests in flight (enough to keep the engine's batch full, few enough to bound memory)."""
    seen: set[str] = set()
    parsed = [parse_line(text, seen) for text in lines if text.strip()]
    summary = BatchSummary(total=len(parsed))
    done: dict[int, dict[str, Any]] = {}
    next_out = 0
    todo = iter(enumerate(parsed))

    def finish(i: int, result: dict[str, Any]) -> None:
        nonlocal next_out
        ok = result["error"] is None and result["response"]["status_code"] == 200
        summary.succeeded += ok
        summary.failed += not ok
        done[i] = result
        while next_out in done:  # in input order, as soon as the lines before are written
            out.write(json.dumps(done.pop(next_out), ensure_ascii=False) + "\n")
            next_out += 1
        if progress:
            print(f"\r{summary.succeeded + summary.failed}/{summary.total} requests, {summary.failed} failed",
                  end="", file=sys.stderr, flush=True)

    async def worker() -> None:  # (workers, not a task per line: a million-line file stays cheap)
        for i, line in todo:
            if line.error is not None:
                finish(i, output_line(line))
            else:
                status, body = await call_app(app, line.url, line.body)
                finish(i, output_line(line, status, body))

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    if progress:
        print(file=sys.stderr)
    out.flush()
    return summary

"""What the API modules (app.py, audio_api.py, messages_api.py, responses_api.py) share to answer a request that is
not streamed: `JSONResponse` (bodies rendered by protocol.dumps) and `collect_choices`, which folds a generation into
its choices while watching the client's connection (a client that leaves aborts its request). They live below
app.py so that the API modules, which app.py builds on, need not import app.py for them."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Optional, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive

from streamer.server.generation import Generation, engine_error
from streamer.server.protocol import APIError, dumps
from streamer.server.responses import Choice, Format


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected; nobody will read the response."""


async def collect_choices(request: Request, gen: Generation, fmt: Format) -> Optional[list[Choice]]:
    """A non-streamed response's choices, or None if the client left (its request is aborted); 503 if the engine
    aborted it (shutdown)."""
    try:
        choices = await _collect_unless_disconnected(request, gen, fmt)
    except _ClientGone:
        gen.close("disconnect")
        return None
    finally:
        gen.close()
    if any(c.finish_reason == "abort" for c in choices):
        raise APIError("the request was aborted: the server is shutting down", 503, "service_unavailable")
    return choices


async def _collect_unless_disconnected(request: Request, gen: Generation, fmt: Format) -> list[Choice]:
    """Fold the outputs into choices while watching the connection: a client that leaves aborts the request."""
    choices = [Choice() for _ in range(fmt.num_choices)]

    async def collect() -> None:
        async for p, out in gen.items():
            i = gen.choice_index(p, out)
            choices[i].add(fmt.piece(i, p, out))

    try:
        await run_unless_disconnected(request, collect())
    except _ClientGone:
        raise
    except Exception as e:  # the engine failed under us (EngineDeadError): 503
        raise engine_error(e) from None
    return choices


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` while watching the connection: a client that leaves cancels it (the engine requests it
    awaits abort as their streams close, so a long beam search stops with its client) and raises _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when done; otherwise its cleanup aborts the engine requests
    if not task.done() or task.cancelled():
        # A cancelled gather (several prompts' beam searches) ends with its CancelledError set as its exception,
        # not as cancelled: read it, or asyncio logs "exception was never retrieved" with a traceback.
        task.add_done_callback(_retrieve)
        raise _ClientGone()
    return task.result()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body is read already, so the server's next message is the disconnect (uvicorn: when the socket closes).
    while (await receive())["type"] != "http.disconnect":
        pass

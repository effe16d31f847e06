"""Server-sent events exactly as OpenAI sends them: `data: {json}\\n\\n` per chunk, then `data: [DONE]\\n\\n`."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask

from streamer.server.generation import Generation, engine_error
from streamer.server.protocol import dumps
from streamer.server.responses import Format

logger = logging.getLogger("streamer.server")

DONE = b"data: [DONE]\n\n"
PING_SECONDS = 15  # an SSE comment line keeps proxies from timing out a slow first token


def event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def stream_events(gen: Generation, fmt: Format, head: dict[str, Any], include_usage: bool,
                        continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """The chunks of one streamed response. The generator's cleanup aborts the engine request when the client
    goes away (sse-starlette cancels it on disconnect). include_usage: a last chunk with the usage (and, as
    OpenAI's, "usage": null in the others); continuous_usage (vLLM's continuous_usage_stats): the usage so far in
    every chunk instead of null."""
    fixed: dict[str, Any] = {"usage": None} if include_usage else {}

    def extra() -> dict[str, Any]:
        return {"usage": fmt.usage(gen)} if continuous_usage else fixed
    try:
        first = fmt.first_chunk_extras()
        for opening in fmt.opening_chunks():
            yield event({**head, "choices": [opening], **extra(), **first})
            first = {}
        async for p, out in gen.items():
            choice = fmt.chunk_choice(fmt.piece(gen.choice_index(p, out), p, out))
            if choice is not None:
                yield event({**head, "choices": [choice], **extra()})
        if include_usage:
            yield event({**head, "choices": [], "usage": fmt.usage(gen)})
    except (asyncio.CancelledError, GeneratorExit) as e:  # the client left (sse-starlette cancels us)
        logger.debug("request %s: stream cancelled (%s)", gen.request_id, type(e).__name__)
        gen.close("disconnect")
        raise
    except Exception as e:  # after the first byte, the only way to tell the client is an error event
        logger.error("request %s failed mid-stream: %r", gen.request_id, e)
        yield event(engine_error(e).body())
    finally:
        gen.close()
    yield DONE


def sse_response(events: AsyncIterator[bytes], headers: dict[str, str],
                 background: Optional[BackgroundTask] = None) -> EventSourceResponse:
    return EventSourceResponse(events, headers=headers, ping=PING_SECONDS, sep="\n", background=background)

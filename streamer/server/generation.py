"""One HTTP request's engine streams (one per prompt), merged into one iterator, closed together, logged once."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Optional

from streamer.engine.async_engine import EngineDeadError, QueueFullError, RequestStream
from streamer.outputs import StreamOutput
from streamer.server.protocol import APIError, value_error

logger = logging.getLogger("streamer.server")

_END = object()


def engine_error(e: Exception, chat: bool = False) -> APIError:
    """The engine's refusals as HTTP errors: bad request 400, queue full 429 (+ Retry-After), dead engine 503."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        retry = max(1, math.ceil(e.retry_after))
        return APIError(str(e), 429, "rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(retry)})
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, "service_unavailable", code="engine_dead")
    if isinstance(e, ValueError):
        err = value_error(e)
        if chat and err.param == "prompt":
            err.param = "messages"
        return err
    return APIError(f"internal error: {e!r}", 500, "server_error")


class Generation:
    def __init__(self, request_id: str, streams: list[RequestStream], n: int, model: str = "") -> None:
        self.request_id = request_id
        self.model = model  # the name responses carry: the base model's or the LoRA adapter's
        self.streams = streams
        self.n = n
        self.start = time.monotonic()
        self.finish_reasons: dict[int, str] = {}  # choice index -> finish reason
        self.scored_only = False  # echo with max_tokens 0: the one token sampled is not the client's output
        self._closed = False

    def choice_index(self, prompt_index: int, out: StreamOutput) -> int:
        return prompt_index * self.n + out.index  # OpenAI's numbering for several prompts x n

    async def items(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        """(prompt index, output) as the engine produces them; each stream's usage lands on its last item."""
        source = self._one() if len(self.streams) == 1 else self._merged()
        async for p, out in source:
            if out.finished:
                self.finish_reasons[self.choice_index(p, out)] = out.finish_reason or "stop"
            yield p, out

    async def _one(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        async for out in self.streams[0]:
            yield 0, out

    async def _merged(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((p, out))
                queue.put_nowait((p, _END))
            except Exception as e:  # the engine died: hand the error to the reader
                queue.put_nowait((p, e))

        tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(self.streams)]
        try:
            live = len(tasks)
            while live:
                p, item = await queue.get()
                if item is _END:
                    live -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            for t in tasks:
                t.cancel()

    def usage(self) -> dict:
        """OpenAI's usage summed over the prompts, with prompt_tokens_details.cached_tokens (prefix-cache hits)."""
        prompt = completion = cached = 0
        for s in self.streams:
            prompt += s.prompt_tokens
            completion += 0 if self.scored_only else s.completion_tokens
            cached += s.cached_tokens
        u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
        predicted = [s.prediction_details() for s in self.streams if s.predictions]
        if predicted:
            u["completion_tokens_details"] = {k: sum(d[k] for d in predicted) for k in predicted[0]}
        return u

    def close(self, reason: Optional[str] = None) -> None:
        """Abort what is still running (frees its KV blocks at once) and log the request's one line."""
        if self._closed:
            return
        self._closed = True
        for s in self.streams:
            s.close()
        u = self.usage()
        reasons = sorted(set(self.finish_reasons.values())) or []
        if reason is not None or len(self.finish_reasons) < self.n * len(self.streams):
            reasons = sorted(set(reasons) | {reason or "abort"})
        logger.info("request %s finished: prompt_tokens=%d completion_tokens=%d finish_reason=%s latency=%.3fs",
                    self.request_id, u["prompt_tokens"], u["completion_tokens"], ",".join(reasons),
                    time.monotonic() - self.start)

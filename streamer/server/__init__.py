"""The OpenAI-compatible HTTP server (`streamer serve`): starlette + sse-starlette, run by uvicorn on uvloop."""
from __future__ import annotations

from streamer.server.app import build_app

__all__ = ["build_app"]

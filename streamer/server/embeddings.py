"""POST /v1/embeddings (OpenAI's shape): each input's embedding, from the model's final hidden states pooled
(streamer/pooling.py). Inputs run as requests of their own, batched with whatever else the engine runs."""
from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamer.pooling import PoolingParams
from streamer.server.generation import engine_error
from streamer.server.protocol import APIError, get_bool, get_int, get_str, parse_prompts

if TYPE_CHECKING:
    from streamer.server.app import OpenAIServer


def parse_embedding(body: dict) -> tuple[list[Any], PoolingParams, str]:
    """(inputs, pooling, encoding_format); `input` as /v1/completions' `prompt` (strings or token ids)."""
    try:
        inputs = parse_prompts(body.get("input"))
    except APIError as e:
        raise APIError(e.message.replace("prompt", "input"), param="input") from None
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = get_int(body, "dimensions", None, lo=1)
    return inputs, PoolingParams(normalize=get_bool(body, "normalize", True), dimensions=dims), fmt


async def embeddings(server: "OpenAIServer", request: Request) -> Response:
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    inputs, pooling, fmt = parse_embedding(body)
    engine = server.engine
    rid = f"embd-{uuid.uuid4().hex}"
    streams = []
    try:
        for i, item in enumerate(inputs):
            prompt = item if isinstance(item, str) else {"prompt_token_ids": item}
            streams.append(await engine.add_request(prompt, None, f"{rid}-{i}", lora_request=lora, pooling=pooling))
        vectors = []
        for stream in streams:
            async for out in stream:
                if out.finished:
                    if out.embedding is None:
                        raise APIError("the request was aborted: the server is shutting down", 503,
                                       "service_unavailable")
                    vectors.append(out.embedding)
    except Exception as e:
        err = engine_error(e)
        if err.status == 400:
            err.param = "dimensions" if err.message.startswith("dimensions") else "input"
        raise err from None
    finally:
        for stream in streams:
            stream.close()
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    tokens = sum(s.prompt_tokens for s in streams)
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encode(vec: list[float], fmt: str) -> Any:
    """base64: the little-endian float32 bytes, as OpenAI sends them (its client decodes them with numpy)."""
    if fmt == "float":
        return vec
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()

"""POST /v1/embeddings (OpenAI's shape): each input's embedding, from the model's final hidden states pooled
(streamer/pooling.py). Inputs run as requests of their own, batched with whatever else the engine runs. /score and
/rerank (vLLM's and Jina's / Cohere's shapes) rank texts by the cosine similarity of their embeddings."""
from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamer.pooling import PoolingParams
from streamer.server.generation import engine_error
from streamer.server.protocol import APIError, _show, get_bool, get_int, get_str, parse_messages, parse_prompts

if TYPE_CHECKING:
    from streamer.server.app import OpenAIServer


def parse_embedding(body: dict, render: Optional[Callable[[list[dict]], str]] = None,
                    ) -> tuple[list[Any], PoolingParams, str]:
    """(inputs, pooling, encoding_format); `input` as /v1/completions' `prompt` (strings or token ids), or vLLM's
    `messages` (one conversation, rendered with the chat template by `render`)."""
    if body.get("messages") is not None and render is not None:
        if body.get("input") is not None:
            raise APIError("give either input or messages", param="messages")
        inputs: list[Any] = [render(parse_messages(body["messages"]))]
    else:
        try:
            inputs = parse_prompts(body.get("input"))
        except APIError as e:
            raise APIError(e.message.replace("prompt", "input"), param="input") from None
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = get_int(body, "dimensions", None, lo=1)
    cut = get_int(body, "truncate_prompt_tokens", None, lo=1)
    return inputs, PoolingParams(normalize=get_bool(body, "normalize", True), dimensions=dims,
                                 truncate_prompt_tokens=cut), fmt


async def embeddings(server: "OpenAIServer", request: Request) -> Response:
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    inputs, pooling, fmt = parse_embedding(
        body, lambda messages: server.chat_template.render(messages, get_bool(body, "add_generation_prompt", False)))
    if body.get("messages") is not None:  # the template placed the special tokens
        inputs = [await server.engine.encode(inputs[0], add_special_tokens=False)]
    rid = f"embd-{uuid.uuid4().hex}"
    vectors, tokens = await embed_all(server, inputs, pooling, lora, rid, "input")
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embed_all(server: "OpenAIServer", inputs: list[Any], pooling: PoolingParams, lora: Optional[str], rid: str,
                    field: str) -> tuple[list[list[float]], int]:
    """Every input's embedding (strings or token-id lists, each its own request, all in flight at once) and the
    prompt tokens they took; errors name `field`."""
    engine = server.engine
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
            err.param = "dimensions" if err.message.startswith("dimensions") else field
        raise err from None
    finally:
        for stream in streams:
            stream.close()
    return vectors, sum(s.prompt_tokens for s in streams)


def _texts(body: dict, name: str, allow_single: bool = True) -> list[Any]:
    v = body.get(name)
    if isinstance(v, str) and allow_single:
        return [v]
    if isinstance(v, list) and v:
        out = []
        for d in v:
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str) or not text:
                raise APIError(f"{name} must hold non-empty strings (or {{\"text\": string}} objects), got {_show(d)}",
                               param=name)
            out.append(text)
        return out
    raise APIError(f"{name} must be a non-empty string or array of strings, got {_show(v)}", param=name)


async def score(server: "OpenAIServer", request: Request) -> Response:
    """vLLM's /score for embedding models: the cosine similarity of text_1 with each text_2 (one text_1), or of each
    pair (equal lists)."""
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) != 1 and len(first) != len(second):
        raise APIError(f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                       "text_2", param="text_1")
    rid = f"score-{uuid.uuid4().hex}"
    vectors, tokens = await embed_all(server, first + second, PoolingParams(), lora, rid, "text_2")
    a, b = np.asarray(vectors[:len(first)]), np.asarray(vectors[len(first):])
    scores = (a * b).sum(axis=1) if len(first) == len(b) else b @ a[0]
    data = [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(np.atleast_1d(scores))]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(server: "OpenAIServer", request: Request) -> Response:
    """Jina's / Cohere's /rerank for embedding models: the documents by cosine similarity to the query, best first."""
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise APIError(f"query must be a non-empty string, got {_show(query)}", param="query")
    docs = _texts(body, "documents", allow_single=False)
    top_n = get_int(body, "top_n", None, lo=1)
    rid = f"rerank-{uuid.uuid4().hex}"
    vectors, tokens = await embed_all(server, [query] + docs, PoolingParams(), lora, rid, "documents")
    scores = np.asarray(vectors[1:]) @ np.asarray(vectors[0])
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [{"index": int(i), "document": {"text": docs[i]}, "relevance_score": float(scores[i])} for i in order]
    return JSONResponse({"id": rid, "model": lora or server.model_name, "usage": {"total_tokens": tokens},
                         "results": results})


def _encode(vec: list[float], fmt: str) -> Any:
    """base64: the little-endian float32 bytes, as OpenAI sends them (its client decodes them with numpy)."""
    if fmt == "float":
        return vec
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()

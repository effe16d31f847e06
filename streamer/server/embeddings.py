"""The pooling endpoints (streamer/engine/pooling.py). POST /v1/embeddings (OpenAI's shape): each input's embedding, from
the model's final hidden states pooled. POST /classify (vLLM's): each input's label probabilities from a
sequence-classification model. /score and /rerank (vLLM's and Jina's / Cohere's shapes) rank texts by the cosine
similarity of their embeddings, or, with a cross-encoder (a classifier with one label), by its score of each pair.
Inputs run as requests of their own, batched with whatever else the engine runs."""
from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamer.engine.pooling import Classifier, PoolingParams, pair_up
from streamer.server.generation import engine_error
from streamer.server.protocol import APIError, _show, get_bool, get_int, get_str, parse_messages, parse_prompts

if TYPE_CHECKING:
    from streamer.server.app import OpenAIServer


def parse_embedding(body: dict) -> tuple[PoolingParams, str]:
    """/v1/embeddings' (pooling, encoding_format)."""
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = get_int(body, "dimensions", None, lo=1)
    cut = get_int(body, "truncate_prompt_tokens", None, lo=1)
    return PoolingParams(normalize=get_bool(body, "normalize", True), dimensions=dims, truncate_prompt_tokens=cut,
                         task="embed"), fmt


def parse_inputs(body: dict, render: Optional[Callable[[list[dict]], str]] = None) -> list[Any]:
    """`input` as /v1/completions' `prompt` (strings or token ids), or vLLM's `messages` (one conversation, rendered
    with the chat template by `render`)."""
    if body.get("messages") is not None and render is not None:
        if body.get("input") is not None:
            raise APIError("give either input or messages", param="messages")
        return [render(parse_messages(body["messages"]))]
    try:
        return parse_prompts(body.get("input"))
    except APIError as e:
        raise APIError(e.message.replace("prompt", "input"), param="input") from None


async def _inputs(server: "OpenAIServer", body: dict) -> list[Any]:
    """The request's inputs (`parse_inputs`), a `messages` conversation rendered and tokenized (the template placed
    the special tokens)."""
    inputs = parse_inputs(body, lambda m: server.chat_template.render(m, get_bool(body, "add_generation_prompt",
                                                                                  False)))
    if body.get("messages") is None:
        return inputs
    return [await server.engine.encode(inputs[0], add_special_tokens=False)]


async def embeddings(server: "OpenAIServer", request: Request) -> Response:
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    _check_kind(server, "/v1/embeddings", classifier=False)
    inputs = await _inputs(server, body)
    pooling, fmt = parse_embedding(body)
    rid = f"embd-{uuid.uuid4().hex}"
    vectors, tokens = await pool_all(server, inputs, pooling, lora, rid, "input")
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def classify(server: "OpenAIServer", request: Request) -> Response:
    """vLLM's /classify: each input's label probabilities (softmax over the labels, a sigmoid for one label; the raw
    logits with `"activation": false`) and most likely label, from a sequence-classification model."""
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    clf = _check_kind(server, "/classify", classifier=True)
    inputs = await _inputs(server, body)
    activation = get_bool(body, "use_activation", get_bool(body, "activation", True))  # (vLLM's newer and older name)
    pooling = PoolingParams(task="classify", activation=activation,
                            truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens", None, lo=1))
    rid = f"classify-{uuid.uuid4().hex}"
    outputs, tokens = await pool_all(server, inputs, pooling, lora, rid, "input")
    data = [{"index": i, "label": clf.label(p), "probs": p, "num_classes": len(p)} for i, p in enumerate(outputs)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                                 "completion_tokens": 0, "prompt_tokens_details": None}})


def _check_kind(server: "OpenAIServer", endpoint: str, classifier: bool) -> Optional[Classifier]:
    """400 unless the served model is a sequence classifier (`classifier`) or is not one; returns the classifier."""
    clf = server.engine.classifier
    if classifier and clf is None:
        raise APIError(f"{endpoint} needs a sequence-classification model (*ForSequenceClassification); this model "
                       "generates text and makes embeddings", param="model")
    if not classifier and clf is not None:
        raise APIError(f"{endpoint}: {clf.architecture} is a sequence-classification model, which makes no "
                       "embeddings; use /classify (and /score, /rerank with a one-label cross-encoder)", param="model")
    return clf


async def pool_all(server: "OpenAIServer", inputs: list[Any], pooling: PoolingParams, lora: Optional[str], rid: str,
                   field: str) -> tuple[list[list[float]], int]:
    """Every input's pooled result (strings or token-id lists, each its own request, all in flight at once: an
    embedding or a classifier's outputs) and the prompt tokens they took; errors name `field`."""
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
    """vLLM's /score: text_1 with each text_2 (one text_1), or each pair (equal lists), scored by the cosine
    similarity of their embeddings or by a cross-encoder."""
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    try:
        pairs = pair_up(first, second)
    except ValueError as e:
        raise APIError(str(e), param="text_1") from None
    rid = f"score-{uuid.uuid4().hex}"
    scores, tokens = await _score_pairs(server, first, second, pairs, lora, rid, "text_2")
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": lora or server.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank(server: "OpenAIServer", request: Request) -> Response:
    """Jina's / Cohere's /rerank (and Cohere v2's /v2/rerank): the documents by their score with the query (as
    /score's), best first; `return_documents` false leaves each result's text out."""
    body = await server._json(request)
    lora = server._check_model(get_str(body, "model", None, 1024))
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise APIError(f"query must be a non-empty string, got {_show(query)}", param="query")
    docs = _texts(body, "documents", allow_single=False)
    top_n = get_int(body, "top_n", None, lo=1)
    with_docs = get_bool(body, "return_documents", True)
    rid = f"rerank-{uuid.uuid4().hex}"
    scores, tokens = await _score_pairs(server, [query], docs, [(query, d) for d in docs], lora, rid, "documents")
    order = np.argsort(-np.asarray(scores), kind="stable")[:top_n]
    results = [{"index": int(i), **({"document": {"text": docs[i]}} if with_docs else {}),
                "relevance_score": float(scores[i])} for i in order]
    return JSONResponse({"id": rid, "model": lora or server.model_name, "usage": {"total_tokens": tokens},
                         "results": results})


async def _score_pairs(server: "OpenAIServer", first: list[str], second: list[str], pairs: list[tuple[str, str]],
                       lora: Optional[str], rid: str, field: str) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens they took. A cross-encoder (a sequence classifier with one label, as
    vLLM decides by the model's task) runs each pair through it as one prompt, the tokenizer's pair encoding;
    an embedding model embeds `first` and `second` and scores the cosine similarity of each pair."""
    clf = server.engine.classifier
    if clf is None:
        vectors, tokens = await pool_all(server, first + second, PoolingParams(task="embed"), lora, rid, field)
        a, b = np.asarray(vectors[:len(first)]), np.asarray(vectors[len(first):])  # (normalised)
        return ((a * b).sum(axis=1) if len(a) == len(b) else b @ a[0]).tolist(), tokens
    if not clf.is_cross_encoder:
        raise APIError(f"scores need an embedding model or a cross-encoder (a sequence classifier with one label); "
                       f"{clf.architecture} has {clf.num_labels} labels: use /classify", param="model")
    prompts = [await server.engine.encode_pair(a, b) for a, b in pairs]
    outputs, tokens = await pool_all(server, prompts, PoolingParams(task="score"), lora, rid, field)
    return [out[0] for out in outputs], tokens


def _encode(vec: list[float], fmt: str) -> Any:
    """base64: the little-endian float32 bytes, as OpenAI sends them (its client decodes them with numpy)."""
    if fmt == "float":
        return vec
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()

"""/v1/responses: OpenAI's Responses API, with OpenAI's store (GET / DELETE / input_items / cancel,
`previous_response_id`, `background`).

A request is translated into a chat completion request (`to_chat_body`: `instructions` -> a system message,
earlier turns' items and `input` items -> messages, function tools and `text.format` -> their chat spellings) and
runs through the chat path, so sampling, structured outputs, forced tool calls, tool-call and reasoning parsers
behave as there. Only the shape of the answer differs: a `response` object whose `output` holds reasoning,
message and function_call items, or, streamed, the typed events (`response.created`,
`response.output_text.delta`, ..., `response.completed`). With `store` (the default) the final object and the
conversation that led to it are kept in a bounded `ResponseStore`.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamer.sampling_params import MAX_LOGPROBS
from streamer.server.generation import Generation, engine_error
from streamer.server.protocol import REASONING_EFFORTS, APIError, _show, dumps, get_bool, get_int, parse_chat
from streamer.server.responding import collect_choices
from streamer.server.response_store import DEFAULT_MAX_COUNT, ResponseStore, StoredResponse
from streamer.server.responses import ChatFormat, Choice
from streamer.server.sse import sse_response

if TYPE_CHECKING:
    from streamer.server.app import OpenAIServer

logger = logging.getLogger("streamer.server")

# Fields passed to the chat request as they are (the rest are translated, echoed, or refused).
_SAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "user",
         "priority", "cache_salt", "frequency_penalty", "presence_penalty", "repetition_penalty", "stop",
         "chat_template_kwargs", "ignore_eos", "min_tokens", "include_reasoning", "thinking_token_budget")


def to_chat_body(body: dict, history: Sequence[dict[str, Any]] = ()) -> tuple[dict, list[dict[str, Any]]]:
    """The chat completion request that computes this response (APIError naming the Responses field), and the
    conversation's items as stored. history: the previous response's items, before this request's `input`."""
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(f"instructions must be a string, got {_show(instructions)}", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = [*history, *input_items(body.get("input"))]
    messages += _input_messages(items, offset=len(history))
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": "
                           f"...}}, got {_show(choice)}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_options(body).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    effort = _effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    top = _top_logprobs(body)
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    return chat, items


# OpenAI's `include` values. Only the output text's logprobs change what is computed; the rest name things this
# server has no part of (hosted tools, encrypted reasoning), so they are accepted and add nothing.
_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
             "computer_call_output.output.image_url", "code_interpreter_call.outputs", "file_search_call.results",
             "web_search_call.action.sources", "web_search_call.results")


def _text_options(body: dict) -> dict[str, Any]:
    """`text`: an object ({"format": ..., "verbosity": ...}) or null."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise APIError(f"text must be an object, got {_show(text)}", param="text")
    return text


def check_echoed(body: dict) -> None:
    """The fields a response echoes as they were given must have the shape OpenAI gives them (checked before
    anything starts, so that building the response object never fails part-way, mid-stream or in the background):
    text an object, metadata an object of strings, tool_choice a string or an object, user a string."""
    _text_options(body)
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise APIError(f"metadata must be an object of string values, got {_show(metadata)}", param="metadata")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise APIError(f"tool_choice must be a string or an object, got {_show(choice)}", param="tool_choice")
    for name in ("previous_response_id", "user"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise APIError(f"{name} must be a string, got {_show(value)}", param=name)


def _top_logprobs(body: dict) -> Optional[int]:
    """How many alternatives each output token's logprob lists, or None for no logprobs: they come with
    `include: ["message.output_text.logprobs"]` or a positive `top_logprobs`."""
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or any(i not in _INCLUDES for i in include)):
        raise APIError(f"include must be an array of {list(_INCLUDES)}, got {_show(include)}", param="include")
    top = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if "message.output_text.logprobs" in (include or ()) or top:
        return top or 0
    return None


def _effort(body: dict) -> Optional[str]:
    """`reasoning: {"effort"}`: the chat request's reasoning_effort."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise APIError(f"reasoning must be an object, got {_show(reasoning)}", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {_show(effort)}",
                       param="reasoning.effort")
    return effort


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                raise APIError(f"{param} parts must be input_text / output_text parts (only text is supported), "
                               f"got {_show(part)}", param="input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(f"{param} must be a string or an array of text parts, got {_show(content)}", param="input")


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(items: Any) -> list[dict[str, Any]]:
    """`input` as the items OpenAI stores and lists: each with a type and an id, a message's string content as a
    text part. Items of an unknown shape pass through for `_input_messages` to refuse."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(f"input must be a string or a non-empty array of items, got {_show(items)}", param="input")
    return [_as_item(item) for item in items]


def _as_item(item: Any) -> Any:
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    prefix = _ID_PREFIX.get(kind, "item") if isinstance(kind, str) else "item"  # (`_input_messages` refuses it)
    out = {"type": kind, "id": f"{prefix}_{uuid.uuid4().hex}", **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out


def _input_messages(items: list[Any], offset: int = 0) -> list[dict[str, Any]]:
    """offset: how many items came before the client's own `input` (they are named input[i - offset])."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items, -offset):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            content = item.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                                 for p in content):  # parse_chat reads the parts (a VLM's)
                content = [dict(p, type="text") if isinstance(p, dict) and p.get("type") == "output_text" else p
                           for p in content]
            else:
                content = _text_of(content, f"input[{i}].content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":  # text, then calls (parallel ones too): one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text_of(output, f"input[{i}].output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again (as chat templates drop it)
        else:
            raise APIError(f"input[{i}] has type {_show(kind)}: message, function_call, function_call_output and "
                           "reasoning items are supported", param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(f"tools must be an array, got {_show(tools)}", param="tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise APIError(f"only function tools ({{\"type\": \"function\", \"name\": ...}}) are supported, got "
                           f"{_show(t)}", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(f"text.format must have type text, json_object or json_schema, got {_show(fmt)}",
                       param="text.format")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}


class ResponseBuilder:
    """The `response` object and its output items, for one request."""

    def __init__(self, body: dict, model: str, store: bool = False, fmt: Optional[ChatFormat] = None) -> None:
        """fmt: the chat request's format (it counts the reasoning tokens, where a reasoning parser has tags)."""
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.model, self.store, self.fmt = body, model, store, fmt

    def response(self, status: str, output: list[dict], usage: Optional[dict] = None,
                 finish_reason: Optional[str] = None, error: Optional[APIError] = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None if error is None else {"code": error.code or error.type, "message": error.message},
            "incomplete_details": incomplete, "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"), "background": bool(b.get("background")),
            "reasoning": {"effort": _effort(b), "summary": None}, "store": self.store,
            "temperature": b.get("temperature", 1.0),
            "text": {"format": _text_options(b).get("format") or {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs"), "top_p": b.get("top_p", 1.0), "truncation": "disabled",
            "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {},
        }

    def usage(self, gen: Generation) -> dict[str, Any]:
        """OpenAI's shape; reasoning_tokens 0 where none are counted (no parser with think tags)."""
        u = gen.usage() if self.fmt is None else self.fmt.usage(gen)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": u["total_tokens"]}

    @staticmethod
    def status(finish_reason: Optional[str]) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def final(self, c: Choice, gen: Generation) -> dict[str, Any]:
        """The finished response of a non-streamed choice."""
        return self.response(self.status(c.finish_reason), self.items(c), self.usage(gen), c.finish_reason)

    def items(self, c: Choice) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if c.reasoning:
            out.append(reasoning_item(f"rs_{uuid.uuid4().hex}", c.reasoning, "completed"))
        if c.text.strip() or not c.tool_calls:
            out.append(message_item(f"msg_{uuid.uuid4().hex}", c.text, self.status(c.finish_reason), c.logprobs))
        out += [call_item(call, "completed") for call in c.tool_calls]
        return out


def message_item(item_id: str, text: Optional[str], status: str,
                 logprobs: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """logprobs: those of every output token (a reasoning model's thoughts included, as vLLM's)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs or []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: Optional[str], status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(call: dict[str, Any], status: str, arguments: Optional[str] = None) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


class ResponsesAPI:
    """The /v1/responses routes and the store behind them."""

    def __init__(self, server: "OpenAIServer", store_size: int = DEFAULT_MAX_COUNT) -> None:
        self.server = server
        self.store = ResponseStore(store_size)

    def routes(self) -> list[Route]:
        one = "/v1/responses/{response_id}"
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route(one, self.retrieve, methods=["GET"]),
                Route(one, self.delete, methods=["DELETE"]),
                Route(one + "/cancel", self.cancel, methods=["POST"]),
                Route(one + "/input_items", self.input_items, methods=["GET"])]

    async def create(self, request: Request) -> Response:
        body = await self.server._json(request)
        check_echoed(body)
        store, background = self._options(body)
        chat_body, items = to_chat_body(body, self._history(body.get("previous_response_id")))
        try:
            chat = parse_chat(chat_body, self.server.engine.sampling_defaults)
        except APIError as e:
            raise e.rename("max_tokens", "max_output_tokens") from None
        if chat.params.n != 1:
            raise APIError("n is not part of the Responses API", param="n")
        chat.max_tokens_field = "max_output_tokens"
        gen, fmt = await self.server.start_chat(chat, progress=background)
        builder = ResponseBuilder(body, gen.model, store, fmt)
        headers = {"X-Request-Id": gen.request_id}
        if background:
            return JSONResponse(self._start_background(gen, fmt, builder, items), headers=headers)
        keep = (lambda response: self.store.put(StoredResponse(response, items))) if store else None
        if chat.stream:
            return sse_response(_events(gen, fmt, builder, keep), headers=headers, background=BackgroundTask(gen.close))
        choices = await collect_choices(request, gen, fmt)
        if choices is None:
            return Response(status_code=499)
        response = builder.final(choices[0], gen)
        if keep is not None:
            keep(response)
        return JSONResponse(response, headers=headers)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(self._lookup(request).response)

    async def delete(self, request: Request) -> Response:
        entry = self._lookup(request)
        self.store.pop(entry.id)  # a running background response is cancelled
        return JSONResponse({"id": entry.id, "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        entry = self._lookup(request)
        if not entry.response["background"]:
            raise APIError("only background responses can be cancelled", param="response_id")
        task = entry.task
        if task is not None:  # (cancelling one that ended answers it as it is)
            task.cancel()
            await asyncio.wait({task})  # its done callback, added first, has settled the entry by now
        return JSONResponse(entry.response)

    async def input_items(self, request: Request) -> Response:
        """OpenAI's list of the conversation's items (earlier turns included), newest first unless order=asc."""
        entry, q = self._lookup(request), request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {_show(order)}", param="order")
        limit = _query_int(q.get("limit"), "limit", 20, 1, 100)
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        after = q.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(f"no input item has the id {_show(after)}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    # ------------------------------------------------------------------ helpers
    def _options(self, body: dict) -> tuple[bool, bool]:
        """(store, background) for this request; a background response must be stored (to be fetched)."""
        store = get_bool(body, "store", True) and self.store.enabled
        background = get_bool(body, "background", False)
        if background and not store:
            why = "store: true" if self.store.enabled else "a server that stores responses (--responses-store-size)"
            raise APIError(f"background responses need {why}", param="background")
        if background and get_bool(body, "stream", False):
            raise APIError("background responses are not streamed here: create one, then retrieve it", param="stream")
        return store, background

    def _history(self, previous_id: Any) -> list[dict[str, Any]]:
        """The previous response's conversation: its input items (earlier turns included) and its output items.
        Its instructions are not carried over (as OpenAI)."""
        if previous_id is None:
            return []
        entry = self.store.get(previous_id) if isinstance(previous_id, str) else None
        if entry is None:
            raise APIError(f"Previous response with id {_show(previous_id)} not found.", param="previous_response_id",
                           code="previous_response_not_found")
        if entry.task is not None:
            raise APIError(f"Previous response {previous_id} is still in progress.", param="previous_response_id")
        return [*entry.input_items, *entry.response["output"]]

    def _lookup(self, request: Request) -> StoredResponse:
        rid = request.path_params["response_id"]
        entry = self.store.get(rid)
        if entry is None:
            raise APIError(f"Response with id {rid!r} not found.", 404, param="response_id",
                           code="response_not_found")
        return entry

    def _start_background(self, gen: Generation, fmt: ChatFormat, builder: ResponseBuilder,
                          items: list[dict[str, Any]]) -> dict[str, Any]:
        entry = StoredResponse(builder.response("queued", []), items)
        entry.task = asyncio.ensure_future(_generate(entry, gen, fmt, builder))
        # A callback, not a `finally`: it also runs for a task cancelled before it started.
        entry.task.add_done_callback(lambda task: self._settle(entry, task, gen, builder))
        self.store.put(entry)
        return entry.response

    def _settle(self, entry: StoredResponse, task: asyncio.Task, gen: Generation, builder: ResponseBuilder) -> None:
        """A background generation ended: abort what is left of it and store its final object."""
        gen.close("cancelled" if task.cancelled() else None)
        entry.task = None
        if task.cancelled():
            entry.response = builder.response("cancelled", [], builder.usage(gen))
        elif task.exception() is not None:
            err = engine_error(task.exception())  # type: ignore[arg-type]
            logger.error("background response %s failed: %s", builder.id, err.message)
            entry.response = builder.response("failed", [], builder.usage(gen), error=err)
        else:
            entry.response = task.result()
        self.store.refresh(entry)


async def _generate(entry: StoredResponse, gen: Generation, fmt: ChatFormat, builder: ResponseBuilder,
                    ) -> dict[str, Any]:
    """A background response's generation: its final object (an error for a shutdown's abort)."""
    choice = Choice()
    async for p, out in gen.items():
        entry.response["status"] = "in_progress"
        choice.add(fmt.piece(0, p, out))
    if choice.finish_reason == "abort":
        raise APIError("the request was aborted: the server is shutting down", 503, "service_unavailable")
    return builder.final(choice, gen)


def _query_int(raw: Optional[str], name: str, default: int, lo: int, hi: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise APIError(f"{name} must be an integer in [{lo}, {hi}], got {_show(raw)}", param=name)
    return value


class _EventStream:
    """The typed events of one streamed response; items are opened as their first content arrives and closed at
    the end (a function call arrives whole, from the tool-call parser)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, tuple[int, str, list[str]]] = {}  # kind -> (output index, item id, text pieces)
        self.calls: dict[int, tuple[int, dict[str, Any]]] = {}  # open function calls: chat index -> (output index, call)
        # With logprobs asked for: every token's so far (the message's done event carries them all), and those not
        # yet sent (a token without text of its own, a thought's, rides with the message's next delta).
        self.logprobs: Optional[list[dict[str, Any]]] = None
        self.unsent: list[dict[str, Any]] = []

    def scored(self, logprobs: Optional[list[dict[str, Any]]]) -> None:
        """A piece's tokens' logprobs (None: not asked for)."""
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += logprobs
            self.unsent += logprobs

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    def text(self, kind: str, delta: str) -> list[bytes]:
        """kind "message" or "reasoning": open the item on its first text, then one delta."""
        out = []
        if kind not in self.open:
            index = len(self.output) + len(self.open) + len(self.calls)
            item_id = f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}"
            self.open[kind] = (index, item_id, [])
            empty = message_item(item_id, None, "in_progress") if kind == "message" else \
                reasoning_item(item_id, None, "in_progress")
            out.append(self.event("response.output_item.added", output_index=index, item=empty))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        index, item_id, pieces = self.open[kind]
        pieces.append(delta)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {}
        if kind == "message":
            extra["logprobs"], self.unsent = self.unsent, []
        out.append(self.event(name, item_id=item_id, output_index=index, content_index=0, delta=delta, **extra))
        return out

    def close(self, kind: str, status: str) -> list[bytes]:
        index, item_id, pieces = self.open.pop(kind)
        text = "".join(pieces)
        if kind == "message":
            item = message_item(item_id, text, status, self.logprobs)
            out = [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text, logprobs=item["content"][0]["logprobs"]),
                   self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=item["content"][0])]
        else:
            item = reasoning_item(item_id, text, "completed")
            out = [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                              text=text)]
        self.output.append(item)
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def call_delta(self, delta: dict[str, Any]) -> list[bytes]:
        """One entry of a chat `delta.tool_calls`: a call's start (with its id and name; parsed calls arrive whole)
        or more of its arguments (a forced call streams them)."""
        out: list[bytes] = []
        if delta.get("id") is not None:
            for kind in ("reasoning", "message"):  # a call follows what was said before it
                if kind in self.open:
                    out += self.close(kind, "completed")
            for index in list(self.calls):  # (a call is complete when the next one starts)
                out += self.close_call(index)
            index = len(self.output) + len(self.calls)
            call = {"id": delta["id"], "function": {"name": delta["function"]["name"], "arguments": ""}}
            self.calls[delta.get("index", 0)] = (index, call)
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=call_item(call, "in_progress")))
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece:
            index, call = self.calls[delta.get("index", 0)]
            call["function"]["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta", item_id=f"fc_{call['id']}",
                                  output_index=index, delta=piece))
        return out

    def close_call(self, key: int) -> list[bytes]:
        index, call = self.calls.pop(key)
        item = call_item(call, "completed")
        self.output.append(item)
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def _events(gen: Generation, fmt: ChatFormat, b: ResponseBuilder,
                  on_final: Optional[Callable[[dict[str, Any]], None]] = None) -> AsyncIterator[bytes]:
    """on_final: given the final object of a response that ended (completed or incomplete), e.g. to store it."""
    s = _EventStream(b)
    yield s.event("response.created", response=b.response("in_progress", []))
    yield s.event("response.in_progress", response=b.response("in_progress", []))
    finish: Optional[str] = None
    try:
        async for p, out in gen.items():
            piece = fmt.piece(0, p, out)
            s.scored(piece.logprobs)
            for kind, text in (("reasoning", piece.reasoning), ("message", piece.text)):
                if text:
                    for e in s.text(kind, text):
                        yield e
            for delta in piece.tool_calls or []:
                for e in s.call_delta(delta):
                    yield e
            finish = piece.finish_reason or finish
        for key in list(s.calls):
            for e in s.close_call(key):
                yield e
        if not s.output and "message" not in s.open and "reasoning" not in s.open:
            for e in s.text("message", ""):  # an empty answer is still a message
                yield e
        for kind in ("reasoning", "message"):
            if kind in s.open:
                for e in s.close(kind, b.status(finish)):
                    yield e
        if finish == "abort":
            raise APIError("the request was aborted: the server is shutting down", 503, "service_unavailable")
        final = b.response(b.status(finish), s.output, b.usage(gen), finish)
        if on_final is not None:
            on_final(final)
        yield s.event("response.incomplete" if finish == "length" else "response.completed", response=final)
    except (asyncio.CancelledError, GeneratorExit):
        gen.close("disconnect")
        raise
    except Exception as e:
        logger.error("request %s failed mid-stream: %r", gen.request_id, e)
        err = engine_error(e)
        yield s.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        gen.close()

"""/v1/messages: Anthropic's Messages API (and /v1/messages/count_tokens), for clients written against it.

As /v1/responses does, a request is translated into a chat completion request (`to_chat_body`: `system` -> a system
message; text, image, tool_use and tool_result blocks -> their chat spellings; `tools` with `input_schema` ->
function tools; `tool_choice` auto / any / tool / none -> auto / required / a named function / none; `thinking`
-> the template's enable_thinking and a thinking_token_budget) and runs the chat path, so sampling, forced tool
calls, the tool-call and reasoning parsers behave as there. The answer is a `message` whose `content` holds
thinking, text and tool_use blocks, or, streamed, Anthropic's events (message_start, content_block_start /
_delta / _stop, message_delta, message_stop). Errors have Anthropic's body: {"type": "error", "error": {"type",
"message"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from streamer.server.generation import Generation, engine_error
from streamer.server.protocol import APIError, _show, dumps, parse_chat
from streamer.server.responding import collect_choices
from streamer.server.responses import ChatFormat, Choice
from streamer.server.sse import sse_response

if TYPE_CHECKING:
    from streamer.server.app import OpenAIServer

logger = logging.getLogger("streamer.server")

# Fields passed to the chat request as they are.
_SAME = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")
# vLLM's sampling extensions, accepted here too (as vLLM's Messages endpoint does).
_EXTRA = ("min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens", "ignore_eos",
          "chat_template_kwargs", "priority", "thinking_token_budget")
# Anthropic's error types by status
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def to_chat_body(body: dict, can_budget: bool = False) -> dict[str, Any]:
    """The chat completion request that computes this message (APIError naming the Messages field). can_budget:
    the server counts reasoning tokens (a reasoning parser with think tags), so `thinking.budget_tokens` holds."""
    if body.get("max_tokens") is None:
        raise APIError("max_tokens is required", param="max_tokens")
    chat: dict[str, Any] = {k: body[k] for k in (*_SAME, *_EXTRA) if k in body}
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if user is not None:
        chat["user"] = user
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError(f"messages must be a non-empty array, got {_show(raw)}", param="messages")
    for i, m in enumerate(raw):
        messages += _message(m, i)
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    _tool_choice(body.get("tool_choice"), chat)
    _thinking(body.get("thinking"), chat, can_budget)
    _output_config(body.get("output_config"), chat)
    return chat


def omits_thinking(body: dict) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


def _text(content: Any, param: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "\n".join(b["text"] for b in content)
    raise APIError(f"{param} must be a string or an array of text blocks, got {_show(content)}", param=param)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool_result blocks become tool messages (before the user's other
    content, as they answer the previous turn's calls); tool_use blocks become the assistant's tool_calls."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise APIError(f"{param} must be {{\"role\": \"user\" | \"assistant\", \"content\": ...}}, got {_show(m)}",
                       param="messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(f"{param}.content must be a string or an array of blocks, got {_show(content)}",
                       param="messages")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"{param}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), where)}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise APIError(f"{where}: a tool_use block needs a string id and name", param="messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = b.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking is not shown to the model again (as chat templates drop it)
        else:
            raise APIError(f"{where} has type {_show(kind)}: text, image (user), tool_use (assistant), "
                           "tool_result (user) and thinking blocks are supported", param="messages")
    out = list(results)
    if parts or calls or not results:
        texts = all(p["type"] == "text" for p in parts)
        turn: dict[str, Any] = {"role": role, "content": "".join(p["text"] for p in parts) if texts else parts}
        if calls:
            turn["tool_calls"] = calls
            if not parts:
                turn["content"] = None
        out.append(turn)
    return out


def _image_url(source: Any, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise APIError(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or {{\"type\": "
                   f"\"url\", \"url\"}}, got {_show(source)}", param="messages")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(f"tools must be an array, got {_show(tools)}", param="tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type", "custom") != "custom":
            raise APIError(f"only custom tools ({{\"name\", \"input_schema\"}}) are supported, got {_show(t)}",
                           param="tools")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        for key in ("description", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
        raise APIError(f"tool_choice must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": \"tool\", "
                       f"\"name\": ...}}, got {_show(choice)}", param="tool_choice")
    chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
        {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any], can_budget: bool) -> bool:
    """`thinking`: "enabled" (with budget_tokens), "adaptive" or "between_tools" ask the template to think
    (enable_thinking, as Qwen3's and others' read it), "disabled" asks it not to; budget_tokens holds the reasoning
    to that many tokens where reasoning tokens can be counted. A request's own chat_template_kwargs win. Returns
    whether the thinking is to be omitted from the answer (`display: "omitted"`)."""
    if thinking is None:
        return False
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
        raise APIError(f"thinking must be {{\"type\": \"enabled\", \"budget_tokens\": N}}, {{\"type\": \"adaptive\"}}, "
                       f"{{\"type\": \"between_tools\"}} or {{\"type\": \"disabled\"}}, got {_show(thinking)}",
                       param="thinking")
    kwargs = chat.get("chat_template_kwargs")
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled",
                                    **(kwargs if isinstance(kwargs, dict) else {})}
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise APIError(f"thinking.budget_tokens must be an integer >= 0, got {_show(budget)}",
                           param="thinking.budget_tokens")
        if can_budget:
            chat.setdefault("thinking_token_budget", budget)
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise APIError(f"thinking.display must be 'summarized' or 'omitted', got {_show(display)}",
                       param="thinking.display")
    return display == "omitted"


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """`output_config`: `format` {"type": "json_schema", "schema"} holds the text to the schema; `effort` is the
    template's reasoning_effort ("max" as the highest there is)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise APIError(f"output_config must be an object, got {_show(config)}", param="output_config")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(f"output_config.format must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, got "
                           f"{_show(fmt)}", param="output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise APIError(f"output_config.effort must be low, medium, high, xhigh or max, got {_show(effort)}",
                           param="output_config.effort")
        chat["reasoning_effort"] = "xhigh" if effort == "max" else effort


def stop_reason(c: Choice | Any, called: bool) -> tuple[Optional[str], Optional[str]]:
    """(Anthropic's stop_reason, stop_sequence) for a finished chat choice (or a piece that finishes one);
    called: it made tool calls (a forced named call finishes with chat's "stop", as OpenAI's does)."""
    finish = c.finish_reason
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls" or (called and finish == "stop"):
        return "tool_use", None
    if finish == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("end_turn", None) if finish in ("stop", "abort") else (None, None)


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):  # (a model's arguments: not JSON, or nested too deep to read)
        return {}


def usage(gen: Generation, fmt: ChatFormat) -> dict[str, Any]:
    """Anthropic's: input_tokens leaves out those read from the (prefix) cache, counted apart."""
    u = fmt.usage(gen)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out = {"input_tokens": u["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": cached, "output_tokens": u["completion_tokens"]}
    details = u.get("completion_tokens_details")
    if details is not None:  # (counted between the think tags, the tags' own left out)
        out["output_tokens_details"] = {"thinking_tokens": details["reasoning_tokens"]}
    return out


def message(msg_id: str, model: str, c: Choice, gen: Generation, fmt: ChatFormat,
            omit_thinking: bool = False) -> dict[str, Any]:
    """omit_thinking: `thinking.display: "omitted"`, the thinking block is there, its text is not."""
    content: list[dict[str, Any]] = []
    if c.reasoning:
        content.append({"type": "thinking", "thinking": "" if omit_thinking else c.reasoning, "signature": ""})
    if c.text and (c.text.strip() or not c.tool_calls):
        content.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": _input(fn["arguments"])})
    reason, sequence = stop_reason(c, bool(c.tool_calls))
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(gen, fmt)}


class MessagesAPI:
    """The /v1/messages routes."""

    def __init__(self, server: "OpenAIServer") -> None:
        self.server = server

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        try:
            return await self._create(request)
        except APIError as e:
            return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await self.server._json(request)
            chat = parse_chat(to_chat_body({**body, "max_tokens": 1}), self.server.engine.sampling_defaults)
            _, prompt, _ = await self.server._prepare_chat(chat)  # (a 404 for a model not served)
            return JSONResponse({"input_tokens": len(prompt["prompt_token_ids"])})
        except APIError as e:
            return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    async def _create(self, request: Request) -> Response:
        body = await self.server._json(request)
        chat = parse_chat(to_chat_body(body, self.server.think_tags() is not None),
                          self.server.engine.sampling_defaults)
        if chat.params.n != 1:
            raise APIError("n is not part of the Messages API", param="n")
        gen, fmt = await self.server.start_chat(chat)
        msg_id = f"msg_{uuid.uuid4().hex}"
        headers = {"X-Request-Id": gen.request_id}
        omit = omits_thinking(body)
        if chat.stream:
            return sse_response(_events(msg_id, gen, fmt, omit), headers=headers,
                                background=BackgroundTask(gen.close))
        choices = await collect_choices(request, gen, fmt)
        if choices is None:
            return Response(status_code=499)
        return JSONResponse(message(msg_id, gen.model, choices[0], gen, fmt, omit), headers=headers)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **data}) + b"\n\n"


class _Blocks:
    """The content blocks of one streamed message: one open at a time, opened by its first content."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[str] = None  # "thinking" | "text" | "tool_use"

    def start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, kind: str, delta: Optional[dict[str, Any]]) -> list[bytes]:
        """delta None: only open the block (an omitted thinking block's text is not sent)."""
        out = []
        if self.open != kind:
            empty = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]
            out = self.start(kind, empty)
        if delta is not None:
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # (no signature: nothing here checks one)
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return out + [_event("content_block_stop", {"index": self.index})]


async def _events(msg_id: str, gen: Generation, fmt: ChatFormat, omit_thinking: bool) -> AsyncIterator[bytes]:
    head = {"id": msg_id, "type": "message", "role": "assistant", "model": gen.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {**{k: v for k, v in usage(gen, fmt).items() if k != "output_tokens_details"}, "output_tokens": 0}}
    yield _event("message_start", {"message": head})
    yield _event("ping", {})
    blocks = _Blocks()
    reason: tuple[Optional[str], Optional[str]] = (None, None)
    finish: Optional[str] = None
    blank = ""  # whitespace not yet sent: a text block opens only for real text (or at the end, with no calls)
    called = False
    try:
        async for p, out in gen.items():
            piece = fmt.piece(0, p, out)
            if piece.reasoning:
                delta = None if omit_thinking else {"type": "thinking_delta", "thinking": piece.reasoning}
                for e in blocks.delta("thinking", delta):
                    yield e
            if piece.text:
                if piece.text.strip() or blocks.open == "text":
                    for e in blocks.delta("text", {"type": "text_delta", "text": blank + piece.text}):
                        yield e
                    blank = ""
                else:
                    blank += piece.text
            for call in piece.tool_calls or []:
                called, blank = True, ""
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    for e in blocks.start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                       "input": {}}):
                        yield e
                if fn.get("arguments"):
                    yield _event("content_block_delta", {"index": blocks.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}})
            if piece.finish_reason is not None:
                finish, reason = piece.finish_reason, stop_reason(piece, called)
        if finish == "abort":
            raise APIError("the request was aborted: the server is shutting down", 503, "service_unavailable")
        if blank and not called:
            for e in blocks.delta("text", {"type": "text_delta", "text": blank}):
                yield e
        for e in blocks.stop():
            yield e
        yield _event("message_delta", {"delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                                       "usage": {k: v for k, v in usage(gen, fmt).items()
                                                 if k in ("output_tokens", "output_tokens_details")}})
        yield _event("message_stop", {})
    except (asyncio.CancelledError, GeneratorExit):
        gen.close("disconnect")
        raise
    except Exception as e:
        logger.error("request %s failed mid-stream: %r", gen.request_id, e)
        yield _event("error", {"error": error_body(engine_error(e))["error"]})
    finally:
        gen.close()

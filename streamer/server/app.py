"""The OpenAI-compatible HTTP app: starlette routes over an `AsyncEngine` that runs on the same event loop."""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from streamer.engine import prompt_embeds
from streamer.engine.async_engine import AsyncEngine
from streamer.engine.beam_search import BeamSearchAborted
from streamer.engine.thinking import ThinkTags
from streamer.multimodal.audio import AudioBackendMissing
from streamer.multimodal.audio_prompts import load_audio
from streamer.multimodal.inputs import VideoBackendMissing, load_image, load_video
from streamer.multimodal.media_fetch import FetchPolicy
from streamer.multimodal.processors.qwen_video_processor import DEFAULT_FPS as DEFAULT_VIDEO_FPS
from streamer.outputs import StreamOutput
from streamer.server.audio_api import AudioAPI, TranscriptionConfig
from streamer.server.chat_template import ChatTemplate
from streamer.server.embeddings import classify, embeddings, rerank, score
from streamer.server.generation import Generation, engine_error
from streamer.server.harmony import REASONING_PARSER as HARMONY_REASONING_PARSER
from streamer.server.harmony import TOOL_PARSER as HARMONY_TOOL_PARSER
from streamer.server.harmony import is_harmony_model
from streamer.server.messages_api import MessagesAPI
from streamer.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    PromptInput,
    _show,
    message_audios,
    message_images,
    message_videos,
    parse_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from streamer.server.reasoning import KEEPS_SPECIAL_TOKENS as REASONING_KEEPS_SPECIAL_TOKENS
from streamer.server.reasoning import PARSERS as REASONING_PARSERS
from streamer.server.reasoning import ReasoningMode, reasoning_mode
from streamer.server.responding import JSONResponse, _ClientGone, collect_choices, run_unless_disconnected
from streamer.server.response_store import DEFAULT_MAX_COUNT as DEFAULT_RESPONSES_STORE_SIZE
from streamer.server.responses import ChatFormat, Choice, CompletionFormat, Format
from streamer.server.responses_api import ResponsesAPI
from streamer.server.sse import sse_response, stream_events
from streamer.server.structured import strict_tool_tag
from streamer.server.tool_calls import TOOL_CALL_PARSERS
from streamer.threads import to_own_thread

logger = logging.getLogger("streamer.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20  # the default for models that take media or prompt_embeds, and the auto limit's cap
MIN_AUTO_BODY_BYTES = 1 << 20


def auto_max_body_bytes(engine: AsyncEngine) -> int:
    """--max-body-bytes when none is given. A text-only model: the most a request to it could need, so that a body
    far past what the model can take is refused by its Content-Length before a byte of it is read (reading and
    parsing 8 MB costs the event loop ~20 ms that every other request waits through): max_model_len tokens of
    the longest text a token spells, at 12 bytes a character (an escaped surrogate pair, JSON's worst case), at
    least 1 MiB (batches, tools, schemas) and at most 8 MiB. A model that takes media, or a server with
    prompt_embeds: 8 MiB (base64 images and tensors)."""
    if engine.takes_media or engine.config.enable_prompt_embeds:
        return DEFAULT_MAX_BODY_BYTES
    text = 12 * engine.max_model_len * engine.tokenizer.max_token_chars
    return min(max(text, MIN_AUTO_BODY_BYTES), DEFAULT_MAX_BODY_BYTES)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def default_served_name(engine: AsyncEngine) -> str:
    if engine.config.model is None:
        from streamer.demo_model import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    return Path(engine.config.model).expanduser().resolve().name


class OpenAIServer:
    """The endpoints. Every client mistake is an APIError, answered as a 4xx before any SSE byte."""

    def __init__(self, engine: AsyncEngine, served_model_name: Optional[str | Sequence[str]],
                 max_body_bytes: Optional[int],
                 tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None) -> None:
        self.engine = engine
        # Several names (vLLM's `--served-model-name a b`): requests may use any; the first is the one reported.
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.served_names = names or [default_served_name(engine)]
        self.model_name = self.served_names[0]
        self.model_aliases = {*self.served_names, engine.model_name}
        if engine.metrics is not None:  # label metrics with the name clients use, as vLLM does
            engine.metrics.model_name = self.model_name
        self.max_body_bytes = auto_max_body_bytes(engine) if max_body_bytes is None else max_body_bytes
        self.return_tokens_as_token_ids = False  # vLLM's --return-tokens-as-token-ids
        # Hold "auto" tool calls to their tools' schemas as if every tool were strict (server/structured.py)
        self.enforce_strict_tool_calling = False
        # vLLM's --enable-log-requests: each request's prompt (cut to max_log_len characters / ids) and parameters
        self.log_requests = False
        self.max_log_len: Optional[int] = None
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
        if reasoning_parser is None:  # the engine's (whose thinking_token_budget counts between its tags)
            reasoning_parser = engine.config.reasoning_parser
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
        engine_config = engine.engine.model_config if engine.engine is not None else None
        if engine_config is not None and is_harmony_model(engine_config.architecture) \
                and tool_call_parser is None and reasoning_parser is None:
            # gpt-oss writes its answer in channels: unread, a client would see them all run together
            tool_call_parser, reasoning_parser = HARMONY_TOOL_PARSER, HARMONY_REASONING_PARSER
            logger.info("gpt-oss: reading its harmony channels (reasoning, content, tool calls) in chat output")
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._think_tags: dict[str, Optional[ThinkTags]] = {}
        images = engine.image_prompts
        self.chat_template = ChatTemplate.from_tokenizer(
            engine.tokenizer, images.placeholder if images is not None else None,
            images.video_placeholder if images is not None else None,
            audio_placeholder=images.audio_placeholder if images is not None else None)
        self.created = int(time.time())

    # ------------------------------------------------------------------ generation endpoints
    async def completions(self, request: Request) -> Response:
        req = parse_completion(await self._json(request), self.engine.sampling_defaults)
        lora = self._check_model(req.model)
        if req.beam_search is not None:
            return await self._beam_search(request, req, lora)
        prompts = await self._embedded_prompts(req.prompt_embeds) + req.prompts
        gen = await self._start("cmpl", prompts, req, lora=lora)
        gen.scored_only = req.scored_only
        echo = [self._prompt_text(p) for p in req.prompts] if req.echo else None
        fmt = CompletionFormat(len(prompts) * req.params.n, req.logprobs, req.return_token_ids, echo,
                               req.params.n, self.engine.tokenizer.decode_token, req.prompt_logprobs,
                               req.scored_only)
        fmt.tokens_as_ids = self._tokens_as_ids(req)
        if req.return_token_ids:
            fmt.prompt_ids = [s.prompt_token_ids for s in gen.streams]
        if req.best_of is None:
            return await self._respond(request, gen, fmt, req)
        fmt.sums_logprobs = True
        choices = await collect_choices(request, gen, fmt)
        if choices is None:
            return Response(status_code=499)
        return self._response(gen, fmt, best_choices(choices, req.best_of, req.n))

    async def chat(self, request: Request) -> Response:
        req = parse_chat(await self._json(request), self.engine.sampling_defaults)
        if req.beam_search is not None:
            return await self._chat_beam_search(request, req)
        gen, fmt = await self.start_chat(req)
        return await self._respond(request, gen, fmt, req)

    async def _chat_beam_search(self, request: Request, req: ChatRequest) -> Response:
        """use_beam_search on chat: the n best beams as the n choices, each read as a chat answer (reasoning and
        tool-call parsers included)."""
        lora, prompt, fmt = await self._prepare_chat(req)
        if "multi_modal_data" in prompt:
            raise APIError("use_beam_search does not take images or videos", param="use_beam_search")
        try:
            out = await run_unless_disconnected(request, self.engine.beam_search(
                {"prompt_token_ids": prompt["prompt_token_ids"]}, req.beam_search, lora_request=lora))
        except _ClientGone:
            return Response(status_code=499)
        except BeamSearchAborted as e:
            raise _aborted(e) from None
        except Exception as e:
            raise engine_error(e, chat=True) from None
        choices = []
        for i, s in enumerate(out.sequences):
            c = Choice()
            c.add(fmt.piece(i, 0, StreamOutput("", i, s.token_ids, s.text,
                                               finish_reason="stop" if s.finished else "length")))
            choices.append(fmt.final_choice(i, c))
        prompt_tokens, completion = len(out.prompt_token_ids), sum(len(s.token_ids) for s in out.sequences)
        return JSONResponse({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                             "created": int(time.time()), "model": lora or self.model_name, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                       "total_tokens": prompt_tokens + completion}})

    async def _beam_search(self, request: Request, req: CompletionRequest, lora: Optional[str]) -> Response:
        """use_beam_search: each prompt's n best beams as its n choices (finish_reason "stop" for a beam that ended
        with an eos)."""
        try:
            outs = await run_unless_disconnected(request, asyncio.gather(*(self.engine.beam_search(
                p if isinstance(p, str) else {"prompt_token_ids": p}, req.beam_search, lora_request=lora)
                for p in req.prompts)))
        except _ClientGone:
            return Response(status_code=499)
        except BeamSearchAborted as e:
            raise _aborted(e) from None
        except Exception as e:
            raise engine_error(e) from None
        choices, completion = [], 0
        for out in outs:
            for s in out.sequences:
                choices.append({"index": len(choices), "text": s.text, "logprobs": None,
                                "finish_reason": "stop" if s.finished else "length", "stop_reason": None})
                completion += len(s.token_ids)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                             "model": lora or self.model_name, "choices": choices,
                             "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                       "total_tokens": prompt + completion}})

    async def start_chat(self, req: ChatRequest, progress: bool = False) -> tuple[Generation, ChatFormat]:
        """Render, tokenize and start a chat request (also the Responses API's way in). `progress`: outputs come
        step by step even when the response is not streamed (a background response shows them as it goes)."""
        lora, prompt, fmt = await self._prepare_chat(req)
        gen = await self._start("chatcmpl", [prompt], req, chat=True, lora=lora, progress=progress)
        if req.return_token_ids:
            fmt.prompt_ids = [gen.streams[0].prompt_token_ids]  # (images expanded: what the model read)
        return gen, fmt

    async def _encode(self, text: str, add_special_tokens: bool, keep_last: Optional[int] = None,
                      chat: bool = False) -> list[int]:
        """A rendered prompt's token ids (`AsyncEngine.encode`); one too long to tokenize is a 400."""
        try:
            return await self.engine.encode(text, add_special_tokens, keep_last)
        except ValueError as e:
            raise engine_error(e, chat) from None

    async def _prepare_chat(self, req: ChatRequest) -> tuple[Optional[str], dict[str, Any], ChatFormat]:
        """The adapter a chat request names, its rendered and tokenized prompt (with its images) and how its
        output reads (tool-call and reasoning parsers)."""
        lora = self._check_model(req.model)
        text = self.chat_template.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                         req.tools, req.template_kwargs)
        sources = message_images(req.messages)
        images = self.engine.image_prompts
        # (the template placed the specials; a model's image placeholders may expand to text first: Gemma 3's)
        ids = await self._encode(images.expand_text(text) if sources and images else text, False,
                                 None if sources else req.params.truncate_prompt_tokens, chat=True)
        parse_tools = self.tool_call_parser is not None and req.tools is not None and req.tool_choice != "none"
        if parse_tools and req.forced_tool is None and req.params.structured_outputs is None:
            tag = strict_tool_tag(self.tool_call_parser, req.tools, self.enforce_strict_tool_calling,  # type: ignore
                                  req.messages, self.engine.tokenizer.token_to_id("[ARGS]") is not None)
            if tag is not None:
                req.params = req.params.clone(structured_outputs=tag)
        harmony = HARMONY_REASONING_PARSER == self.reasoning_parser or HARMONY_TOOL_PARSER == self.tool_call_parser
        if (harmony or (parse_tools and self.tool_call_parser == "mistral")
                or self.reasoning_parser in REASONING_KEEPS_SPECIAL_TOKENS) and req.forced_tool is None:
            # As vLLM: [TOOL_CALLS], [THINK] and gpt-oss's channel tags are special tokens, which the text would
            # otherwise leave out.
            req.params = req.params.clone(skip_special_tokens=False)
        reasoning = None
        if harmony:
            reasoning = ReasoningMode(split=False, include=req.include_reasoning)
        elif self.reasoning_parser is not None:
            so = req.params.structured_outputs  # (a structural tag leaves the text free: reasoning is read)
            reasoning = reasoning_mode(self.reasoning_parser, text, req.template_kwargs,
                                       constrained=so is not None and so.structural_tag is None,
                                       forced_tool=req.forced_tool is not None, include=req.include_reasoning)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        videos, audios = message_videos(req.messages), message_audios(req.messages)
        if sources or videos or audios:
            prompt["multi_modal_data"] = await self._load_media(sources, videos, audios)
        fmt = ChatFormat(req.params.n, req.top_logprobs, req.return_token_ids, req.prompt_logprobs,
                         self.tool_call_parser if parse_tools else False, req.forced_tool, reasoning,
                         tools=req.tools, harmony=harmony)
        tags = self.think_tags()
        if tags is not None and reasoning is not None:
            fmt.count_reasoning(tags, reasoning.inside, reasoning.split)
        fmt.tokens_as_ids = self._tokens_as_ids(req)
        return lora, prompt, fmt

    def think_tags(self) -> Optional[ThinkTags]:
        """The reasoning parser's tags as token ids, to count reasoning tokens in usage (None: no parser, or
        gpt-oss's channels)."""
        parser = self.reasoning_parser
        if parser is None:
            return None
        if parser not in self._think_tags:
            self._think_tags[parser] = ThinkTags.of(
                parser, lambda text: self.engine.tokenizer.encode(text, add_special_tokens=False))
        return self._think_tags[parser]

    def _tokens_as_ids(self, req: CompletionRequest | ChatRequest) -> bool:
        """Logprobs name tokens "token_id:{id}": the request's return_tokens_as_token_ids, else the server's."""
        return req.tokens_as_ids if req.tokens_as_ids is not None else self.return_tokens_as_token_ids

    async def _load_images(self, sources: list[Any]) -> list[Any]:
        """The chat's images, decoded (and fetched, for http(s) URLs the server may fetch) on worker threads."""
        policy = FetchPolicy.of(self.engine.config)
        limit = self.engine.config.limit_images_per_prompt
        if len(sources) > limit:
            raise APIError(f"at most {limit} images per request, got {len(sources)}", param="messages")

        async def one(src: Any) -> Any:
            return src if not isinstance(src, str) else await to_own_thread(load_image, src, policy)
        try:
            return list(await asyncio.gather(*(one(s) for s in sources)))
        except ValueError as e:
            raise APIError(str(e), param="messages", code="invalid_image") from None

    async def _load_audio(self, urls: list[str]) -> list[Any]:
        """The chat's audio clips, decoded (and fetched, for http(s) URLs the server may fetch) on threads of their
        own (PyAV's decoders and the resampler are host work)."""
        policy = FetchPolicy.of(self.engine.config)
        limit = self.engine.config.limit_images_per_prompt
        if len(urls) > limit:
            raise APIError(f"at most {limit} audio clips per request, got {len(urls)}", param="messages")
        try:
            return list(await asyncio.gather(*(to_own_thread(load_audio, url, policy) for url in urls)))
        except AudioBackendMissing as e:
            raise APIError(str(e), param="messages", code="audio_backend_missing") from None
        except ValueError as e:
            raise APIError(str(e), param="messages", code="invalid_audio") from None

    async def _load_media(self, sources: list[Any], videos: list[str], audios: list[str] = ()) -> dict[str, Any]:
        """multi_modal_data for the chat's images, videos (video_url parts, decoded with PyAV on worker threads,
        sampled at the video processor's fps) and audio clips (`_load_audio`)."""
        data: dict[str, Any] = {}
        if sources:
            data["image"] = await self._load_images(sources)
        if audios:
            data["audio"] = await self._load_audio(audios)
        if not videos:
            return data
        policy = FetchPolicy.of(self.engine.config)
        limit = self.engine.config.limit_images_per_prompt
        if len(videos) > limit:
            raise APIError(f"at most {limit} videos per request, got {len(videos)}", param="messages")
        mm = self.engine.image_prompts
        fps = (mm.video_processor.fps if mm is not None and mm.takes_video else None) or DEFAULT_VIDEO_FPS
        try:
            data["video"] = list(await asyncio.gather(*(to_own_thread(load_video, url, policy, fps)
                                                        for url in videos)))
        except VideoBackendMissing as e:
            raise APIError(str(e), param="messages", code="video_backend_missing") from None
        except ValueError as e:
            raise APIError(str(e), param="messages", code="invalid_video") from None
        return data

    async def _start(self, prefix: str, prompts: Sequence[Any], req: CompletionRequest | ChatRequest,
                     chat: bool = False, lora: Optional[str] = None, progress: bool = False) -> Generation:
        """lora: the LoRA adapter the client named as its `model` (None: the base model). A non-streamed request's
        outputs come in one piece per choice, when it finishes, unless `progress` asks for them step by step."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        if self.log_requests:
            self._log_request(rid, prompts, req, lora)
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(
                    prompt, req.params, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                    priority=req.priority, cache_salt=req.cache_salt, lora_request=lora,
                    stream=req.stream or progress))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, Exception):
                err = engine_error(e, chat)
                if err.param == "structured_outputs" and req.structured_field is not None:
                    # e.g. an invalid schema in response_format: name the field the client wrote
                    err.param = req.structured_field
                    err.message = re.sub(r"^structured_outputs\.\w+", req.structured_field, err.message)
                raise err.rename("max_tokens", req.max_tokens_field) from None
            raise
        return Generation(rid, streams, req.params.n, model=lora or self.model_name)

    def _log_request(self, rid: str, prompts: Sequence[Any], req: CompletionRequest | ChatRequest,
                     lora: Optional[str]) -> None:
        cut = self.max_log_len
        for i, prompt in enumerate(prompts):
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            if isinstance(text, list):
                text, ids = None, text
            if isinstance(prompt, dict) and "prompt_embeds" in prompt:
                text = f"<prompt_embeds of shape {list(prompt['prompt_embeds'].shape)}>"
            logger.info("request %s%s received: prompt: %r, prompt_token_ids: %s, params: %s, lora: %s", rid,
                        f" (prompt {i})" if len(prompts) > 1 else "", text[:cut] if text is not None else None,
                        ids[:cut] if ids is not None else None, req.params, lora)

    async def _respond(self, request: Request, gen: Generation, fmt: Format,
                       req: CompletionRequest | ChatRequest) -> Response:
        if req.stream:
            head = {"id": gen.request_id, "object": fmt.chunk_object, "created": int(time.time()),
                    "model": gen.model}
            # The background task also runs when the client left before the body started streaming.
            return sse_response(stream_events(gen, fmt, head, req.include_usage, req.continuous_usage),
                                headers={"X-Request-Id": gen.request_id}, background=BackgroundTask(gen.close))
        choices = await collect_choices(request, gen, fmt)
        if choices is None:
            return Response(status_code=499)
        return self._response(gen, fmt, choices)

    def _response(self, gen: Generation, fmt: Format, choices: list[Choice]) -> Response:
        """A non-streamed response: the choices in order, the usage of everything generated."""
        return JSONResponse({"id": gen.request_id, "object": fmt.object, "created": int(time.time()),
                             "model": gen.model, "choices": [fmt.final_choice(i, c) for i, c in enumerate(choices)],
                             "usage": fmt.usage(gen), **fmt.response_extras(choices)},
                            headers={"X-Request-Id": gen.request_id})

    async def embeddings(self, request: Request) -> Response:
        return await embeddings(self, request)

    async def classify(self, request: Request) -> Response:
        return await classify(self, request)

    async def score(self, request: Request) -> Response:
        return await score(self, request)

    async def rerank(self, request: Request) -> Response:
        return await rerank(self, request)

    # ------------------------------------------------------------------ other endpoints
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: one card (OpenAI's retrieve), 404 for a name this server does not serve."""
        name = request.path_params["model"]
        card = next((c for c in self._model_cards() if c["id"] == name), None)
        if card is None:
            raise APIError(f"The model `{name}` does not exist.", 404, param="model", code="model_not_found")
        return JSONResponse(card)

    def _model_cards(self) -> list[dict[str, Any]]:
        root = str(self.engine.engine.model_dir if self.engine.engine else self.engine.model_name)
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": "streamer", "root": root,
                  "parent": None, "max_model_len": self.engine.max_model_len} for name in self.served_names]
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "streamer",
                     "root": str(a.path), "parent": self.model_name, "max_model_len": self.engine.max_model_len}
                    for name, a in self._loras().items()]
        return [*cards, *adapters]

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's `{"lora_name", "lora_path"}`: read and register an adapter (400 when it cannot be)."""
        body = await self._json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        for field_name, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise APIError(f"{field_name} must be a non-empty string", param=field_name)
        if name in self.model_aliases:
            raise APIError(f"{name!r} is the base model's name", param="lora_name")
        try:
            await self.engine.add_lora(name, path)
        except ValueError as e:
            raise APIError(str(e), param="lora_path" if name not in self._loras() else "lora_name") from None
        except OSError as e:  # a path too long, not readable, not a folder: the client's path, a 400
            raise _unreadable("lora_path", path, e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def update_weights_from_disk(self, request: Request) -> Response:
        """SGLang's `{"model_path"}`: a checkpoint of the served model (the next step of RL training) loaded in
        place between two steps; the prefix cache is reset. 400 for a folder that is not one (nothing changed)."""
        body = await self._json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise APIError("model_path must be a non-empty string", param="model_path")
        try:
            await self.engine.update_weights(path)
        except ValueError as e:
            raise APIError(str(e), param="model_path") from None
        except OSError as e:  # missing, a path too long, not readable (nothing was loaded): the client's path
            raise _unreadable("model_path", path, e) from None
        except RuntimeError as e:
            raise APIError(str(e), 500, "server_error") from None
        return JSONResponse({"success": True, "message": f"weights updated from {path}"})

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await self._json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self._loras():
            raise APIError(f"The LoRA adapter {name!r} is not loaded.", 404, param="lora_name",
                           code="model_not_found")
        self.engine.remove_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def invocations(self, request: Request) -> Response:
        """SageMaker's (and vLLM's) one endpoint: a body with `messages` is a chat completion, with `prompt` a
        completion, with `input` an embedding (a classifier's: classification) request."""
        raw = await self._body(request)
        body = parse_body(raw)
        if "messages" in body:
            route = self.chat
        elif "prompt" in body:
            route = self.completions
        elif "input" in body:
            route = self.classify if self.engine.classifier is not None else self.embeddings
        else:
            raise APIError("an /invocations body needs `messages` (chat), `prompt` (completions) or `input` "
                           "(embeddings)", param=None)
        return await route(Request(request.scope, _replay(raw, request.receive)))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.engine.is_alive else 503)

    async def version(self, request: Request) -> Response:
        from streamer import __version__
        return JSONResponse({"version": __version__})

    async def pause_generation(self, request: Request) -> Response:
        """SGLang's POST /pause_generation {"mode": "keep" | "abort" | "retract"} (RL weight syncs): no step runs
        until /continue_generation; answers once the step in flight is done."""
        body = await self._body(request)
        mode = parse_body(body).get("mode", "keep") if body.strip() else "keep"
        try:
            n = await self.engine.pause_generation(mode)
        except ValueError as e:  # (the only field)
            raise APIError(str(e), param="mode") from None
        except Exception as e:
            raise engine_error(e) from None
        return JSONResponse({"paused": True, "mode": mode, "requests": n})

    async def continue_generation(self, request: Request) -> Response:
        await self.engine.resume_generation()
        return JSONResponse({"paused": False})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.engine.is_paused})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's POST /reset_prefix_cache (a benchmark's cold start; new weights): every cached prefix forgotten."""
        try:
            n = await self.engine.reset_prefix_cache()
        except Exception as e:
            raise engine_error(e) from None
        if self.engine.kv_event_sinks:  # AllBlocksCleared now, not at the next step (the server may be idle)
            self.engine._publish_kv_events()
        return JSONResponse({"reset": True, "blocks": n})

    async def metrics(self, request: Request) -> Response:
        text = self.engine.metrics.render() if self.engine.metrics is not None else ""
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        req = parse_tokenize(await self._json(request))
        self._check_model(req.model)
        sources, videos, audios = [], [], []
        if req.messages is not None:
            text = self.chat_template.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                             req.tools, req.template_kwargs)
            sources, videos = message_images(req.messages), message_videos(req.messages)
            audios = message_audios(req.messages)
        else:
            text = req.prompt or ""
        images = self.engine.image_prompts
        tokens = await self._encode(images.expand_text(text) if sources and images else text,
                                    req.add_special_tokens, chat=req.messages is not None)
        if sources or videos or audios:  # the tokens the model reads: placeholders expanded (sizes decide)
            loaded = await self._load_media(sources, videos, audios)
            try:
                tokens, _ = await to_own_thread(self.engine.place_images, tokens, loaded)
            except ValueError as e:
                raise APIError(str(e), param="messages") from None
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            out["token_strs"] = [self.engine.tokenizer.id_to_token(t) for t in tokens]  # vocabulary entries, as vLLM
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        model, tokens = parse_detokenize(await self._json(request))
        self._check_model(model)
        vocab = self.engine.tokenizer.vocab_size
        if any(t >= vocab for t in tokens):
            raise APIError(f"tokens must be in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(tokens, skip_special_tokens=False)})

    # ------------------------------------------------------------------ helpers
    async def _json(self, request: Request) -> dict:
        """The body, read with a size limit (413 past it) and parsed strictly."""
        return parse_body(await self._body(request))

    async def _body(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _loras(self) -> dict:
        return self.engine.loras if self.engine.config.enable_lora else {}

    def _check_model(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter `model` names, or None for the base model; 404 for anything else."""
        if model is None or model in self.model_aliases:
            return None
        if model in self._loras():
            return model
        raise APIError(f"The model `{model}` does not exist. This server serves `{self.model_name}`"
                       + "".join(f", `{n}`" for n in self._loras()) + ".", 404, param="model",
                       code="model_not_found")

    async def _embedded_prompts(self, items: list[str]) -> list[dict[str, Any]]:
        """vLLM's prompt_embeds as engine prompts (decoded off the loop: each is a tensor the size of a prompt)."""
        if not items:
            return []
        if not self.engine.config.enable_prompt_embeds:
            raise APIError("prompt_embeds needs the server started with --enable-prompt-embeds",
                           param="prompt_embeds")
        many = len(items) > 1
        try:
            tensors = await to_own_thread(
                lambda: [prompt_embeds.decode_base64(x, i if many else None) for i, x in enumerate(items)])
        except ValueError as e:
            raise APIError(str(e), param="prompt_embeds") from None
        return [{"prompt_embeds": t} for t in tensors]

    def _prompt_text(self, prompt: PromptInput) -> str:
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt, skip_special_tokens=False)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A receive channel that hands out a body already read, then the connection's own messages (disconnects)."""
    pending = [{"type": "http.request", "body": raw, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()
    return replay  # type: ignore[return-value]


def _aborted(e: BeamSearchAborted) -> APIError:
    """A beam search whose steps were aborted (shutdown, pause_generation "abort"): a 503, as an aborted request."""
    return APIError(f"the request was aborted: {e}", 503, "service_unavailable")


def _unreadable(param: str, path: str, e: OSError) -> APIError:
    """An OSError from reading a path the client named: a 400 naming the field (the path cut short: it may be
    thousands of characters)."""
    if e.strerror is None:  # raised with a message of its own (a missing folder)
        reason = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."
    else:
        reason = e.strerror + (f" ({_show(e.filename)})" if isinstance(e.filename, str) and e.filename != path
                               else "")
    return APIError(f"{param} {_show(path)} cannot be read: {reason}", param=param, code="invalid_path")


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes (the server's --max-body-bytes)", 413,
                    code="request_too_large")


def best_choices(choices: list[Choice], best_of: int, n: int) -> list[Choice]:
    """Per prompt, the n of its best_of sequences with the highest cumulative logprob, likeliest first (OpenAI's
    best_of; ties keep the sampling order)."""
    kept: list[Choice] = []
    for start in range(0, len(choices), best_of):
        group = choices[start:start + best_of]
        kept += sorted(group, key=lambda c: -c.cumulative_logprob)[:n]
    return kept


# ---------------------------------------------------------------------------------------------- auth
@dataclass(frozen=True)
class CORSConfig:
    """Which browser origins may call the API (`--allowed-origins`; off unless given: a page on any site could
    otherwise drive a server on the user's own machine)."""
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


_OPEN_PATHS = frozenset({"/health", "/ping"})


class BearerAuth:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every path but the health checks /health
    and /ping (load balancers probe them without a key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS and not self._authorized(scope):
            err = APIError("invalid or missing API key: send `Authorization: Bearer <key>`", 401,
                           code="invalid_api_key")
            response = error_response(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.expected)
            if name == b"x-api-key":  # Anthropic's clients (/v1/messages) send the key so
                return hmac.compare_digest(value, self.expected)
        return False


# ---------------------------------------------------------------------------------------------- the app
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(str(exc.detail), exc.status_code, kind))


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody is there to read it


def _internal_error_response() -> JSONResponse:
    return error_response(APIError("internal server error", 500, "internal_server_error"))


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Starlette's ServerErrorMiddleware answers an unhandled error with this (then re-raises it: `_Unhandled`,
    outside it, logs it and keeps the connection)."""
    return _internal_error_response()


def _client_left(exc: BaseException) -> bool:
    """Whether the error is a client that went away (a write to its closed socket), seen through its causes and
    inside exception groups (anyio's task groups raise those)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (ClientDisconnect, _ClientGone)):
            return True
        stack += [x for x in (e.__cause__, e.__context__, *getattr(e, "exceptions", ())) if x is not None]
    return False


class _Unhandled:
    """The outermost layer: an error no handler took is logged once, with its traceback, and answered with a 500
    (OpenAI's error body) if the response has not started, or, if it has (a stream), its body is ended there. The
    error is not raised on to the server, which would otherwise drop the connection: a client's pooled keep-alive
    connection stays usable for its next request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def tracked(message: dict) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            # The server exits without waiting (a second SIGTERM, uvicorn's graceful-shutdown timeout) and cancels
            # the requests still running: each ends where it is, quietly (raised on, uvicorn logs a traceback for
            # every one). Nothing above this layer but uvicorn's request task awaits it.
            logger.debug("%s %s: cancelled (the server is exiting)", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError("the server is shutting down", 503, "service_unavailable")
                await self._end(scope, receive, send, started, ended, error_response(error))
            else:
                await self._end(scope, receive, send, started, ended)
        except Exception as exc:
            if _client_left(exc):
                logger.debug("%s %s: the client left", scope.get("method"), scope.get("path"))
            else:
                logger.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await self._end(scope, receive, send, started, ended, _internal_error_response())

    @staticmethod
    async def _end(scope: Scope, receive: Receive, send: Send, started: bool, ended: bool,
                   response: Optional[Response] = None) -> None:
        """`response` if nothing was sent yet, else the body ended where it is (chunked encoding stays
        well-formed, and the connection usable)."""
        try:
            if not started and response is not None:
                await response(scope, receive, send)
            elif started and not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (Exception, asyncio.CancelledError):  # the client is gone: nobody to tell
            pass


class _App(Starlette):
    def build_middleware_stack(self) -> ASGIApp:
        return _Unhandled(super().build_middleware_stack())


def build_app(engine: AsyncEngine, *, api_key: Optional[str] = None,
              served_model_name: Optional[str | Sequence[str]] = None,
              max_body_bytes: Optional[int] = None, tool_call_parser: Optional[str] = None,
              allow_lora_updates: bool = False, reasoning_parser: Optional[str] = None,
              allow_weight_updates: bool = False,
              responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE,
              cors: Optional[CORSConfig] = None, return_tokens_as_token_ids: bool = False,
              log_requests: bool = False, max_log_len: Optional[int] = None,
              enforce_strict_tool_calling: bool = False,
              transcription: Optional[TranscriptionConfig] = None) -> Starlette:
    """The app for a started engine. `app.state.server` is the OpenAIServer (and `.engine` the engine,
    `.responses` the Responses API and its store). max_body_bytes: larger bodies get 413 (None: what the model can
    take, `auto_max_body_bytes`). allow_lora_updates: serve vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter. allow_weight_updates: serve SGLang's /update_weights_from_disk, /pause_generation and /continue_generation. responses_store_size: how many responses /v1/responses keeps (0: none). cors: the
    browser origins allowed (None: no CORS headers). return_tokens_as_token_ids: logprobs name tokens
    "token_id:{id}" unless a request says otherwise. log_requests: log each request's prompt (the first
    max_log_len characters or token ids; None: all) and sampling parameters. enforce_strict_tool_calling: every
    tool is held to its schema under tool_choice "auto", as `"strict": true` holds one (where the tool-call parser's
    format allows). transcription: /v1/audio's temperature fallback (None: OpenAI's whisper's defaults)."""
    s = OpenAIServer(engine, served_model_name, max_body_bytes, tool_call_parser, reasoning_parser)
    s.return_tokens_as_token_ids = return_tokens_as_token_ids
    s.log_requests, s.max_log_len = log_requests, max_log_len
    s.enforce_strict_tool_calling = enforce_strict_tool_calling
    responses = ResponsesAPI(s, responses_store_size)
    routes = [
        Route("/v1/completions", s.completions, methods=["POST"]),
        Route("/v1/chat/completions", s.chat, methods=["POST"]),
        Route("/v1/embeddings", s.embeddings, methods=["POST"]),
        Route("/v1/classify", s.classify, methods=["POST"]),
        Route("/classify", s.classify, methods=["POST"]),
        Route("/v1/score", s.score, methods=["POST"]),
        Route("/score", s.score, methods=["POST"]),
        Route("/v1/rerank", s.rerank, methods=["POST"]),
        Route("/rerank", s.rerank, methods=["POST"]),
        Route("/v2/rerank", s.rerank, methods=["POST"]),  # (Cohere's v2 client)
        *responses.routes(),
        *MessagesAPI(s).routes(),
        *AudioAPI(s, transcription).routes(),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/v1/models/{model:path}", s.model, methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/ping", s.health, methods=["GET", "POST"]),  # SageMaker's health check
        Route("/invocations", s.invocations, methods=["POST"]),
        Route("/metrics", s.metrics, methods=["GET"]),
        Route("/version", s.version, methods=["GET"]),
        Route("/reset_prefix_cache", s.reset_prefix_cache, methods=["POST"]),
        Route("/tokenize", s.tokenize, methods=["POST"]),
        Route("/detokenize", s.detokenize, methods=["POST"]),
    ]
    if allow_weight_updates:
        routes += [Route("/update_weights_from_disk", s.update_weights_from_disk, methods=["POST"]),
                   Route("/pause_generation", s.pause_generation, methods=["POST"]),
                   Route("/continue_generation", s.continue_generation, methods=["POST"]),
                   Route("/is_paused", s.is_paused, methods=["GET"])]
    if allow_lora_updates:
        routes += [Route("/v1/load_lora_adapter", s.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", s.unload_lora_adapter, methods=["POST"])]
    middleware = []
    if cors is not None:  # outermost: a browser's preflight (OPTIONS, no key) is answered before the key check
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                                     allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                                     allow_credentials=cors.allow_credentials))
    if api_key:
        middleware.append(Middleware(BearerAuth, api_key=api_key))
    app = _App(routes=routes, middleware=middleware, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone,
        _ClientGone: _client_gone, Exception: _internal_error})
    app.state.server = s
    app.state.engine = engine
    app.state.responses = responses
    return app

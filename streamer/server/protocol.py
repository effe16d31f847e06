"""OpenAI request bodies -> validated requests. Every client mistake becomes an `APIError` (a 4xx), never a 5xx.

Validation is by hand: JSON gives a handful of types, and checking them here lets each error name its field.
Rules: null means "default" (as OpenAI does); unknown fields are ignored; bools are not numbers; numbers must be
finite; lists and nesting are bounded so that no body can make the server do unbounded work.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from streamer.sampling_params import MAX_LOGPROBS, SamplingParams, _is_int
from streamer.server import structured

try:
    import orjson

    def _loads(raw: bytes) -> Any:  # rejects NaN/Infinity, numbers that overflow and nesting past 1024
        return orjson.loads(raw)

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional
    def _reject_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    def _loads(raw: bytes) -> Any:
        return json.loads(raw, parse_constant=_reject_constant)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_DEPTH = 32  # JSON nesting (tool schemas are the deepest legitimate thing)
MAX_N = 64
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_STOP = 64
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024  # as OpenAI bounds it (300 there); the table is built once per request
MAX_MESSAGES = 4096
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

PromptInput = Union[str, list[int]]


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def rename(self, field: str, to: str) -> APIError:
        """The same error about `field` told as the client's own name for it, `to` (chat's max_completion_tokens,
        the Responses API's max_output_tokens are max_tokens inside)."""
        if self.param == field and to != field:
            self.param = to
            self.message = re.sub(rf"\b{re.escape(field)}\b", to, self.message)
        return self


# ---------------------------------------------------------------------------------------------- JSON
def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        obj = _loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(f"the request body must be a JSON object, got {_json_type(obj)}", code="invalid_json")
    _check_depth(obj)
    return obj


def _check_depth(obj: Any) -> None:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else "an object"


def _show(v: Any) -> str:
    """A short rendering of a client's value for an error message (never the whole of a huge one)."""
    try:
        text = json.dumps(v)
    except (ValueError, TypeError):  # ints beyond Python's str-conversion limit
        text = _json_type(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------- fields
def get_int(body: dict, name: str, default: Optional[int], lo: int = INT64_MIN, hi: int = INT64_MAX,
            ) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():  # 2.0 is an integer in JSON's eyes
        if abs(v) > 2 ** 53:  # a rounded one (orjson reads an integer literal past 64 bits as a float): never
            raise APIError(f"{name} must be an integer in [{lo}, {hi}], got {_show(v)}", param=name)  # in range
        v = int(v)
    if not _is_int(v):
        raise APIError(f"{name} must be an integer, got {_show(v)}", param=name)
    if not lo <= v <= hi:
        bounds = f">= {lo}" if hi == INT64_MAX else f"in [{lo}, {hi}]"
        raise APIError(f"{name} must be an integer {bounds}, got {_show(v)}", param=name)
    return v


def get_float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(f"{name} must be a number, got {_show(v)}", param=name)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or abs(f) > FLOAT32_MAX:  # sampling runs in float32: larger values overflow it
        raise APIError(f"{name} must be a finite number (within float32 range), got {_show(v)}", param=name)
    return f


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"{name} must be a boolean, got {_show(v)}", param=name)
    return v


def get_str(body: dict, name: str, default: Optional[str] = None, max_len: int = 1 << 20) -> Optional[str]:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise APIError(f"{name} must be a string, got {_show(v)}", param=name)
    if len(v) > max_len:
        raise APIError(f"{name} is longer than {max_len} characters", param=name)
    return v


def get_object(body: dict, name: str) -> dict:
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise APIError(f"{name} must be an object, got {_show(v)}", param=name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(f"stop must be a string or an array of strings, got {_show(v)}", param="stop")
    if len(stops) > MAX_STOP:
        raise APIError(f"stop may hold at most {MAX_STOP} strings", param="stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in stops):
        raise APIError(f"stop strings must be 1 to {MAX_STOP_LEN} characters long", param="stop")
    return stops


def _bad_words(body: dict) -> Optional[list[str]]:
    v = body.get("bad_words")
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_STOP or not all(isinstance(w, str) and w.strip() for w in v):
        raise APIError(f"bad_words must be an array of at most {MAX_STOP} non-empty strings, got {_show(v)}",
                       param="bad_words")
    return v


def _stop_token_ids(body: dict) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in v):
        raise APIError(f"stop_token_ids must be an array of non-negative integers, got {_show(v)}",
                       param="stop_token_ids")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids")
    return v


def _logit_bias(body: dict) -> Optional[dict[int, float]]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON object keys are strings)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise APIError(f"logit_bias must be an object mapping token ids to numbers, got {_show(v)}",
                       param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        raise APIError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or str(token) != str(key).strip():
            raise APIError(f"logit_bias keys must be token ids (integers >= 0), got {_show(key)}",
                           param="logit_bias")
        out[token] = get_float({"logit_bias": bias}, "logit_bias", 0.0)
    return out


def _allowed_token_ids(body: dict) -> Optional[list[int]]:
    v = body.get("allowed_token_ids")
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in v):
        raise APIError(f"allowed_token_ids must be a non-empty array of token ids, got {_show(v)}",
                       param="allowed_token_ids")
    return v


_LEADING_NAME = re.compile(r"[a-z_]+")


def _param_of(message: str, known: set[str]) -> Optional[str]:
    """SamplingParams' and the engine's messages start with the field they are about; "prompt (...) + max_tokens
    (...) exceeds ..." is about max_tokens, the one the client can lower."""
    if "+ max_tokens" in message:
        return "max_tokens"
    m = _LEADING_NAME.match(message)
    return m.group(0) if m and m.group(0) in known else None


_SAMPLING_FIELDS = {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "logprobs",
                    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "logit_bias",
                    "allowed_token_ids", "bad_words", "structured_outputs", "thinking_token_budget"}


def value_error(e: ValueError,
                extra_fields: frozenset[str] = frozenset({"prompt", "priority", "prompt_embeds"})) -> APIError:
    msg = str(e)
    return APIError(msg, param=_param_of(msg, _SAMPLING_FIELDS | extra_fields))


_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


def sampling_params(body: dict, *, max_tokens_field: str, default_max_tokens: Optional[int],
                    logprobs: Optional[int], defaults: Mapping[str, Any]) -> SamplingParams:
    """The sampling fields shared by both endpoints (OpenAI's plus vLLM's extensions). `defaults`: the
    server's values for fields the body leaves out (the checkpoint's generation_config.json), by SamplingParams
    name."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, **defaults}
    n = get_int(body, "n", 1, 1, MAX_N)
    assert n is not None
    max_tokens = get_int(body, max_tokens_field, None, 1, INT64_MAX)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = get_int(body, "max_tokens", None, 1, INT64_MAX)
    top_k = get_int(body, "top_k", d["top_k"], -1, INT64_MAX)
    try:
        return SamplingParams(
            n=n, max_tokens=max_tokens if max_tokens is not None else d.get("max_tokens", default_max_tokens),
            min_tokens=get_int(body, "min_tokens", 0, 0, INT64_MAX),  # type: ignore[arg-type]
            temperature=get_float(body, "temperature", d["temperature"]), top_p=get_float(body, "top_p", d["top_p"]),
            top_k=-1 if top_k == 0 else top_k,  # type: ignore[arg-type]  # vLLM reads 0 as "off" too
            min_p=get_float(body, "min_p", d["min_p"]),
            presence_penalty=get_float(body, "presence_penalty", 0.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0),
            repetition_penalty=get_float(body, "repetition_penalty", d["repetition_penalty"]),
            # torch seeds are 64-bit, and sequence i of n is seeded with seed + i
            seed=get_int(body, "seed", None, INT64_MIN, INT64_MAX - MAX_N),
            stop=_stop(body), stop_token_ids=_stop_token_ids(body),
            ignore_eos=get_bool(body, "ignore_eos", False), logprobs=logprobs,
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            skip_special_tokens=get_bool(body, "skip_special_tokens", True), logit_bias=_logit_bias(body),
            allowed_token_ids=_allowed_token_ids(body), bad_words=_bad_words(body),
            truncate_prompt_tokens=get_int(body, "truncate_prompt_tokens", None, 1, INT64_MAX),
            thinking_token_budget=get_int(body, "thinking_token_budget", None, 0, INT64_MAX))
    except ValueError as e:
        err = value_error(e)
        if err.param == "max_tokens" and max_tokens_field in body:
            err.param = max_tokens_field
        raise err from None


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class _Common:
    model: Optional[str]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk
    priority: int
    cache_salt: Optional[str]
    return_token_ids: bool
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was given: return them
    tokens_as_ids: Optional[bool] = None  # vLLM's return_tokens_as_token_ids (None: the server's default)
    structured_field: Optional[str] = None  # the field that constrains the output (errors found later name it)
    max_tokens_field: str = "max_tokens"  # the client's name for it (errors found later, as the context's, name it)


def _prediction(body: dict) -> Optional[str]:
    """OpenAI's Predicted Outputs: {"type": "content", "content": a string or text parts}."""
    v = body.get("prediction")
    if v is None:
        return None
    content = v.get("content") if isinstance(v, dict) and v.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError("prediction must be {\"type\": \"content\", \"content\": a string or text parts}, got "
                       f"{_show(v)}", param="prediction")
    return content


def _common(body: dict, params: SamplingParams) -> _Common:
    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options")
    include_usage = get_bool(options, "include_usage", False)
    if options and not stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")
    get_str(body, "user", None, 1 << 16)  # accepted and unused, as a type-checked courtesy
    cache_salt = get_str(body, "cache_salt", None, 1024)
    if cache_salt == "":
        raise APIError("cache_salt must not be empty", param="cache_salt")
    return _Common(model=get_str(body, "model", None, 1024), params=params, stream=stream,
                   include_usage=include_usage,  # (vLLM's: continuous stats only along with the last chunk's)
                   continuous_usage=include_usage and get_bool(options, "continuous_usage_stats", False),
                   priority=get_int(body, "priority", 0, -(2 ** 31), 2 ** 31 - 1),  # type: ignore[arg-type]
                   cache_salt=cache_salt, return_token_ids=get_bool(body, "return_token_ids", False),
                   prompt_logprobs=body.get("prompt_logprobs") is not None,
                   tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", None))  # type: ignore[arg-type]


def _constrain(body: dict, params: SamplingParams, forced: Optional[structured.ForcedTool] = None,
               tools: Optional[list[dict]] = None) -> tuple[SamplingParams, Optional[str]]:
    """The structured-output fields (or a forced tool call) as params.structured_outputs, and its field."""
    try:
        c = structured.parse(body)
    except structured.StructuredError as e:
        raise APIError(str(e), param=e.param) from None
    if forced is not None:
        if c is not None:
            raise APIError(f"tool_choice forcing a call cannot be combined with {c.field}", param=c.field)
        parallel = get_bool(body, "parallel_tool_calls", True)  # OpenAI's: false allows one call at most
        c = structured.Constraint(structured.tool_constraint(forced, tools or [], parallel), "tool_choice")
    if c is None:
        return params, None
    return params.clone(structured_outputs=c.params), c.field


def _with_prompt_logprobs(body: dict, params: SamplingParams, echo_logprobs: Optional[int] = None) -> SamplingParams:
    """vLLM's prompt_logprobs field; and, on completions, echo + logprobs, whose echoed prompt comes with its
    tokens' logprobs (lm-eval's loglikelihood requests)."""
    asked = get_int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    scored = [n for n in (asked, echo_logprobs) if n is not None]
    return params.clone(prompt_logprobs=max(scored)) if scored else params


@dataclass
class CompletionRequest(_Common):
    prompts: list[PromptInput] = field(default_factory=list)
    echo: bool = False
    beam_search: Optional[Any] = None  # vLLM's use_beam_search: BeamSearchParams (width n)
    logprobs: Optional[int] = None  # the client's `logprobs` (best_of makes the engine score tokens regardless)
    # best_of > n: the engine samples best_of sequences per prompt (params.n), the response keeps the n likeliest
    best_of: Optional[int] = None
    n: int = 1  # choices per prompt in the response
    scored_only: bool = False  # echo with max_tokens 0: the prompt's logprobs, nothing generated
    # vLLM's prompt_embeds: prompts given as embeddings (base64 of torch.save(tensor)), before the text prompts
    prompt_embeds: list[str] = field(default_factory=list)


@dataclass
class ChatRequest(_Common):
    messages: list[dict[str, Any]] = field(default_factory=list)
    top_logprobs: Optional[int] = None  # None: no logprobs in the response
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict]] = None
    tool_choice: str = "auto"  # "none" | "auto" | "required" | "function" (a named one: forced_tool.name)
    forced_tool: Optional[structured.ForcedTool] = None  # the output is held to that call's JSON
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (with a reasoning parser)
    beam_search: Optional[Any] = None  # vLLM's use_beam_search: BeamSearchParams (width n)


def parse_completion(body: dict, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> CompletionRequest:
    embeds = _prompt_embeds(body.get("prompt_embeds"))
    # (with prompt_embeds, an empty prompt is the OpenAI client's required argument, not a prompt)
    prompts = parse_prompts(body.get("prompt")) if not embeds or body.get("prompt") not in (None, "", []) else []
    if len(embeds) + len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    if echo and embeds:
        raise APIError("echo is not supported with prompt_embeds (the prompt has no text)", param="echo")
    if body.get("suffix"):
        raise APIError("suffix is not supported", param="suffix")
    scored_only = _scored_only(body, echo)
    if scored_only:  # the engine samples one token, which the response leaves out
        body = {**body, "max_tokens": 1}
    n, best_of = _best_of(body)
    params = sampling_params(body, max_tokens_field="max_tokens", default_max_tokens=16, logprobs=logprobs,
                             defaults=defaults)
    params = _with_prompt_logprobs(body, params, logprobs if echo else None)
    if best_of is not None:  # ranked by cumulative logprob, so every token is scored
        params = params.clone(n=best_of, logprobs=logprobs if logprobs is not None else 0)
    params, field_name = _constrain(body, params)
    common = _common(body, params)
    common.structured_field = field_name
    if best_of is not None and common.stream:
        raise APIError("best_of greater than n cannot be streamed", param="best_of")
    beam = _beam_search(body, common)
    if best_of is not None and beam is not None:
        raise APIError("best_of is not supported with use_beam_search", param="best_of")
    if beam is not None and embeds:
        raise APIError("prompt_embeds is not supported with use_beam_search", param="prompt_embeds")
    return CompletionRequest(**vars(common), prompts=prompts, echo=echo, beam_search=beam, logprobs=logprobs,
                             best_of=best_of, n=n, scored_only=scored_only, prompt_embeds=embeds)


def _prompt_embeds(v: Any) -> list[str]:
    """vLLM's prompt_embeds: one base64 string (of torch.save(tensor)) or an array of them; decoded later."""
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
        raise APIError("prompt_embeds must be a base64 string (of torch.save(tensor)) or a non-empty array of them, "
                       f"got {_show(v)}", param="prompt_embeds")
    return items


def _scored_only(body: dict, echo: bool) -> bool:
    """OpenAI's legacy scoring call: echo with max_tokens 0 returns the prompt (and its logprobs) alone."""
    v = body.get("max_tokens")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != 0:
        return False
    if not echo:
        raise APIError("max_tokens must be >= 1 (0 is allowed only with echo, to score the prompt)",
                       param="max_tokens")
    if get_int(body, "min_tokens", 0, 0, INT64_MAX):
        raise APIError("min_tokens must be 0 when max_tokens is 0", param="min_tokens")
    return True


def _best_of(body: dict) -> tuple[int, Optional[int]]:
    """(n, best_of when it exceeds n, else None)."""
    n = get_int(body, "n", 1, 1, MAX_N)
    best_of = get_int(body, "best_of", None, 1, MAX_N)
    assert n is not None
    if best_of is not None and best_of < n:
        raise APIError(f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    return n, best_of if best_of is not None and best_of > n else None


def _beam_search(body: dict, common: _Common, default_max_tokens: int = 16) -> Optional[Any]:
    """vLLM's `use_beam_search` (with `n` beams, `length_penalty`): not streamed, no sampling options. Beams also
    end where the context does."""
    if not get_bool(body, "use_beam_search", False):
        return None
    from streamer.engine.beam_search import BeamSearchParams
    p = common.params
    if common.stream:
        raise APIError("use_beam_search cannot be streamed", param="stream")
    for name in ("logprobs", "structured_outputs", "stop", "prompt_logprobs", "thinking_token_budget"):
        if getattr(p, name) not in (None, []):  # (0 is a value: logprobs 0 still asks for them)
            raise APIError(f"{name} is not supported with use_beam_search", param=name)
    try:
        return BeamSearchParams(p.n, p.max_tokens or default_max_tokens, ignore_eos=p.ignore_eos,
                                length_penalty=get_float(body, "length_penalty", 1.0))
    except ValueError as e:
        param = next((f for f in ("length_penalty", "max_tokens") if str(e).startswith(f)), "n")
        raise APIError(str(e).replace("beam_width", "n"), param=param) from None


def parse_prompts(v: Any) -> list[PromptInput]:
    """A string, an array of strings, an array of token ids, or an array of token-id arrays."""
    if v is None:
        raise APIError("prompt is required", param="prompt")
    if isinstance(v, str):
        prompts: list[Any] = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        prompts = [v]
    elif isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(isinstance(p, list) for p in v)):
        prompts = v
    else:
        raise APIError("prompt must be a string, an array of strings, an array of token ids or an array of "
                       f"token-id arrays, got {_show(v)}", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    for p in prompts:
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(p, list) and not all(_is_int(t) and 0 <= t <= INT64_MAX for t in p):
            raise APIError("token-id prompts must hold non-negative integers only", param="prompt")
    return prompts


def parse_chat(body: dict, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> ChatRequest:
    messages = parse_messages(body.get("messages"))
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and top > 0 and not want_logprobs:
        raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    params = sampling_params(body, max_tokens_field="max_completion_tokens", default_max_tokens=None,
                             logprobs=top_logprobs, defaults=defaults)
    best_of = get_int(body, "best_of", None, 1, MAX_N)  # (completions only: chat has no best_of)
    if best_of is not None and best_of != params.n:
        raise APIError("best_of is not supported (it must equal n when given)", param="best_of")
    params = _with_prompt_logprobs(body, params)
    prediction = _prediction(body)
    if prediction:
        params = params.clone(prediction=prediction)
    add_gen, cont, tools, template_kwargs = _rendering(body, messages)
    tool_choice = body.get("tool_choice") or "auto"  # absent or null: the default
    try:
        forced = structured.forced_tool(tool_choice, tools)
    except structured.StructuredError as e:
        raise APIError(str(e), param=e.param) from None
    params, field_name = _constrain(body, params, forced, tools)
    common = _common(body, params)
    common.structured_field = field_name
    if body.get("max_completion_tokens") is not None:
        common.max_tokens_field = "max_completion_tokens"
    if common.stream and common.prompt_logprobs:
        raise APIError("prompt_logprobs is not supported on a streamed chat response (use a non-streamed one, or "
                       "completions)", param="prompt_logprobs")
    return ChatRequest(**vars(common), messages=messages, top_logprobs=top_logprobs, add_generation_prompt=add_gen,
                       continue_final_message=cont, tools=tools,
                       tool_choice=tool_choice if isinstance(tool_choice, str) else "function", forced_tool=forced,
                       template_kwargs=template_kwargs, include_reasoning=get_bool(body, "include_reasoning", True),
                       # (chat's max_tokens defaults to what the context leaves, where the beams end anyway)
                       beam_search=_beam_search(body, common, default_max_tokens=2 ** 31 - 1))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _rendering(body: dict, messages: list[dict[str, Any]]
               ) -> tuple[bool, bool, Optional[list[dict]], dict[str, Any]]:
    """How the chat template renders the messages (chat and /tokenize alike): add_generation_prompt,
    continue_final_message, tools, and the template's extra variables: chat_template_kwargs, plus OpenAI's
    reasoning_effort as the variable gpt-oss's template reads (chat_template_kwargs may override it)."""
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if add_gen and cont and "add_generation_prompt" in body:
        raise APIError("add_generation_prompt and continue_final_message cannot both be true",
                       param="continue_final_message")
    if cont:
        add_gen = False
        if messages[-1]["role"] != "assistant":
            raise APIError("continue_final_message needs a final assistant message", param="messages")
    tools = _tools(body.get("tools"))
    template_kwargs = get_object(body, "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {_show(effort)}",
                           param="reasoning_effort")
        template_kwargs = {"reasoning_effort": effort, **template_kwargs}
    return add_gen, cont, tools or None, template_kwargs


def _tools(tools: Any) -> Optional[list[dict]]:
    """OpenAI's function tools, checked whole (a tool the template cannot render, or whose parameters are not a
    schema object, would otherwise pass unnoticed until a forced call compiled them, or never)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(f"tools must be an array of tool objects, got {_show(tools)}", param="tools")
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise APIError(f"{where} must be an object, got {_show(t)}", param="tools")
        if t.get("type", "function") != "function":
            raise APIError(f"{where}.type must be 'function', got {_show(t.get('type'))}", param="tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{where}.function must be an object with a name, got {_show(fn)}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"{where}.function.name must be a non-empty string, got {_show(fn.get('name'))}",
                           param="tools")
        for key, kind, ok in (("description", "a string", str), ("parameters", "a JSON schema object", dict),
                              ("strict", "a boolean", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], ok):
                raise APIError(f"{where}.function.{key} must be {kind}, got {_show(fn[key])}", param="tools")
    return tools


def _tool_calls(v: Any, param: str) -> list[dict]:
    """An assistant message's earlier calls, as the template renders them: each {"function": {"name",
    "arguments"}} (arguments a JSON string, or an object as some clients send)."""
    if not isinstance(v, list):
        raise APIError(f"{param} must be an array on an assistant message", param=param)
    for i, call in enumerate(v):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{param}[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           f"\"arguments\"}}}}, got {_show(call)}", param=param)
        if fn.get("arguments") is not None and not isinstance(fn["arguments"], (str, dict)):
            raise APIError(f"{param}[{i}].function.arguments must be a JSON string, got {_show(fn['arguments'])}",
                           param=param)
    return v


def parse_messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise APIError(f"messages must be a non-empty array of message objects, got {_show(v)}", param="messages")
    if len(v) > MAX_MESSAGES:
        raise APIError(f"at most {MAX_MESSAGES} messages per request", param="messages")
    return [_message(m, i) for i, m in enumerate(v)]


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(f"{param} must be an object, got {_show(m)}", param=param)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # (a set lookup: an array or object would not hash)
        raise APIError(f"{param}.role must be one of {sorted(ROLES)}, got {_show(role)}", param=f"{param}.role")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), role, m, f"{param}.content")}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            try:
                out[key] = get_str(m, key, None, 1024)
            except APIError as e:
                raise e.rename(key, f"{param}.{key}") from None
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise APIError(f"{param}.tool_calls must be an array on an assistant message", param=f"{param}.tool_calls")
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{param}.tool_calls")
    return out


def _content(c: Any, role: str, m: dict, param: str) -> Union[str, list[dict[str, Any]]]:
    """A string, or an array of parts: text parts alone are joined with newlines (as vLLM does for string
    templates); with images, the parts stay a list of {"type": "text", "text"} and {"type": "image", "image":
    source} (an image_url's URL, or a PIL image from `LLM.chat`), which `ChatTemplate.render` shapes for the
    model's template and `message_images` collects (videos: {"type": "video", "video": URL}, `message_videos`;
    audio: {"type": "audio", "audio": URL}, `message_audios`)."""
    if isinstance(c, str):
        return c
    if c is None:
        if role == "assistant" and m.get("tool_calls"):
            return ""
        raise APIError(f"{param} is required", param=param)
    if isinstance(c, list) and c:
        parts = [content_part(part, f"{param}[{i}]") for i, part in enumerate(c)]
        if all(p["type"] == "text" for p in parts):
            return "\n".join(p["text"] for p in parts)
        return parts
    raise APIError(f"{param} must be a string or a non-empty array of content parts, got {_show(c)}", param=param)


def content_part(part: Any, param: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("text", "input_text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in ("image_url", "input_image"):  # chat's {"image_url": {"url"}} (or a bare string), Responses' string
        return {"type": "image", "image": _part_url(part, "image_url", param)}
    if kind == "image_pil" and type(part.get("image_pil")).__module__.startswith("PIL."):
        return {"type": "image", "image": part["image_pil"]}
    if kind == "video_url":  # vLLM's {"type": "video_url", "video_url": {"url"}} (or a bare string)
        return {"type": "video", "video": _part_url(part, "video_url", param)}
    if kind == "input_audio":  # OpenAI's {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        fmt = audio.get("format", "wav") if isinstance(audio, dict) else None
        if not isinstance(data, str) or not data or not isinstance(fmt, str) or not _AUDIO_FORMAT.fullmatch(fmt):
            raise APIError(f"{param}.input_audio must be {{\"data\": base64 string, \"format\": \"wav\" | \"mp3\" | "
                           f"...}}, got {_show(part)}", param=param)
        return {"type": "audio", "audio": f"data:audio/{fmt};base64,{data}"}
    if kind == "audio_url":  # vLLM's {"type": "audio_url", "audio_url": {"url"}} (or a bare string)
        return {"type": "audio", "audio": _part_url(part, "audio_url", param)}
    raise APIError(f"{param} must be a text part {{\"type\": \"text\", \"text\": string}}, an image part "
                   f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": string}}}}, a video part "
                   f"{{\"type\": \"video_url\", \"video_url\": {{\"url\": string}}}} or an audio part "
                   f"{{\"type\": \"input_audio\", \"input_audio\": {{\"data\": base64, \"format\": string}}}}, "
                   f"got {_show(part)}", param=param)


def _part_url(part: dict, key: str, param: str) -> str:
    """The URL of a {"type": ..., key: {"url": URL}} part (or of key: URL)."""
    url = part.get(key)
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise APIError(f"{param}.{key} must be {{\"url\": string}} or a string, got {_show(part)}", param=param)
    return url


_AUDIO_FORMAT = re.compile(r"[a-z0-9]{1,10}")  # (a media subtype: wav, mp3, flac, ...; the bytes decide the codec)


def message_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The images of a conversation's messages, in order (URLs or PIL images)."""
    return [p["image"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "image"]


def message_videos(messages: list[dict[str, Any]]) -> list[Any]:
    """The videos of a conversation's messages, in order (video_url URLs)."""
    return [p["video"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "video"]


def message_audios(messages: list[dict[str, Any]]) -> list[str]:
    """The audio clips of a conversation's messages, in order (audio_url URLs; input_audio parts as data: URLs)."""
    return [p["audio"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p["type"] == "audio"]


@dataclass
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or chat messages rendered as a chat request would render them."""
    model: Optional[str]
    prompt: Optional[str]
    messages: Optional[list[dict[str, Any]]]
    add_special_tokens: bool
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    tools: Optional[list[dict]] = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_strs: bool = False


def parse_tokenize(body: dict) -> TokenizeRequest:
    """{"model", "prompt"} or {"model", "messages"} with chat's rendering fields (add_generation_prompt,
    continue_final_message, tools, chat_template_kwargs, reasoning_effort); add_special_tokens;
    return_token_strs."""
    model = get_str(body, "model", None, 1024)
    strs = get_bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        messages = parse_messages(body["messages"])
        add_gen, cont, tools, template_kwargs = _rendering(body, messages)
        return TokenizeRequest(model, None, messages, get_bool(body, "add_special_tokens", False), add_gen, cont,
                               tools, template_kwargs, strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(f"prompt must be a string, got {_show(prompt)}", param="prompt")
    return TokenizeRequest(model, prompt, None, get_bool(body, "add_special_tokens", True), return_token_strs=strs)


def parse_detokenize(body: dict) -> tuple[Optional[str], list[int]]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in tokens):
        raise APIError(f"tokens must be an array of non-negative integers, got {_show(tokens)}", param="tokens")
    return get_str(body, "model", None, 1024), tokens

"""Hostile request bodies for every POST endpoint of `streamer serve` (hypothesis strategies), shared by
tests/test_server_fuzz.py and bench/fuzz_server.py.

Each endpoint has a valid base body and the fields it reads, each with values that are valid or close to it; a
generated body starts from the base and then, field by field, keeps it, drops it, sets a valid value or a hostile
one: the wrong JSON type, null, an empty or long list, out-of-range numbers (huge integers, 1e308, NaN and
Infinity written as raw JSON tokens), long strings and special tokens, nesting deeper than the server reads. Unknown
keys are added, and some bodies are not JSON objects at all (raw bytes). Every body stays small enough to be read
(generation is capped by small max_tokens in the base bodies; a hostile value may lift that, within the served
max_model_len).

`request()` draws (method, path, headers, raw body). The server must answer every one with a status below 500
(4xx with OpenAI's error body, or Anthropic's on /v1/messages).
"""
from __future__ import annotations

import base64
import json
import logging
import math
import struct
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

MODEL = "llama"  # the served name (tests/conftest.py's llama_dir)
LORA = "fuzz-lora"  # a name load_lora_adapter may be given (no adapter by it is ever loaded)


# The server the fuzz runs against: every optional route and feature a body can reach (the model: the tests'
# tiny llama, `use_rich_template`).
SERVER_KWARGS: dict[str, Any] = dict(allow_lora_updates=True, allow_weight_updates=True, enable_lora=True,
                                     enable_prompt_embeds=True, max_model_len=256)
APP_KWARGS: dict[str, Any] = dict(tool_call_parser="hermes", reasoning_parser="qwen3")


def error_shape(raw: bytes) -> bool:
    """OpenAI's {"error": {"message", "type", "param", "code"}}, or Anthropic's {"type": "error", "error":
    {"type", "message"}} (/v1/messages)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not err["message"]:
        return False
    if body.get("type") == "error":
        return isinstance(err.get("type"), str)
    return isinstance(err.get("type"), str) and "param" in err and "code" in err


class ErrorLog(logging.Handler):
    """The server's log records at ERROR and above (an unhandled error, a stream that failed mid-way, a failed
    background response), while in use."""

    NAMES = ("", "uvicorn")  # (the root, and uvicorn's, which do not propagate)

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "_fuzz_seen", False):
            return
        record._fuzz_seen = True  # type: ignore[attr-defined]
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-3000:]
        self.records.append(f"{record.name}: {text}")

    def __enter__(self) -> "ErrorLog":
        for name in self.NAMES:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in self.NAMES:
            logging.getLogger(name).removeHandler(self)


def use_rich_template(model_dir: Path) -> None:
    """Give a checkpoint folder (a copy: it is changed) tests/test_server_chat_template.py's Qwen-style template,
    which renders tools and tool calls with tojson, loops, namespaces and raise_exception."""
    from tests.test_server_chat_template import RICH_TEMPLATE
    path = model_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = RICH_TEMPLATE
    path.write_text(json.dumps(cfg))


@dataclass(frozen=True)
class Deep:
    """Nesting written as raw text: `depth` levels of arrays (or objects), past what the server reads (and past
    Python's json recursion limit, which is why it is not built as Python lists)."""
    depth: int
    kind: str = "["

    def text(self) -> str:
        if self.kind == "[":
            return "[" * self.depth + "]" * self.depth
        return '{"a":' * self.depth + "1" + "}" * self.depth


@dataclass(frozen=True)
class Raw:
    """A JSON token written as it is (NaN, Infinity, -Infinity, 1e999, a 400-digit integer)."""
    token: str


def encode(obj: Any) -> bytes:
    """JSON with `Deep` and `Raw` leaves spliced in as text; floats NaN / inf as the raw tokens NaN / Infinity
    (which Python's json writes and strict parsers refuse)."""
    return _encode(obj).encode("utf-8", "surrogatepass")


def _encode(obj: Any) -> str:
    if isinstance(obj, Deep):
        return obj.text()
    if isinstance(obj, Raw):
        return obj.token
    if isinstance(obj, dict):
        return "{" + ",".join(json.dumps(str(k)) + ":" + _encode(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_encode(v) for v in obj) + "]"
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    return json.dumps(obj)


# ---------------------------------------------------------------------------------------------- hostile values
EDGE_INTS = [0, 1, -1, 2, 255, 256, 511, 512, 513, 4095, 2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 53 + 1,
             2 ** 63 - 1, 2 ** 63, -(2 ** 63), -(2 ** 63) - 1, 2 ** 64, 10 ** 30, -(10 ** 30)]
EDGE_FLOATS = [0.0, -0.0, 0.5, -0.5, 1.5, 1e-7, 5e-324, -5e-324, 3.4e38, 3.5e38, 1e39, -1e39, 1e300, 1e308,
               -1e308, 1.7976931348623157e308, float("nan"), float("inf"), float("-inf")]
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "-" + "9" * 400, "1e-999",
              "0.0000000000000000000000000000001", "123456789012345678901234567890.5"]
SPECIAL_STRINGS = [
    "", " ", "\n", "\x00", "\x00" * 8, "\ud800", "\udfff", "\ufeff", "\u202e", "é" * 10, "😀" * 8, "%s%n%x",
    "{{ raise_exception('x') }}", "{% for %}", "<|endoftext|>", "<s>", "</s>", "<think>", "</think>",
    "<tool_call>", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "[TOOL_CALLS]", "<|python_tag|>",
    "../../../../etc/passwd", "/", "/etc/passwd", "/dev/zero", "/proc/self/mem", "/tmp", ".", "..", "~",
    "file:///etc/passwd", "http://127.0.0.1:1/x.png", "https://127.0.0.1:1/a.wav", "data:,", "data:image/png;base64,",
    "data:image/png;base64,AAAA", "data:image/png;base64,!!!", "data:audio/wav;base64,UklGRg==",
    "data:video/mp4;base64,AAAAIGZ0eXA=", "resp_00000000000000000000000000000000", "chatcmpl-x", "null", "true",
    "auto", "none", "required", "json_object", "json_schema", "text", "function", LORA, MODEL, MODEL + " ",
    "a" * 1025, "(a+)+$", "[", "((((((((((", "x" * 5000, "root ::= root", 'start: "a"', "\\", "\"", "'''",
]


def long_string() -> st.SearchStrategy[str]:
    return st.sampled_from([1_000, 10_000, 100_000, 1_000_000]).flatmap(
        lambda n: st.sampled_from(["a", "hello ", "<tool_call>", "é", "\x00", "{"]).map(lambda s: (s * n)[:n]))


def deep() -> st.SearchStrategy[Deep]:
    return st.builds(Deep, st.sampled_from([33, 100, 1_025, 5_000, 50_000]), st.sampled_from(["[", "{"]))


scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(), st.sampled_from(EDGE_FLOATS),
    st.floats(), st.builds(Raw, st.sampled_from(RAW_TOKENS)), st.sampled_from(SPECIAL_STRINGS),
    st.text(max_size=12))


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4))


junk_small = st.recursive(scalars, containers, max_leaves=8)
junk = st.one_of(junk_small, long_string(), deep(), st.just([]), st.just({}), st.just([None]),
                 st.lists(st.integers(0, 3), min_size=1000, max_size=1000),
                 st.lists(st.just("a"), min_size=65, max_size=200))


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly valid, otherwise hostile."""
    return st.one_of(valid, valid, junk)


# ---------------------------------------------------------------------------------------------- valid-ish values
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


token_ids = st.lists(st.integers(0, 600), min_size=1, max_size=8)
short_text = st.sampled_from(["hi", "hello world", "Once upon a time", "2+2=", "{", "<think>x</think>y",
                              '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'])
prompt = st.one_of(short_text, st.lists(short_text, min_size=1, max_size=3), token_ids,
                   st.lists(token_ids, min_size=1, max_size=2))
schema = st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]},
    {"type": "object"}, {"type": "string", "enum": ["a", "b"]}, {"type": "integer", "minimum": 0, "maximum": 3},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, {"$ref": "#/definitions/x"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}}, {"anyOf": []}, {"type": "wizard"}, {"pattern": "(a+)+$"},
    {"type": "string", "pattern": "["}, {"type": "string", "format": "date-time"}, {"not": {}},
    {"type": "object", "additionalProperties": False, "properties": {}}, True, False])
response_format = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "yaml"},
                     {"type": "structural_tag"}, {"type": "json_schema", "json_schema": {}}]),
    st.builds(lambda s, strict: {"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": strict}},
              schema, st.booleans()))
structured_outputs = st.one_of(
    st.builds(lambda s: {"json": s}, schema), st.builds(lambda r: {"regex": r}, st.sampled_from(
        ["[a-z]{1,3}", "(a|b)*c", "[", "(a+)+$", "a{99999}", "\\d{2}", ""])),
    st.builds(lambda c: {"choice": c}, st.sampled_from([["yes", "no"], [], [""], ["a"] * 100, [1, 2]])),
    st.builds(lambda g: {"grammar": g}, st.sampled_from(['root ::= "a" | "b"', "root ::= root", "start: x",
                                                          'start: "a"+', "", "?"])),
    st.just({"json_object": True}), st.just({"json": "{"}), st.just({"regex": "a", "choice": ["b"]}))
tool = st.builds(lambda name, params, strict: {"type": "function", "function": {
    "name": name, "description": "d", "parameters": params, "strict": strict}},
    st.sampled_from(["get_weather", "f", "", "a b", "x" * 300]), schema, st.booleans())
tools = st.lists(field(tool), min_size=1, max_size=3)
tool_choice = st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                        st.builds(lambda n: {"type": "function", "function": {"name": n}},
                                  st.sampled_from(["get_weather", "missing"])))
image_part = st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, st.sampled_from(
    ["data:image/png;base64,AAAA", "http://127.0.0.1:1/x.png", "file:///etc/passwd", "data:,", "",
     "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16).decode()]))
audio_part = st.builds(lambda d, f: {"type": "input_audio", "input_audio": {"data": d, "format": f}},
                       st.sampled_from(["", "AAAA", "UklGRg==", "!!"]), st.sampled_from(["wav", "mp3", "x"]))
video_part = st.just({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}})
content_part = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, short_text), image_part, audio_part,
                         video_part, st.just({"type": "wizard"}), st.just({"type": "text"}))
tool_call = st.builds(lambda name, args: {"id": "call_1", "type": "function",
                                          "function": {"name": name, "arguments": args}},
                      st.sampled_from(["get_weather", ""]), st.sampled_from(['{"city": "Paris"}', "{", "", "[]",
                                                                             '{"a": ' * 100 + "1" + "}" * 100]))
message = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer", "user", "assistant"]),
              st.one_of(short_text, st.lists(field(content_part), min_size=1, max_size=3))),
    st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
              st.lists(field(tool_call), min_size=1, max_size=2)),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "call_1", "content": c}, short_text),
    st.just({"role": "assistant", "content": "x", "reasoning_content": "y"}), st.just({"role": "user"}))
messages = st.lists(field(message), min_size=1, max_size=4)


# ---------------------------------------------------------------------------------------------- endpoints
SAMPLING: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([MODEL, LORA, "nope", ""]), "max_tokens": ints(0, 4), "temperature": st.sampled_from(
        [0.0, 0.7, 1.0, 2.0]), "top_p": st.sampled_from([0.1, 0.9, 1.0]), "top_k": ints(-1, 50),
    "min_p": st.sampled_from([0.0, 0.1, 1.0]), "seed": ints(0, 2 ** 31), "n": ints(1, 3), "best_of": ints(1, 4),
    "stop": st.one_of(short_text, st.lists(short_text, max_size=3)), "stop_token_ids": st.lists(ints(0, 600),
                                                                                              max_size=3),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]), "frequency_penalty": st.sampled_from([-2.0, 0.5]),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.3]), "logit_bias": st.dictionaries(
        st.sampled_from(["0", "5", "511", "-1", "x", "1e3"]), st.sampled_from([-100, 0, 5, 100.0]), max_size=3),
    "min_tokens": ints(0, 4), "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "priority": ints(-5, 5), "cache_salt": st.sampled_from(["salt", ""]), "user": st.sampled_from(["u", ""]),
    "return_token_ids": st.booleans(), "return_tokens_as_token_ids": st.booleans(),
    "bad_words": st.lists(short_text, max_size=2), "allowed_token_ids": st.lists(ints(0, 600), max_size=4),
    "truncate_prompt_tokens": ints(-1, 8), "thinking_token_budget": ints(0, 4), "use_beam_search": st.booleans(),
    "length_penalty": st.sampled_from([0.0, 1.0, -1.0, 1000.0, -1000.0]), "prompt_logprobs": ints(0, 3),
    "response_format": response_format, "structured_outputs": structured_outputs, "guided_json": schema,
    "guided_regex": st.sampled_from(["[a-z]+", "["]), "guided_choice": st.lists(short_text, max_size=3),
    "guided_grammar": st.sampled_from(['root ::= "a"', "?"]), "spaces_between_special_tokens": st.booleans(),
    "prediction": st.builds(lambda t: {"type": "content", "content": t}, short_text),
}


def _saved(t: Any) -> str:
    import io

    import torch
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@st.composite
def embeds(draw: st.DrawFn) -> str:
    """base64 of torch.save(tensor): rows of the model's width (64) or not, of several dtypes, empty, 1-D or 3-D,
    NaN / inf values, something other than a tensor; or not base64 / not a torch archive at all."""
    import torch
    kind = draw(st.sampled_from(["tensor"] * 4 + ["other", "text"]))
    if kind == "text":
        return draw(st.sampled_from(["", "AAAA", "!!", base64.b64encode(b"\x00" * 64).decode(),
                                     base64.b64encode(b"PK\x03\x04" + b"\x00" * 40).decode()]))
    if kind == "other":
        return _saved(draw(st.sampled_from([{"a": torch.zeros(2)}, [torch.zeros(2, 64)], 3, "x", None])))
    shape = draw(st.sampled_from([(2, 64), (1, 64), (0, 64), (64,), (1, 2, 64), (3, 63), (2, 65), (300, 64),
                                  (1, 1)]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                  torch.bool, torch.complex64, torch.uint8]))
    fill = draw(st.sampled_from([0.0, 1.0, 1e30, float("nan"), float("inf"), -1.0]))
    t = torch.full(shape, fill) if dtype.is_floating_point or dtype.is_complex else torch.zeros(shape)
    return _saved(t.to(dtype))


COMPLETION = {**SAMPLING, "prompt": prompt, "suffix": short_text, "echo": st.booleans(), "logprobs": ints(0, 5),
              "prompt_embeds": st.one_of(embeds(), st.lists(embeds(), min_size=1, max_size=2)),
              "add_special_tokens": st.booleans()}
CHAT = {**SAMPLING, "messages": messages, "tools": tools, "tool_choice": tool_choice, "max_completion_tokens":
        ints(0, 4), "parallel_tool_calls": st.booleans(), "logprobs": st.booleans(), "top_logprobs": ints(0, 5),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(),
                                                                    "x": short_text}),
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
        "reasoning_effort": st.sampled_from(["low", "medium", "high", "max"]), "include_reasoning": st.booleans(),
        "documents": st.lists(st.just({"title": "t", "text": "x"}), max_size=2)}
response_item = st.one_of(
    st.builds(lambda r, c: {"type": "message", "role": r, "content": c}, st.sampled_from(
        ["user", "assistant", "system", "developer"]), st.one_of(short_text, st.lists(st.builds(
            lambda k, t: {"type": k, "text": t}, st.sampled_from(["input_text", "output_text", "text", "x"]),
            short_text), max_size=2))),
    st.builds(lambda a: {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": a},
              st.sampled_from(['{"city": "Paris"}', "{"])),
    st.just({"type": "function_call_output", "call_id": "c1", "output": "sunny"}),
    st.just({"type": "reasoning", "summary": []}), st.just({"type": "input_image", "image_url": "x"}))
RESPONSES = {
    "model": SAMPLING["model"], "input": st.one_of(short_text, st.lists(field(response_item), min_size=1,
                                                                         max_size=3)),
    "instructions": short_text, "max_output_tokens": ints(1, 4), "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"], "stream": st.booleans(), "store": st.booleans(), "background": st.booleans(),
    "previous_response_id": st.sampled_from(["resp_x", ""]), "tools": st.lists(st.builds(
        lambda n, p: {"type": "function", "name": n, "parameters": p}, st.sampled_from(["get_weather", ""]),
        schema), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.just({"type": "function", "name": "get_weather"})),
    "text": st.builds(lambda f: {"format": f}, st.one_of(st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "yaml"}]), st.builds(
        lambda s: {"type": "json_schema", "name": "x", "schema": s}, schema))),
    "reasoning": st.builds(lambda e: {"effort": e}, st.sampled_from(["low", "high", "x"])),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", "x"]),
                        max_size=2),
    "top_logprobs": ints(0, 5), "metadata": st.dictionaries(st.sampled_from(["a", "b"]), short_text, max_size=2),
    "user": st.just("u"), "parallel_tool_calls": st.booleans(), "truncation": st.sampled_from(["auto", "disabled"]),
    "stop": SAMPLING["stop"], "seed": SAMPLING["seed"],
}
anthropic_block = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, short_text),
    st.builds(lambda d: {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": d}},
              st.sampled_from(["AAAA", "", "!!"])),
    st.just({"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/x.png"}}),
    st.just({"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}),
    st.builds(lambda c: {"type": "tool_result", "tool_use_id": "t1", "content": c}, st.one_of(
        short_text, st.just([{"type": "text", "text": "x"}]))),
    st.just({"type": "thinking", "thinking": "hmm", "signature": "s"}), st.just({"type": "document"}))
MESSAGES = {
    "model": SAMPLING["model"], "max_tokens": ints(1, 4), "messages": st.lists(field(st.builds(
        lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "assistant", "system"]),
        st.one_of(short_text, st.lists(field(anthropic_block), min_size=1, max_size=3)))), min_size=1, max_size=3),
    "system": st.one_of(short_text, st.just([{"type": "text", "text": "be brief"}])),
    "stop_sequences": st.lists(short_text, max_size=2), "temperature": st.sampled_from([0.0, 1.0]),
    "top_p": SAMPLING["top_p"], "top_k": ints(0, 50), "stream": st.booleans(),
    "tools": st.lists(st.builds(lambda n, s: {"name": n, "description": "d", "input_schema": s},
                                st.sampled_from(["get_weather", ""]), schema), max_size=2),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "get_weather"}, {"type": "tool"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 2}, {"type": "disabled"},
                                 {"type": "enabled"}, {"type": "enabled", "budget_tokens": 1024}]),
    "metadata": st.sampled_from([{"user_id": "u"}, {}]),
    "output_config": st.sampled_from([{"effort": "low"}, {"format": {"type": "json_schema", "schema": {
        "type": "object"}}}, {}]),
}
EMBED_INPUT = st.one_of(short_text, st.lists(short_text, min_size=1, max_size=3), token_ids)
EMBEDDINGS = {"model": SAMPLING["model"], "input": EMBED_INPUT, "encoding_format": st.sampled_from(
    ["float", "base64", "x"]), "dimensions": ints(1, 64), "normalize": st.booleans(),
    "truncate_prompt_tokens": ints(1, 8), "messages": messages, "add_generation_prompt": st.booleans(),
    "user": st.just("u")}
CLASSIFY = {"model": SAMPLING["model"], "input": EMBED_INPUT, "use_activation": st.booleans(),
            "activation": st.booleans(), "truncate_prompt_tokens": ints(1, 8), "messages": messages}
SCORE = {"model": SAMPLING["model"], "text_1": EMBED_INPUT, "text_2": EMBED_INPUT,
         "truncate_prompt_tokens": ints(1, 8)}
RERANK = {"model": SAMPLING["model"], "query": short_text, "documents": st.lists(st.one_of(
    short_text, st.builds(lambda t: {"text": t}, short_text)), min_size=1, max_size=3), "top_n": ints(1, 4),
    "return_documents": st.booleans()}
TOKENIZE = {"model": SAMPLING["model"], "prompt": short_text, "messages": messages,
            "add_special_tokens": st.booleans(), "return_token_strs": st.booleans(),
            "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(), "tools": tools,
            "chat_template_kwargs": CHAT["chat_template_kwargs"]}
DETOKENIZE = {"model": SAMPLING["model"], "tokens": token_ids}
PATHS = st.sampled_from(["/tmp", "/", "/nowhere", "/etc/passwd", "/dev/null", "/proc/self", ".", "",
                         "x" * 5000, "a/" * 2000, "\x00", "/tmp/\x00x", "~/x", "/root"])
LOAD_LORA = {"lora_name": st.sampled_from([LORA, MODEL, "", "x" * 300]), "lora_path": PATHS}
UNLOAD_LORA = {"lora_name": st.sampled_from([LORA, MODEL, "", "nope"])}
UPDATE_WEIGHTS = {"model_path": PATHS}
# "abort" is left out: it aborts the other requests in flight (a 503 for them, rightly)
PAUSE = {"mode": st.sampled_from(["keep", "retract", "x", ""])}
EMPTY: dict[str, st.SearchStrategy] = {}

# (path, its fields, the base body); every POST route of build_app (with allow_lora_updates and
# allow_weight_updates), /v1/responses/{id}/cancel with ids that are not there
ENDPOINTS: list[tuple[str, dict[str, st.SearchStrategy], dict[str, Any]]] = [
    ("/v1/completions", COMPLETION, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 2}),
    ("/v1/responses", RESPONSES, {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", MESSAGES, {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", MESSAGES, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/embeddings", EMBEDDINGS, {"model": MODEL, "input": "hi"}),
    ("/v1/classify", CLASSIFY, {"model": MODEL, "input": "hi"}),
    ("/classify", CLASSIFY, {"model": MODEL, "input": "hi"}),
    ("/v1/score", SCORE, {"model": MODEL, "text_1": "a", "text_2": ["b", "c"]}),
    ("/score", SCORE, {"model": MODEL, "text_1": "a", "text_2": "b"}),
    ("/v1/rerank", RERANK, {"model": MODEL, "query": "a", "documents": ["b", "c"]}),
    ("/rerank", RERANK, {"model": MODEL, "query": "a", "documents": ["b"]}),
    ("/v2/rerank", RERANK, {"model": MODEL, "query": "a", "documents": ["b"]}),
    ("/tokenize", TOKENIZE, {"model": MODEL, "prompt": "hi"}),
    ("/detokenize", DETOKENIZE, {"model": MODEL, "tokens": [1, 2]}),
    ("/invocations", {**COMPLETION, **CHAT, **EMBEDDINGS}, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("/v1/load_lora_adapter", LOAD_LORA, {"lora_name": LORA, "lora_path": "/nowhere"}),
    ("/v1/unload_lora_adapter", UNLOAD_LORA, {"lora_name": LORA}),
    ("/update_weights_from_disk", UPDATE_WEIGHTS, {"model_path": "/nowhere"}),
    ("/pause_generation", PAUSE, {"mode": "keep"}),
    ("/continue_generation", EMPTY, {}),
    ("/reset_prefix_cache", EMPTY, {}),
    ("/ping", EMPTY, {}),
    ("/v1/audio/transcriptions", {"model": SAMPLING["model"], "language": st.just("en")}, {"model": MODEL}),
    ("/v1/audio/translations", {"model": SAMPLING["model"]}, {"model": MODEL}),
    ("/v1/responses/resp_00000000000000000000000000000000/cancel", EMPTY, {}),
]
PATH_NAMES = [path for path, _, _ in ENDPOINTS]


@st.composite
def body_for(draw: st.DrawFn, fields: dict[str, st.SearchStrategy], base: dict[str, Any]) -> dict[str, Any]:
    """The base body, then for some of its fields and some others the endpoint reads: dropped, a valid value or a
    hostile one; plus unknown keys."""
    body = dict(base)
    names = sorted(fields)
    if names:
        chosen = draw(st.lists(st.sampled_from(names), max_size=min(6, len(names)), unique=True))
        for name in chosen:
            action = draw(st.sampled_from(["valid", "valid", "hostile", "null", "drop"]))
            if action == "drop":
                body.pop(name, None)
            elif action == "null":
                body[name] = None
            else:
                body[name] = draw(fields[name] if action == "valid" else junk)
    for key in draw(st.lists(st.text(min_size=1, max_size=8), max_size=2)):
        body.setdefault(key, draw(junk_small))
    if draw(st.booleans()):
        body = draw(mutated(body))
    return body


def flipped(value: Any) -> st.SearchStrategy:
    """`value` turned into something else: wrapped in an array or an object (a string that becomes ["user"]
    is unhashable where a set or dict lookup expects a string), its string or number form, null, or junk."""
    alternatives = [st.just([value]), st.just({"x": value}), st.just(None), junk_small]
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        alternatives.append(st.just(str(value) if not isinstance(value, str) else len(value)))
    return st.one_of(*alternatives)


@st.composite
def mutated(draw: st.DrawFn, value: Any, depth: int = 0) -> Any:
    """`value` with some of its nested values (an object's entries, an array's items, at any depth) flipped;
    the top level's own fields are the caller's."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            roll = draw(st.integers(0, 9))
            if depth > 0 and roll == 0:
                out[k] = draw(flipped(v))
            elif depth > 0 and roll == 1:
                continue  # dropped
            else:
                out[k] = draw(mutated(v, depth + 1))
        return out
    if isinstance(value, list):
        return [draw(flipped(v)) if draw(st.integers(0, 9)) == 0 else draw(mutated(v, depth + 1)) for v in value]
    return value


raw_bytes = st.one_of(
    st.binary(max_size=256), st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"null", b"[]", b"42", b'"x"', b"{", b"}", b'{"a":1,}', b"\xff\xfe", b"\xef\xbb\xbf{}",
                     b"{}" * 2, b'{"model": NaN}', b"[" * 100_000, b"{" * 100_000, b'{"a": "\\ud800"}',
                     b'{"max_tokens": 1e999}', b'{"a": 1, "a": 2}', b"\x00" * 64, b'{"prompt": "hi"} trailing']))


@st.composite
def request(draw: st.DrawFn, paths: tuple[str, ...] = ()) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, raw body) for one of the endpoints (paths: only these)."""
    endpoints = [e for e in ENDPOINTS if not paths or e[0] in paths]
    path, fields, base = draw(st.sampled_from(endpoints))
    kind = draw(st.sampled_from(["body"] * 8 + ["raw", "not_object"]))
    if kind == "raw":
        raw = draw(raw_bytes)
    elif kind == "not_object":
        raw = encode(draw(junk))
    else:
        raw = encode(draw(body_for(fields, base)))
    content_type = draw(st.sampled_from(["application/json"] * 6 + [
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]))
    headers = {"content-type": content_type} if content_type else {}
    if path.startswith("/v1/audio/") and draw(st.booleans()):
        raw, headers = draw(multipart(fields, base))
    return "POST", path, headers, raw


@st.composite
def multipart(draw: st.DrawFn, fields: dict[str, st.SearchStrategy], base: dict[str, Any]
              ) -> tuple[bytes, dict[str, str]]:
    """A form upload (/v1/audio's shape): a `file` of junk or a tiny WAV, and some fields."""
    boundary = "fuzzboundary"
    wav = _wav(draw(st.integers(0, 800)))
    parts: list[bytes] = []
    if draw(st.booleans()):
        data = draw(st.one_of(st.just(wav), st.binary(max_size=64)))
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                     f"Content-Type: audio/wav\r\n\r\n".encode() + data + b"\r\n")
    form = {**{k: str(v) for k, v in base.items()}, **draw(st.dictionaries(st.sampled_from(
        ["model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]", "stream"]),
        st.one_of(st.sampled_from(["en", "json", "verbose_json", "srt", "1e999", "NaN", "-1", "true", "word"]),
                  st.text(max_size=8)), max_size=4))}
    for k, v in form.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode(
            "utf-8", "surrogatepass"))
    if draw(st.booleans()):
        parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), {"content-type": f"multipart/form-data; boundary={boundary}"}


def _wav(samples: int, rate: int = 16_000) -> bytes:
    data = b"\x00\x00" * samples
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
                                                                                      rate * 2, 2, 16)
            + b"data" + struct.pack("<I", len(data)) + data)

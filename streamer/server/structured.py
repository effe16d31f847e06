"""The request fields that constrain the output, read into one `StructuredOutputsParams`:

- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}},
  and vLLM's {"type": "structural_tag", "structures": [...], "triggers": [...]};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...};
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- a forced `tool_choice` ("required", or {"type": "function", "function": {"name": ...}}) on chat: the output is
  held to the JSON of the call's arguments (named), or of a list of {"name", "arguments"} calls (required);
- strict tool calling (`tool_choice` "auto" with a tool marked `"strict": true`, or every tool under
  `--enforce-strict-tool-calling`): the text stays free, but a call the model starts in its parser's format must
  name a given tool and fit its schema (a structural tag: `strict_tool_tag`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from streamer.engine.structured_output import StructuredOutputsParams

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from: errors found later (compiling the grammar) name it


@dataclass
class ForcedTool:
    """tool_choice forcing a call: `name` for one named function, None for "required" (any, one or more)."""

    name: Optional[str]


def parse(body: dict) -> Optional[Constraint]:
    given = [f for f in FIELDS if body.get(f) is not None and not _is_text_format(f, body.get(f))]
    if len(given) > 1:
        raise StructuredError(f"only one of {', '.join(given)} may be given", given[1])
    if not given:
        if body.get("response_format") is not None:  # {"type": "text"}: checked, unconstrained
            _response_format(body["response_format"])
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "response_format":
            params = _response_format(value)
        elif name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
            unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs has unsupported fields: {', '.join(unknown)}")
            params = StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})
        else:
            params = StructuredOutputsParams(**{_LEGACY[name]: value})
    except ValueError as e:
        raise StructuredError(str(e).replace("structured_outputs.", f"{name}: "), name) from None
    return Constraint(params, name)


def _is_text_format(name: str, value: Any) -> bool:
    return name == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _response_format(v: Any) -> Optional[StructuredOutputsParams]:
    if not isinstance(v, dict):
        raise ValueError(f"response_format must be an object, got {type(v).__name__}")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object holding the schema")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a named format without a schema: any JSON object
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        if "format" in v:  # xgrammar's nested tag formats (vLLM's newer spelling)
            raise ValueError("response_format: a structural_tag's nested \"format\" is not supported; give "
                             "\"structures\" and \"triggers\"")
        return StructuredOutputsParams(structural_tag={k: v.get(k) for k in ("structures", "triggers")})
    raise ValueError("response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got "
                     f"{kind!r}")


def forced_tool(tool_choice: Any, tools: Optional[list[dict]]) -> Optional[ForcedTool]:
    """None for "auto" / "none" / absent; a ForcedTool otherwise. Raises StructuredError(param="tool_choice").
    tools: as the request's parsing checked them (protocol._tools)."""
    if tool_choice in (None, "auto", "none"):
        return None
    name: Optional[str] = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise StructuredError("tool_choice.function.name must be a string", "tool_choice")
    elif tool_choice != "required":
        raise StructuredError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}", "tool_choice")
    if not tools:
        raise StructuredError("tool_choice forces a tool call, but no tools were given", "tool_choice")
    if name is not None and name not in [t["function"]["name"] for t in tools]:  # (checked: protocol._tools)
        raise StructuredError(f"tool_choice names the function {name!r}, which is not among tools", "tool_choice")
    return ForcedTool(name)


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


# The tool-call formats strict tool calling can hold to their tools: (trigger, a call's opening given its name, its
# closing), the arguments object between them.
_CALL_TAGS = {"hermes": ("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
              "deepseek_v3": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                              "\n```<｜tool▁call▁end｜>"),
              "deepseek_v31": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
              # (Llama 3.1+'s JSON calls: the parser reads them at the output's start)
              "llama3_json": ('{"name": "', '{{"name": "{name}", "parameters": ', "}")}


# The XML formats (parameters as text between tags, typed by the schema: tool_calls._typed): (trigger, a call's
# opening given its name, its closing, a parameter's opening given its key, a parameter's closing)
_XML_TAGS = {"qwen3_coder": ("<tool_call>", "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>",
                             "<parameter={key}>\n", "\n</parameter>\n"),
             "seed_oss": ("<seed:tool_call>", "<seed:tool_call>\n<function={name}>\n",
                          "</function>\n</seed:tool_call>", "<parameter={key}>\n", "\n</parameter>\n"),
             "glm45": ("<tool_call>", "<tool_call>{name}\n", "</tool_call>", "<arg_key>{key}</arg_key>\n<arg_value>",
                       "</arg_value>\n")}
_XML_TAGS["qwen3_xml"] = _XML_TAGS["qwen3_coder"]
# A parameter's value by its schema's type, before the closing tag (Lark); strings and untyped values are any text
# up to the first closing tag (a lazy rule); objects, arrays and the rest are JSON to their schema
_XML_VALUES = {"integer": '/-?(0|[1-9][0-9]*)/', "number": '/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/',
               "boolean": '"true" | "false"', "null": '"null"'}


def xml_arguments_grammar(schema: dict, opening: str, closing: str) -> str:
    """A Lark grammar (llguidance's) for an XML call's parameters: the schema's properties in its order, each
    once, the required ones always (strict: no others); without properties (a non-strict tool), any parameters of
    any text."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
    if not props:
        if schema.get("properties") is not None or schema.get("additionalProperties") is False:
            return 'start: ""'  # (strict, and no parameters)
        key, value = opening.split("{key}")
        return "\n".join(["start: param*", f"param: {json.dumps(key)} KEY {json.dumps(value)} text",
                           f"text[lazy]: TEXT {json.dumps(closing)}", "KEY: /[^<>\\n]+/", "TEXT: /(.|\\n)*/"])
    required = set(schema.get("required") or ())
    rules, parts = [], []
    for i, (key, prop) in enumerate(props.items()):
        parts.append(f"p{i}" + ("" if key in required else "?"))
        head = json.dumps(opening.format(key=key))
        kind = prop.get("type") if isinstance(prop, dict) else None
        kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
        enum = prop.get("enum") if isinstance(prop, dict) else None
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            rules.append(f"p{i}: {head} ({' | '.join(json.dumps(e) for e in enum)}) {json.dumps(closing)}")
        elif kind in (None, "string"):
            rules += [f"p{i}: {head} v{i}", f"v{i}[lazy]: TEXT {json.dumps(closing)}"]
        elif kind in _XML_VALUES:
            rules.append(f"p{i}: {head} ({_XML_VALUES[kind]}) {json.dumps(closing)}")
        else:  # (objects, arrays, anyOf...: JSON, as the parser reads them)
            rules += [f"p{i}: {head} v{i} {json.dumps(closing)}", f"v{i}: %json {json.dumps(prop)}"]
    return "\n".join([f"start: {' '.join(parts)}", *rules, "TEXT: /(.|\\n)*/"])


# Kimi K2 numbers its calls across the conversation (`functions.NAME:INDEX`): the tag admits the next few indices
KIMI_INDICES = 8


def strict_tool_tag(parser: str, tools: list[dict], enforce_all: bool = False,
                    messages: Optional[list[dict]] = None, mistral_args: bool = True,
                    ) -> Optional[StructuredOutputsParams]:
    """The structural tag that holds the calls of a `tool_choice: "auto"` request to its tools: None unless a tool
    is strict (`function.strict: true`; all are with enforce_all) and the parser's format is one it knows. Every
    tool's name is held to; the strict ones' arguments to their schema, the others' to any object. `messages`:
    the conversation (Kimi K2's next call index counts the calls in it); `mistral_args`: Mistral's format is
    `[TOOL_CALLS]name[ARGS]{...}` (tokenizers v11+, which have [ARGS]), else a JSON list of calls."""
    strict = [enforce_all or t["function"].get("strict") is True for t in tools]
    if not any(strict):
        return None
    schemas = [(t["function"]["name"], _parameters(t) if s else {"type": "object"}) for t, s in zip(tools, strict)]
    if parser in _CALL_TAGS:
        trigger, begin, end = _CALL_TAGS[parser]
        structures = [{"begin": begin.format(name=name), "end": end, "schema": schema} for name, schema in schemas]
    elif parser in _XML_TAGS:
        trigger, begin, end, opening, closing = _XML_TAGS[parser]
        structures = [{"begin": begin.format(name=name), "end": end,
                       "grammar": xml_arguments_grammar(schema, opening, closing)} for name, schema in schemas]
    elif parser == "kimi_k2":
        trigger = "<|tool_call_begin|>"
        base = sum(len(m.get("tool_calls") or []) for m in messages or []
                   if isinstance(m, dict) and m.get("role") == "assistant")
        structures = [{"begin": f"{trigger}functions.{name}:{i}<|tool_call_argument_begin|>",
                       "end": "<|tool_call_end|>", "schema": schema}
                      for name, schema in schemas for i in range(base, base + KIMI_INDICES)]
    elif parser == "mistral" and mistral_args:
        trigger = "[TOOL_CALLS]"
        structures = [{"begin": f"{trigger}{name}[ARGS]", "end": "", "schema": schema} for name, schema in schemas]
    elif parser == "mistral":
        trigger = "[TOOL_CALLS]"
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas]
        # (json.dumps' spacing, as these models write the list: whitespace left free)
        structures = [{"begin": trigger, "end": "", "schema": {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                                                "x-guidance": {"whitespace_flexible": True}}}]
    else:
        return None
    return StructuredOutputsParams(structural_tag={"structures": structures, "triggers": [trigger]})


def tool_constraint(forced: ForcedTool, tools: list[dict], parallel: bool = True) -> StructuredOutputsParams:
    """Named: the output is the function's arguments object. Required: a non-empty JSON list of calls (of one
    call when `parallel_tool_calls` is false)."""
    if forced.name is not None:
        tool = next(t for t in tools if t["function"]["name"] == forced.name)
        return StructuredOutputsParams(json=_parameters(tool))
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)

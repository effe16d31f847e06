"""Tool calls in chat output (`--tool-call-parser hermes`): the parser on whole texts and on any split of them,
the chat response shapes built from streamed pieces, and the live server's plumbing."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.outputs import StreamOutput
from streamer.server.responses import ChatFormat, Choice
from streamer.server.tool_calls import PARSERS, ForcedToolCalls, HermesToolCalls, make_parser, parse_all

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_whole_texts():
    content, calls = parse_all("Let me look.\n" + CALL)
    assert content == "Let me look.\n"
    assert _names_args(calls) == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_") and calls[0]["index"] == 0
    two = parse_all(CALL + "\n" + CALL.replace("get_weather", "get_time"))[1]
    assert [c["index"] for c in two] == [0, 1] and _names_args(two)[1][0] == "get_time"
    assert len({c["id"] for c in two}) == 2
    # Not a call: text stays text.
    for text in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f"', "a < b, <tool and <tool_call", "plain text"]:
        assert parse_all(text) == (text, [])
    # Arguments already a JSON string are passed through.
    assert parse_all('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0]["function"][
        "arguments"] == '{"x": 1}'


pieces = st.lists(st.sampled_from(["Hi ", "<", "tool", "call>", CALL, "\n", "x<y", "</tool_call>", "{}"]),
                  max_size=8)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(parts=pieces, cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_split_gives_the_whole_texts_answer(parts, cuts):
    text = "".join(parts)
    cuts = sorted({c for c in cuts if c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = HermesToolCalls()
    content, calls = [], []
    for i, chunk in enumerate(chunks or [""]):
        c, k = stream.feed(chunk, final=i == len(chunks or [""]) - 1)
        content.append(c)
        calls += k
    want_content, want_calls = parse_all(text)
    assert "".join(content) == want_content
    assert _names_args(calls) == _names_args(want_calls)
    assert [c["index"] for c in calls] == list(range(len(calls)))


def _outs(texts, finish="stop"):
    return [StreamOutput("r", 0, [i], t, finish_reason=finish if i == len(texts) - 1 else None)
            for i, t in enumerate(texts)]


@pytest.mark.parametrize("texts", [
    ["Sure", ". <tool", "_call>\n{\"name\": \"get_weather\", \"argu", "ments\": {\"city\": \"Paris\"}}\n</tool_call>"],
    ["<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", "<tool_call>{\"name\": \"b\", \"arguments\": {}}",
     "</tool_call>"],
])
def test_chat_shapes_streamed_and_not(texts):
    fmt = ChatFormat(1, None, False, tool_calls=True)
    choice, chunks = Choice(), []
    for out in _outs(texts):
        piece = fmt.piece(0, 0, out)
        choice.add(piece)
        chunk = fmt.chunk_choice(piece)
        if chunk is not None:
            chunks.append(chunk)
    final = fmt.final_choice(0, choice)
    msg = final["message"]
    assert final["finish_reason"] == "tool_calls" and chunks[-1]["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in (msg["content"] or "")
    streamed_calls = [tc for ch in chunks for tc in ch["delta"].get("tool_calls", [])]
    assert [tc["function"] for tc in streamed_calls] == [tc["function"] for tc in msg["tool_calls"]]
    assert all("index" not in tc for tc in msg["tool_calls"]) and all("index" in tc for tc in streamed_calls)
    assert "".join(ch["delta"].get("content", "") for ch in chunks) == choice.text
    assert msg["content"] == (choice.text if choice.text.strip() else None)


def test_without_a_call_the_text_is_content():
    fmt = ChatFormat(1, None, False, tool_calls=True)
    choice = Choice()
    for out in _outs(["The answer", " is 4 < 5."]):
        choice.add(fmt.piece(0, 0, out))
    final = fmt.final_choice(0, choice)
    assert final["message"] == {"role": "assistant", "content": "The answer is 4 < 5."}
    assert final["finish_reason"] == "stop"


# ---------------------------------------------------------------------------------------------- more formats
# (parser, text, content, [(name, arguments)]): vLLM's formats of the same names.
FORMATS = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; {"name": "b", "arguments": {}}',
     "", [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    ("llama3_json", '\n{"name": "a", "parameters": {}};\n', "", [("a", {})]),
    ("llama3_json", '{"name": "a", "parameters": {}} then text', " then text", [("a", {})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops": 1}', '; {"oops": 1}', [("a", {})]),
    ("llama3_json", 'Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),
    ("llama3_json", '<|python_tag|>print(1)', '<|python_tag|>print(1)', []),
    ("llama3_json", "<|pyth", "<|pyth", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "f", "arguments": {"s": "[TOOL_CALLS]]"}}]\n', "Let me check. \n",
     [("f", {"s": "[TOOL_CALLS]]"})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]', []),
    ("mistral", '[TOOL_CALLS] hello [there]', "[TOOL_CALLS] hello [there]", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {', '[TOOL_CALLS][{"name": "f", "arguments": {', []),
    ("mistral", "a [TOOL_CA", "a [TOOL_CA", []),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}[TOOL_CALLS]f[CALL_ID]x9[ARGS]{}', "",
     [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("mistral", "[TOOL_CALLS]f[CALL_ID]abc{}", "[TOOL_CALLS]f[CALL_ID]abc{}", []),
    ("pythonic", '[get_weather(city="Paris"), f2(x=1, y=[1, -2.5, {"k": None}], z=(True, \'a)]\'))]', "",
     [("get_weather", {"city": "Paris"}), ("f2", {"x": 1, "y": [1, -2.5, {"k": None}], "z": [True, "a)]"]})]),
    ("pythonic", '<|python_start|>[f()]<|python_end|>', "", [("f", {})]),
    ("pythonic", '  [f(s="""x"y""")] Done.', " Done.", [("f", {"s": 'x"y'})]),
    ("pythonic", '[f(s="a\\"]", t=\'\\\\\')]', "", [("f", {"s": 'a"]', "t": "\\"})]),
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "[f(1)]", "[f(1)]", []),                       # positional arguments: not a call
    ("pythonic", '[f(x=open("a"))]', '[f(x=open("a"))]', []),   # not a literal: never run
    ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", []),         # a set is not JSON
    ("pythonic", "[os.system(x=1)]", "[os.system(x=1)]", []),
    ("pythonic", "[f(x=1), g(y=", "[f(x=1), g(y=", []),
    ("pythonic", "Sure: [f()]", "Sure: [f()]", []),
    ("pythonic", "[see the docs]", "[see the docs]", []),
    # Qwen3-Coder's XML: values are text (no tools given: every value stays a string)
    ("qwen3_coder", 'Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
     '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>', "Sure.\n",
     [("get_weather", {"city": "Paris", "days": "3"})]),
    ("qwen3_coder", "<tool_call><function=f></function></tool_call><tool_call><function=g><parameter=s>a\n\nb"
     "</parameter></function></tool_call> done", " done", [("f", {}), ("g", {"s": "a\n\nb"})]),
    ("qwen3_coder", "<tool_call><function=f>junk<parameter=a>1</parameter></function></tool_call>",
     "<tool_call><function=f>junk<parameter=a>1</parameter></function></tool_call>", []),
    ("qwen3_coder", "<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call>", []),
    ("qwen3_coder", "<tool_call><function=f><parameter=a>1</parameter>", "<tool_call><function=f><parameter=a>1</parameter>",
     []),
    # GLM-4.5: key / value pairs (values read as JSON where they are JSON, without a schema)
    ("glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Let me check.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("glm45", "<tool_call>f\n</tool_call><tool_call>g<arg_key>x</arg_key><arg_value>[1, {\"a\": null}]</arg_value>"
     "</tool_call>", "", [("f", {}), ("g", {"x": [1, {"a": None}]})]),
    ("glm45", "<tool_call>f<arg_key>x</arg_key></tool_call>", "<tool_call>f<arg_key>x</arg_key></tool_call>", []),
    ("glm45", "<tool_call></tool_call>", "<tool_call></tool_call>", []),
    # DeepSeek-V3: a calls section of ```json blocks; V3.1: name<sep>{json}
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.", [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```<｜tool▁call▁end｜>", []),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>",
     "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>", []),
    ("deepseek_v31", "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{", "x<｜tool▁call▁begin｜>f<｜tool▁sep｜>{",
     []),
    # Seed-OSS: Qwen3-Coder's XML in its own tags
    ("seed_oss", "Sure.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
     "</seed:tool_call>", "Sure.", [("get_weather", {"city": "Paris"})]),
    ("seed_oss", "<tool_call><function=f></function></tool_call>", "<tool_call><function=f></function></tool_call>", []),
    # Granite 3.x: a JSON array after <|tool_call|> (3.0), <tool_call> (3.1+) or nothing
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]',
     "", [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("granite", ' <tool_call> [{"name": "f", "arguments": {"s": "]"}}]\n\n', "", [("f", {"s": "]"})]),
    ("granite", '[{"name": "f", "arguments": {}}] done', "done", [("f", {})]),
    ("granite", '[{"name": "f", "arguments": {}}, 3]', '[{"name": "f", "arguments": {}}, 3]', []),
    ("granite", '[]', '[]', []),
    ("granite", 'Sure: [{"name": "f", "arguments": {}}]', 'Sure: [{"name": "f", "arguments": {}}]', []),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {', '<|tool_call|>[{"name": "f", "arguments": {', []),
    ("granite", '<|tool_call|>see above', '<|tool_call|>see above', []),
    ("granite", "<|tool_c", "<|tool_c", []),
    ("llama4_pythonic", '<|python_start|>[f(x=1)]<|python_end|>', "", [("f", {"x": 1})]),
    # Kimi K2
    ("kimi_k2", 'I will.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
     '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.f:1'
     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", "I will.",
     [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("kimi_k2", "<|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|>",
     "<|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|>", []),
]


def _feed(parser, chunks):
    content, calls = [], []
    for i, chunk in enumerate(chunks):
        c, k = parser.feed(chunk, final=i == len(chunks) - 1)
        content.append(c)
        calls += k
    return "".join(content), calls


@pytest.mark.parametrize("name,text,content,calls", FORMATS)
def test_formats_whole_and_every_split(name, text, content, calls):
    got_content, got_calls = parse_all(text, name)
    assert got_content == content
    assert _names_args(got_calls) == calls
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    assert all(c["type"] == "function" for c in got_calls)
    assert all(c["id"].startswith("call_") for c in got_calls if name != "mistral")  # (mistral's: see below)
    # Streamed in two pieces at every position, and one character at a time: the same answer.
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in splits:
        c, k = _feed(make_parser(name), chunks)
        assert (c, _names_args(k)) == (content, calls), chunks


def test_three_way_splits():
    """Every split into three pieces of a text with calls, content and partial tags around them."""
    for name, text in [("mistral", 'ab [TOOL_CALLS]f{"a": 1} [TOOL_CALLS][{"name": "g", "arguments": {}}]x['),
                       ("mistral", 'a[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1} [TOOL_CALLS]g[ARGS]{}b'),
                       ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {}} z'),
                       ("pythonic", '<|python_start|>[f(a="]"), g()]<|python_end|> ok')]:
        want = parse_all(text, name)
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                c, k = _feed(make_parser(name), [text[:i], text[i:j], text[j:]])
                assert (c, _names_args(k)) == (want[0], _names_args(want[1])), (i, j)


VOCAB = {
    "llama3_json": ["<|python_tag|>", "<|py", "{", "}", '"name": "f"', '"parameters": {}', ", ", ";", " ", "x",
                    '{"name": "f", "parameters": {"a": 1}}', '"'],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "_CALLS]", "[", "]", "{", "}", '{"name": "f", "arguments": {}}', ", ", "f",
                "[ARGS]", " ", "hi", '"', "[CALL_ID]", "abc123XYZ", "[CALL"],
    "pythonic": ["<|python_start|>", "<|python_end|>", "[", "]", "f(", "g(x=1)", ")", ", ", "a=", '"s"', "'", " ",
                 "hi", "(", "{1: 2}"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>",
                    "\n", "1", "<tool", "</param", "hi", "<function=", "x>"],
    "glm45": ["<tool_call>", "</tool_call>", "f", "\n", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "a", "1", '"s"', "<arg", "hi"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "function<｜tool▁sep｜>f\n```json\n", "{}", "\n```", "<｜tool", "hi", "\n"],
    "deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "f", "<｜tool▁sep｜>", "{}", '{"a": 1}', "<｜tool▁", "hi"],
    "granite": ["<|tool_call|>", "<tool_call>", "<|tool", "[", "]", '{"name": "f", "arguments": {}}', ", ", " ", "\n",
                "hi", "{", "}", '"'],
    "seed_oss": ["<seed:tool_call>", "</seed:tool_call>", "<function=f>", "</function>", "<parameter=a>",
                 "</parameter>", "\n", "1", "<seed:tool", "hi"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
                "functions.f:0", "<|tool_call_argument_begin|>", "{}", "<|tool", "hi"],
}


@pytest.mark.parametrize("name", list(VOCAB))
@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_formats_any_split_gives_the_whole_texts_answer(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(VOCAB[name]), max_size=10)))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=6))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    want_content, want_calls = parse_all(text, name)
    content, calls = _feed(make_parser(name), chunks)
    assert content == want_content and _names_args(calls) == _names_args(want_calls)
    if not want_calls:  # what is not a call is never lost (a calls section's frames are the format's, not text)
        for frame in getattr(make_parser(name), "FRAMES", ()):
            text = text.replace(frame, "")
        assert want_content == text


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        make_parser("nope")


@pytest.mark.parametrize("name,text,content,calls", [f for f in FORMATS if f[3]] + [
    ("hermes", CALL + " and " + CALL, " and ", [("get_weather", {"city": "Paris", "unit": "C"})] * 2)])
def test_calls_come_out_when_complete(name, text, content, calls):
    """Streamed one character at a time, each call is emitted with the character that completes it, not at the end."""
    parser = make_parser(name)
    emitted_at = []
    for i, ch in enumerate(text):
        emitted_at += [i] * len(parser.feed(ch)[1])
    assert not parser.feed("", final=True)[1] and len(emitted_at) == len(calls)
    # Without the character that completed it, that call is not there yet.
    for i in set(emitted_at):
        assert len(parse_all(text[:i], name)[1]) < sum(1 for j in emitted_at if j <= i)


# ---------------------------------------------------------------------------------------------- typed XML values
TYPED_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
    "l": {"type": "array"}, "s": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}]


@pytest.mark.parametrize("name,value,want", [
    ("n", "42", 42), ("n", "4x", "4x"), ("x", "2.5", 2.5), ("x", "3", 3), ("x", "3.0", 3.0),
    ("b", "True", True), ("b", "false", False), ("b", "yes", "yes"), ("o", '{"a": [1]}', {"a": [1]}),
    ("o", "{'a': 1}", {"a": 1}), ("l", "[1, 2]", [1, 2]), ("s", "42", "42"), ("s", "null", None),
    ("maybe", "7", 7), ("maybe", "null", None), ("unknown", "42", "42"),
])
def test_qwen3_coder_values_take_their_schemas_types(name, value, want):
    """As vLLM's qwen3_coder: each value by its parameter's JSON-schema type; text that is not that type, and a
    parameter the schema does not name, stay strings."""
    text = f"<tool_call>\n<function=f>\n<parameter={name}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    calls = parse_all(text, "qwen3_coder", TYPED_TOOLS)[1]
    assert _names_args(calls) == [("f", {name: want})]
    # Without the tools every value stays text.
    assert _names_args(parse_all(text, "qwen3_coder")[1]) == [("f", {name: value})]


def test_glm45_values_take_their_schemas_types():
    """GLM-4.5: a string parameter keeps text that looks like JSON; others are JSON where they parse."""
    text = ("<tool_call>f<arg_key>s</arg_key><arg_value>42</arg_value><arg_key>n</arg_key><arg_value>42</arg_value>"
            "<arg_key>other</arg_key><arg_value>[1]</arg_value><arg_key>t</arg_key><arg_value>hi</arg_value></tool_call>")
    assert _names_args(parse_all(text, "glm45", TYPED_TOOLS)[1]) == [("f", {"s": "42", "n": 42, "other": [1],
                                                                              "t": "hi"})]


def test_mistral_call_ids_are_the_models_or_nine_characters():
    """Mistral's chat templates refuse a call id that is not 9 letters or digits when the call comes back: the
    model's own id is kept (v11's [CALL_ID], a listed call's "id"), else one of that shape is made."""
    import re
    _, calls = parse_all('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{}[TOOL_CALLS]g[ARGS]{}'
                         '[TOOL_CALLS][{"name": "h", "arguments": {}, "id": "zzzzzzzz1"}, {"name": "i", "arguments": {}}]',
                         "mistral")
    ids = [c["id"] for c in calls]
    assert ids[0] == "a1B2c3D4e" and ids[2] == "zzzzzzzz1"
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 4
    assert [c["index"] for c in calls] == [0, 1, 2, 3]


DEEP = 100_000  # far past the interpreter's recursion limit


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_deeply_nested_output_stays_content(name):
    """A model's output is untrusted too: JSON nested too deep to read (or to write back as arguments) is not a
    call, and never an exception, in every parser's framing, whole or streamed."""
    deep = "[" * DEEP + "]" * DEEP
    call = '{"name": "f", "arguments": ' + deep + "}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "object"}}}}}]
    texts = [f"<tool_call>{call}</tool_call>", f"<tool_call>{deep}</tool_call>", call, f"[{call}]",
             f"[TOOL_CALLS]{call}", f"[TOOL_CALLS][{call}]", f"[TOOL_CALLS]f{deep}", f"<|tool_call|>[{call}]",
             f"[f(x={deep})]", f"<｜tool▁call▁begin｜>f<｜tool▁sep｜>{{\"x\": {deep}}}<｜tool▁call▁end｜>",
             f"<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{{\"x\": {deep}}}<|tool_call_end|>",
             f"<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{deep}</arg_value>\n</tool_call>",
             f"<tool_call>\n<function=f>\n<parameter=x>\n{deep}\n</parameter>\n</function>\n</tool_call>"]
    for text in texts:
        content, calls = parse_all(text, name, tools)
        assert calls or content == text, text[:40]
        parser = make_parser(name, tools)  # streamed: the nesting arrives in pieces
        got = [parser.feed(text[i:i + 30_000]) for i in range(0, len(text), 30_000)] + [parser.feed("", final=True)]
        assert "".join(c for c, _ in got) == content and sum(len(k) for _, k in got) == len(calls)


def test_deeply_nested_calls_near_the_recursion_limit_are_content_or_calls():
    """Nesting that reads but cannot be written back (close to the limit, from a deeper stack) is content too."""
    import sys
    depth = sys.getrecursionlimit() - 20
    nested = "[" * depth + "]" * depth
    for text in (f'<tool_call>{{"name": "f", "arguments": {{"x": {nested}}}}}</tool_call>',
                 f'{{"name": "f", "parameters": {{"x": {nested}}}}}'):
        for parser in ("hermes", "llama3_json"):
            content, calls = parse_all(text, parser)
            assert calls or content


@pytest.mark.parametrize("body", ["[" * DEEP + "]" * DEEP, '[{"name": "f", "arguments": ' + "[" * DEEP + "]" * DEEP
                                  + "}]", '[{"name": "f", "arguments": {"x": [1]}}]'])
def test_required_tool_choice_output_too_deep_is_content(body):
    """tool_choice "required": the grammar's JSON list of calls; one too deep to read stays the content."""
    parser = ForcedToolCalls(None)
    assert parser.feed(body[:10]) == ("", [])
    content, calls = parser.feed(body[10:], final=True)
    if "1" in body:
        assert content == "" and _names_args(calls) == [("f", {"x": [1]})]
    else:
        assert content == body and calls == []

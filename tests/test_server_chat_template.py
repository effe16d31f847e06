"""Chat templates render (and tokenize) exactly as transformers' `apply_chat_template` does; their failures are 400s."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from streamer.server.chat_template import ChatTemplate
from streamer.server.protocol import APIError, parse_chat
from streamer.tokenizer.tokenizer import Tokenizer
from tests.tokenizer_factory import make_bytelevel_tokenizer, make_sentencepiece_tokenizer

# A ChatML/Qwen-style template exercising what real ones use: tools + tojson, raise_exception, loop controls,
# namespace(), whitespace control under trim_blocks/lstrip_blocks, and the special-token variables.
RICH_TEMPLATE = """{%- if tools %}
    {{- '<|system|>\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
    {{- 'Tools:' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|system|>\\n' + messages[0]['content'] + '\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unsupported role: ' + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'] }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}{{ '\\n<call>' + (call | tojson) + '</call>' }}{% endfor %}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, 世界 😀"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again\nwith lines"}],
    [{"role": "user", "content": "call it"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "f", "arguments": "{\"x\": 1}"}}]},
     {"role": "tool", "content": "42", "tool_call_id": "c1"}],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "adds <b>&</b>",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]


@pytest.fixture(scope="module", params=["bytelevel", "sentencepiece"])
def tok_dirs(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the factory's folder with its simple template, a copy with RICH_TEMPLATE)."""
    root = tmp_path_factory.mktemp(f"chat-{request.param}")
    make = make_bytelevel_tokenizer if request.param == "bytelevel" else make_sentencepiece_tokenizer
    simple = make(root / "simple")
    rich = root / "rich"
    shutil.copytree(simple, rich)
    cfg = json.loads((rich / "tokenizer_config.json").read_text())
    cfg["chat_template"] = RICH_TEMPLATE
    (rich / "tokenizer_config.json").write_text(json.dumps(cfg))
    return simple, rich


def _hf(path: Path):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(tok_dirs, conv, add_generation_prompt):
    messages = CONVERSATIONS[conv]
    for path in tok_dirs:
        ours_tok = Tokenizer.from_pretrained(path)
        template = ChatTemplate.from_tokenizer(ours_tok)
        hf = _hf(path)
        for tools in (None, TOOLS):
            if path == tok_dirs[0] and (tools or conv == 2):
                continue  # the simple template concatenates content only
            text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                              tools=tools)
            assert text == expected
            ids = ours_tok.encode(text, add_special_tokens=False)  # the template placed BOS already
            assert ids == _hf_ids(hf, messages, add_generation_prompt=add_generation_prompt, tools=tools)


def test_continue_final_message_matches_transformers(tok_dirs):
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    for path in tok_dirs:
        text = ChatTemplate.from_tokenizer(Tokenizer.from_pretrained(path)).render(
            messages, add_generation_prompt=False, continue_final_message=True)
        assert text == _hf(path).apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert text.endswith("one, two,")


def test_raise_exception_and_sandbox_are_400s(tok_dirs):
    template = ChatTemplate.from_tokenizer(Tokenizer.from_pretrained(tok_dirs[1]))
    with pytest.raises(APIError) as e:
        template.render([{"role": "developer", "content": "x"}])
    assert e.value.status == 400 and "unsupported role: developer" in e.value.message
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(APIError) as e:
        evil.render([{"role": "user", "content": "x"}])
    assert e.value.status == 400 and e.value.code == "chat_template_error"
    for broken in ("{% for %}", "{{ x | nofilter }}"):
        t = ChatTemplate(broken, {})
        assert not t.available
        with pytest.raises(APIError, match="does not compile"):
            t.render([{"role": "user", "content": "x"}])
    with pytest.raises(APIError, match="no chat template"):
        ChatTemplate(None, {}).render([{"role": "user", "content": "x"}])


def test_chat_template_kwargs_and_special_tokens():
    t = ChatTemplate("{{ bos_token }}{{ greeting | default('none') }}{{ messages | length }}", {"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "x"}]) == "<s>none1"
    assert t.render([{"role": "user", "content": "x"}], extra={"greeting": "hey", "messages": "ignored"}) == "<s>hey1"


def test_text_parts_are_joined_and_other_parts_refused():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]})
    assert req.messages == [{"role": "user", "content": "a\nb"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    req = parse_chat({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "a"}]}]})
    assert req.messages[0]["content"] == [{"type": "image", "image": image["image_url"]["url"]},
                                          {"type": "text", "text": "a"}]  # images: kept as parts
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert e.value.param == "messages[0].content[0]"


def test_offline_chat_renders_as_transformers(llama_dir):
    """`LLM.chat` renders each conversation with the model's template exactly as apply_chat_template does, and
    generates from it; a template error is a ValueError."""
    from streamer import LLM, SamplingParams
    hf = _hf(llama_dir)
    convs = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(str(llama_dir), dtype="float32") as llm:
        outs = llm.chat(convs, params)
        want = llm.generate([{"prompt_token_ids": _hf_ids(hf, c, add_generation_prompt=True)} for c in convs], params)
        assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        assert llm.chat(convs[0], params)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids  # one conversation
        with pytest.raises(ValueError, match="messages"):
            llm.chat([{"role": "user"}], params)


@pytest.mark.parametrize("source, fmt", [
    ("{% for part in message['content'] %}{{ part.text }}{% endfor %}", "openai"),
    ("{%- for c in message.content -%}{{ c.text }}{%- endfor %}", "openai"),
    ("{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}<image>{% endfor %}", "openai"),
    ("{% for c in message['content'] if c.type == 'text' %}{% endfor %}{% if m.content is string %}{% endif %}",
     "both"),
    # A loop over something made from the content reads it as a string (the demo model's template).
    ("{% for line in message['content'].split('\\n') %}{{ '# ' + line }}{% endfor %}", "string"),
    ("{{ message['content'] }}", "string"),
])
def test_content_format_reads_the_loop_target(source, fmt):
    from streamer.server.chat_template import content_format
    assert content_format(source) == fmt


def test_demo_model_template_renders_string_contents():
    """The embedded model's template splits each content into lines: it must be given the string."""
    from streamer.demo_model import default_model_path
    tok = Tokenizer.from_pretrained(str(default_model_path()))
    t = ChatTemplate.from_tokenizer(tok)
    assert t.content_format == "string"
    text = t.render([{"role": "user", "content": "hi\nthere"}, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "more"}])
    assert text == f"{tok.bos_token}# hi\n# there\nok{tok.eos_token}# more\n"


def test_user_chat_template_from_a_file_or_inline(tmp_path):
    """`chat_template` (engine argument, `--chat-template`): a file or the template itself replaces the model's for
    LLM.chat and the server alike; LLM.chat(chat_template=...) overrides it for one call; a missing file or a
    template that does not compile is a ValueError at start-up naming the field."""
    from streamer import LLM, SamplingParams
    from streamer.config import EngineConfig
    from streamer.demo_model import default_model_path
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(str(default_model_path()), chat_template=str(path)) as llm:
        tok = llm.tokenizer
        assert llm.chat([{"role": "user", "content": "hi"}], params)[0].prompt_token_ids == \
            tok.encode(f"{tok.bos_token}Q: hi\nA:", add_special_tokens=False)
        out = llm.chat([{"role": "user", "content": "hi"}], params, chat_template="<{{ messages[0].content }}>")
        assert out[0].prompt_token_ids == tok.encode("<hi>", add_special_tokens=False)
        with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
            llm.chat([{"role": "user", "content": "hi"}], params, chat_template="no-such-file.jinja")
    for bad, message in (("/no/such/t.jinja", "neither a file nor a Jinja template"),
                         ("{% if %}", "does not compile")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(chat_template=bad)

"""Chat templates rendered the way Hugging Face's `apply_chat_template` renders them.

Same environment (a sandboxed, immutable jinja2 environment with trim_blocks/lstrip_blocks and the loopcontrols
extension), same helpers (`raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`), same
variables (messages, tools, add_generation_prompt, the special tokens), so that a checkpoint's template gives the
text it gives under transformers. The text is then tokenized without adding special tokens again.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from streamer.server.protocol import APIError


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it is a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """A user's chat template (`--chat-template`, as vLLM's): the path of a file holding it, or the Jinja source
    itself. ValueError when it is neither, or when it does not compile."""
    try:
        is_file = "\n" not in value and Path(value).expanduser().is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        is_file = False
    if is_file:
        source = Path(value).expanduser().read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    try:
        compile_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template does not compile: {e}") from None
    return source


class ChatTemplate:
    """A model's chat template, compiled once. `render` raises APIError (400) for anything that goes wrong."""

    def __init__(self, source: Optional[str], special_tokens: dict[str, Optional[str]],
                 image_placeholder: Optional[str] = None, video_placeholder: Optional[str] = None,
                 audio_placeholder: Optional[str] = None) -> None:
        """image_placeholder: the text of the model's image token (vision-language models), written in place of
        each image for templates that take string contents; video_placeholder, audio_placeholder: the same for
        videos and audio clips (None: the model takes none)."""
        self.source = source
        self.image_placeholder = image_placeholder
        self.video_placeholder = video_placeholder
        self.audio_placeholder = audio_placeholder
        self.content_format = content_format(source)
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._template: Optional[jinja2.Template] = None
        self._error: Optional[str] = None
        if source is None:
            self._error = ("this model has no chat template (tokenizer_config.json has no chat_template and there "
                           "is no chat_template.jinja): use /v1/completions with a plain prompt, or give the server "
                           "one with --chat-template")
        else:
            try:
                self._template = compile_template(source)
            except jinja2.TemplateError as e:
                self._error = f"this model's chat template does not compile: {e}"

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, image_placeholder: Optional[str] = None,
                       video_placeholder: Optional[str] = None, source: Optional[str] = None,
                       audio_placeholder: Optional[str] = None) -> "ChatTemplate":
        """The tokenizer's template (or `source`, in its place) with the tokenizer's special tokens."""
        def name(token_id: Optional[int]) -> Optional[str]:
            return tokenizer.id_to_token(token_id) if token_id is not None else None
        return cls(source if source is not None else tokenizer.chat_template, {
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": name(tokenizer.pad_token_id), "unk_token": name(tokenizer.unk_token_id)},
            image_placeholder, video_placeholder, audio_placeholder)

    @property
    def available(self) -> bool:
        return self._template is not None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Optional[list[dict]] = None,
               extra: Optional[dict[str, Any]] = None) -> str:
        if self._template is None:
            raise APIError(self._error or "no chat template", param="messages", code="no_chat_template")
        # As HF: the caller's chat_template_kwargs override the special tokens (but not the named arguments).
        variables = {**self.special_tokens, **{k: v for k, v in (extra or {}).items() if k not in _RESERVED}}
        messages = [self._shape(m) for m in messages]
        try:
            text = self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception(), undefined names, sandbox violations
            raise APIError(f"chat template error: {e}", param="messages", code="chat_template_error") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as e:
            raise APIError(f"chat template error: {type(e).__name__}: {e}", param="messages",
                           code="chat_template_error") from None
        if continue_final_message:
            final = messages[-1]["content"]
            if isinstance(final, list):
                final = "".join(p.get("text", "") for p in final)
            text = _cut_after_final_message(text, final)
        return text

    def _shape(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message's content as the template reads it: parts ({"type": "text"} / {"type": "image"}) for a
        template that loops over them, else a string with the image placeholder first for each image (as vLLM
        writes them). Text-only messages keep their string for templates that accept one."""
        content = message["content"]
        if isinstance(content, str):
            if self.content_format == "openai" and content:
                return {**message, "content": [{"type": "text", "text": content}]}
            return message
        images = sum(p["type"] == "image" for p in content)
        if images and self.image_placeholder is None:
            raise APIError("this model takes no images (its messages may only hold text)", param="messages",
                           code="images_not_supported")
        videos = sum(p["type"] == "video" for p in content)
        if videos and self.video_placeholder is None:
            raise APIError("this model takes no video (video_url content parts): only Qwen2-VL and Qwen2.5-VL "
                           "models do", param="messages", code="videos_not_supported")
        audios = sum(p["type"] == "audio" for p in content)
        if audios and self.audio_placeholder is None:
            raise APIError("this model takes no audio (input_audio / audio_url content parts): only audio-language "
                           "models (Qwen2-Audio) do", param="messages", code="audio_not_supported")
        if self.content_format != "string":
            # (an audio part keeps an "audio" key: Qwen2-Audio's templates test `'audio' in content`)
            parts = [{"type": p["type"]} if p["type"] in ("image", "video") else
                     {"type": "audio", "audio": self.audio_placeholder} if p["type"] == "audio" else p
                     for p in content]
            return {**message, "content": parts}
        texts = [p["text"] for p in content if p["type"] == "text"]
        return {**message, "content": "\n".join([self.image_placeholder] * images +  # type: ignore[operator]
                                                [self.video_placeholder] * videos +  # type: ignore[operator]
                                                [self.audio_placeholder] * audios + texts)}  # type: ignore[list-item]


# A loop over a message's content (as a list of parts), in templates that take OpenAI-style content.
# The loop must be over the content itself (`for line in message['content'].split('\n')` reads a string).
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+(?:message|msg|m)(?:\[\s*['\"]content['\"]\s*\]|\.content)"
                           r"(?=\s*(?:-?%\}|\||if\b|recursive\b))")


def content_format(source: Optional[str]) -> str:
    """How a template reads message contents: "openai" when it loops over content parts and cannot take a string
    (LLaVA's: every content goes as parts), "both" when it also tests `is string` (Gemma 3's, Qwen2-VL's: a
    message gets what the client sent, as transformers renders it), else "string" (images become placeholder text)."""
    if source is None or not _CONTENT_LOOP.search(source):
        return "string"
    return "both" if re.search(r"is\s+string", source) else "openai"


_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _cut_after_final_message(text: str, final: str) -> str:
    """As HF does: end the prompt right after the final (assistant) message's content, so it is continued."""
    final = final.strip()
    pos = text.rfind(final) if final else -1
    if pos < 0:
        raise APIError("continue_final_message: the final message's content is not in the rendered template",
                       param="messages")
    return text[:pos + len(final)]

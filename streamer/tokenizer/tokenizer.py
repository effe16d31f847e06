"""Tokenizer: a Hugging Face checkpoint's tokenizer.json run by the `tokenizers` library, no transformers needed.

Special-token handling follows Hugging Face's own rules for a checkpoint folder:
- `encode(add_special_tokens=True)` uses tokenizer.json's post-processor as is, unless tokenizer_config.json
  sets add_bos_token / add_eos_token; then, as HF's `update_post_processor` does, those flags alone decide:
  BOS is prepended iff add_bos_token, EOS appended iff add_eos_token (never twice).
- `decode(skip_special_tokens=True)` drops every id in `all_special_ids`.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders as _decoders

from streamer.tokenizer.byte_level import byte_level_chars

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> Optional[str]:
    """Special tokens are saved either as plain strings or as AddedToken-style dicts {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> Optional[str]:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    items = value if isinstance(value, list) else [value]
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


class Tokenizer:
    """Thin, typed wrapper over `tokenizers.Tokenizer` plus the checkpoint's special-token configuration."""

    def __init__(self, backend: _HFTokenizer, config: Optional[dict[str, Any]] = None,
                 generation_config: Optional[dict[str, Any]] = None, chat_template: Optional[str] = None) -> None:
        config = config or {}
        self._tok = backend
        # sentence-transformers' do_lower_case (sentence_bert_config.json): texts are lower-cased before tokenizing
        self.lowercase = False
        _add_missing_tokens(backend, config)
        names = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
        ids = {name: (backend.token_to_id(t) if t is not None else None) for name, t in names.items()}
        self.bos_token_id: Optional[int] = ids["bos_token"]
        self.pad_token_id: Optional[int] = ids["pad_token"]
        self.unk_token_id: Optional[int] = ids["unk_token"]
        # EOS: tokenizer_config's eos_token, plus every id generation_config.json lists (e.g. Llama-3's <|eot_id|>).
        gen_eos = _as_id_list((generation_config or {}).get("eos_token_id"))
        self.eos_token_id: Optional[int] = ids["eos_token"] if ids["eos_token"] is not None else next(
            iter(gen_eos), None)
        self.eos_token_ids: frozenset[int] = frozenset(
            gen_eos + ([self.eos_token_id] if self.eos_token_id is not None else []))
        self.bos_token: Optional[str] = self._name_of(self.bos_token_id)
        self.eos_token: Optional[str] = self._name_of(self.eos_token_id)
        self.chat_template: Optional[str] = chat_template or _pick_chat_template(config.get("chat_template"))
        self.all_special_ids: frozenset[int] = self._special_ids(config, ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._template = self._special_template(config)
        self._token_text: dict[int, str] = {}
        self._anchor = self._pick_anchor()
        self._token_bytes: Optional[list[bytes]] | bool = False  # False: not built yet

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load <path>/tokenizer.json (+ tokenizer_config.json, generation_config.json, chat_template.jinja)."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder not found: {folder}")
        tok_file = folder / "tokenizer.json"
        config = _read_json(folder / "tokenizer_config.json")
        if tok_file.is_file():
            try:
                backend = _HFTokenizer.from_file(str(tok_file))
            except Exception as e:  # the Rust side raises a bare Exception for malformed files
                raise ValueError(f"cannot load {tok_file}: {e}") from e
        else:  # an older checkpoint's slow-tokenizer files (streamer/tokenizer/slow_tokenizer.py)
            from streamer.tokenizer.slow_tokenizer import convert, slow_config
            config = slow_config(folder, config)
            converted = convert(folder, config)
            if converted is None:  # Mistral's format: tekken.json or tokenizer.model.v* (streamer/tokenizer/mistral_format.py)
                from streamer.tokenizer.mistral_format import tokenizer_files
                mistral = tokenizer_files(folder)
                if mistral is None:
                    raise FileNotFoundError(
                        f"no tokenizer.json in {folder}, nor a slow tokenizer's files that can be converted "
                        "(vocab.json + merges.txt, vocab.txt, a SentencePiece tokenizer.model, or Mistral's "
                        "tekken.json / tokenizer.model.v*)")
                converted, found = mistral
                config = {**found, **config}
            backend = converted
        jinja = folder / "chat_template.jinja"  # newer HF checkpoints keep the template in its own file
        tok = cls(backend, config, _read_json(folder / "generation_config.json"),
                  jinja.read_text(encoding="utf-8") if jinja.is_file() else None)
        tok.lowercase = bool(_read_json(folder / "sentence_bert_config.json").get("do_lower_case"))
        return tok

    def mark_special(self, ids: range) -> None:
        """Treat `ids` as special too (Whisper's timestamp tokens, which its tokenizer.json adds as plain tokens or
        leaves out): decoding with skip_special_tokens drops them. Call before detokenizing anything."""
        self.all_special_ids = self.all_special_ids | frozenset(ids)

    def _special_ids(self, config: dict[str, Any], named: dict[str, Optional[int]]) -> frozenset[int]:
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        special.update(i for i in named.values() if i is not None)
        special.update(self.eos_token_ids)
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        if isinstance(extra, dict):  # v5 allows {"name": token}
            extra = list(extra.values())
        for value in extra if isinstance(extra, list) else []:
            content = _token_content(value)
            token_id = self._tok.token_to_id(content) if content is not None else None
            if token_id is not None:
                special.add(token_id)
        return frozenset(special)

    def _special_template(self, config: dict[str, Any]) -> Optional[tuple[list[int], list[int]]]:
        """(prefix, suffix) ids when tokenizer_config's add_bos/eos_token flags override the post-processor."""
        if "add_bos_token" not in config and "add_eos_token" not in config:
            return None
        bos = [self.bos_token_id] if config.get("add_bos_token") and self.bos_token_id is not None else []
        eos = [self.eos_token_id] if config.get("add_eos_token") and self.eos_token_id is not None else []
        return bos, eos

    def _name_of(self, token_id: Optional[int]) -> Optional[str]:
        return self._tok.id_to_token(token_id) if token_id is not None else None

    def _pick_anchor(self) -> list[int]:
        """A plain token to decode single tokens after, so that e.g. sentencepiece keeps their leading space."""
        ids = self._tok.encode("a", add_special_tokens=False).ids
        return ids[-1:] if ids else []

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: the longest vocabulary entry (added tokens included; a
        byte-level entry is at least as long as the text it decodes to). A text longer than n times this is more
        than n tokens, whatever it holds (but runs of characters an unknown-token model folds into one [UNK])."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        text = text.lower() if self.lowercase else text
        if add_special_tokens and self._template is not None:
            prefix, suffix = self._template
            return prefix + self._tok.encode(text, add_special_tokens=False).ids + suffix
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text_1: str, text_2: str) -> list[int]:
        """Two texts as one sequence, as transformers' `tokenizer(text_1, text_2)` makes it (a cross-encoder's
        input): the post-processor's pair template, or, where tokenizer_config's add_bos/eos_token flags rule the
        special tokens, each text between them (the pair template transformers' `update_post_processor` writes)."""
        if self.lowercase:
            text_1, text_2 = text_1.lower(), text_2.lower()
        if self._template is None:
            return self._tok.encode(text_1, text_2).ids
        prefix, suffix = self._template
        first, second = (e.ids for e in self._tok.encode_batch([text_1, text_2], add_special_tokens=False))
        return prefix + first + suffix + prefix + second + suffix

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode_batch() needs a list of str")
        texts = [t.lower() for t in texts] if self.lowercase else texts
        if add_special_tokens and self._template is not None:
            prefix, suffix = self._template
            return [prefix + e.ids + suffix for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def to_json(self) -> str:
        """The whole tokenizer (added tokens included) as tokenizer.json text, for llguidance."""
        return self._tok.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids outside the vocabulary (a model's padded embedding rows) decode to nothing."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's text as it reads mid-sentence (for logprobs): sentencepiece's "▁" stays a space,
        special tokens keep their text, a partial UTF-8 sequence reads U+FFFD."""
        text = self._token_text.get(token_id)
        if text is None:
            anchor = self._tok.decode(self._anchor, skip_special_tokens=False)
            both = self._tok.decode(self._anchor + [token_id], skip_special_tokens=False)
            if not both.startswith(anchor):
                both, anchor = self._tok.decode([token_id], skip_special_tokens=False), ""
            text = both[len(anchor):]
            self._token_text[token_id] = text
        return text

    @property
    def token_bytes(self) -> Optional[list[bytes]]:
        """Each id's bytes, for byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's, ...), whose decoding is
        exactly "concatenate the tokens' bytes, read them as UTF-8 (U+FFFD for bad bytes)": the detokenizer then
        decodes a token with one lookup and Python's incremental UTF-8 decoder. None for other tokenizers.
        Built on first use and checked against the tokenizer's own decoding of every id."""
        if self._token_bytes is False:
            self._token_bytes = _byte_level_table(self._tok)
        return self._token_bytes  # type: ignore[return-value]

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (shared, do not modify)."""
        return self._tok

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, pad={self.pad_token_id})")


def _byte_level_table(backend: _HFTokenizer) -> Optional[list[bytes]]:
    """Every id's bytes as the ByteLevel decoder sees the token (its characters mapped through the byte alphabet,
    or, when one is not in it, as an added token, the text's own UTF-8); None unless the decoder is exactly
    ByteLevel and each id's bytes, read as UTF-8, give what the tokenizer decodes it to."""
    if not isinstance(backend.decoder, _decoders.ByteLevel):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    chars = byte_level_chars()
    table = [b""] * size  # (ids without a token decode to nothing)
    for token, i in vocab.items():
        try:
            table[i] = bytes([chars[c] for c in token])
        except KeyError:
            table[i] = token.encode()
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    if any(b.decode("utf-8", "replace") != text for b, text in zip(table, decoded)):
        return None
    return table


def _add_missing_tokens(backend: _HFTokenizer, config: dict[str, Any]) -> None:
    """Like HF: tokens named in tokenizer_config.json that tokenizer.json does not list as added tokens get
    added (a plain vocabulary entry keeps its id), so that they are matched whole and skipped as special."""
    entries = [(_token_content(e), isinstance(e, dict) and e.get("special", True) is not False)
               for e in (config.get("added_tokens_decoder") or {}).values()]
    entries += [(_token_content(config.get(name)), True) for name in _SPECIAL_NAMES]
    seen = {t.content for t in backend.get_added_tokens_decoder().values()}
    for content, special in entries:
        if content is None or content in seen:
            continue
        seen.add(content)
        token = AddedToken(content, special=special, normalized=not special)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])

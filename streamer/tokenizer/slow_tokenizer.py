"""tokenizer.json's equivalent for checkpoint folders that ship only a "slow" tokenizer's files (facebook/opt-*, the
model of vLLM's quickstart, has vocab.json + merges.txt and no tokenizer.json), built with the `tokenizers` library
as transformers' `convert_slow_tokenizer` builds it:

- byte-level BPE, `vocab.json` + `merges.txt` (GPT2Tokenizer, and OPT's, which is one; CodeGen's; RobertaTokenizer
  and BartTokenizer, which frame a text as <s> ... </s>): GPT-2's byte-level pre-tokenizer and decoder; a BOS first
  where tokenizer_config.json's add_bos_token asks for one (the Tokenizer applies that flag itself);
- WordPiece, `vocab.txt` (BertTokenizer and its kin; MPNetTokenizer, whose pair puts two separators between its
  texts): BERT's normaliser (lower-casing as do_lower_case says) and pre-tokenizer, [CLS] $A [SEP] [$B [SEP]].

Named special tokens (tokenizer_config.json's, or special_tokens_map.json's where it has none) become added special
tokens, matched whole; so do added_tokens.json's, at the ids it gives them.

SentencePiece `tokenizer.model` / `spiece.model` files (streamer/tokenizer/sentencepiece_model.py) are converted for the
tokenizer classes whose framing is known: Llama's (LlamaTokenizer, CodeLlamaTokenizer, GemmaTokenizer; a BOS first
unless add_bos_token is false, an EOS last where add_eos_token is true) and T5's (T5Tokenizer: `extra_ids`
<extra_id_N> tokens after the vocabulary, an EOS after each text). Other classes (XLM-RoBERTa's, ALBERT's, ...)
shift ids or frame texts in ways of their own, and are refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from streamer.tokenizer.sentencepiece_model import SentencePieceModel, build_tokenizer

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ROBERTA_STYLE = ("RobertaTokenizer", "BartTokenizer", "LongformerTokenizer", "MarkupLMTokenizer")
_MPNET_STYLE = ("MPNetTokenizer",)
_SPM_FILES = ("tokenizer.model", "spiece.model")
_LLAMA_STYLE = ("LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer")
_T5_STYLE = ("T5Tokenizer",)


def _content(value: Any) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def slow_config(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json's settings, with special_tokens_map.json's tokens where it names none."""
    path = folder / "special_tokens_map.json"
    extra = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    merged = {**{k: v for k, v in extra.items() if k in SPECIAL_NAMES}, **config}
    added = folder / "added_tokens.json"  # {token: id}: what older slow tokenizers added after the vocabulary
    if "added_tokens_decoder" not in merged and added.is_file():
        named = {_content(merged.get(n)) for n in SPECIAL_NAMES}
        named.update(_content(t) for t in merged.get("additional_special_tokens") or [])
        tokens = json.loads(added.read_text(encoding="utf-8"))
        merged["added_tokens_decoder"] = {str(i): {"content": t, "special": t in named}
                                          for t, i in sorted(tokens.items(), key=lambda item: item[1])}
    return merged


def convert(folder: Path, config: dict[str, Any]) -> Optional[Tokenizer]:
    """The folder's slow tokenizer as a `tokenizers.Tokenizer`, or None if it has no files of a kind converted."""
    cls = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tok = _byte_level_bpe(folder, config, roberta=cls in _ROBERTA_STYLE)
    elif (folder / "vocab.txt").is_file():
        tok = _wordpiece(folder, config, mpnet=cls in _MPNET_STYLE)
    elif spm := next((folder / name for name in _SPM_FILES if (folder / name).is_file()), None):
        tok = _sentencepiece(spm, config, cls)
    else:
        return None
    specials = [c for c in (_content(config.get(n)) for n in SPECIAL_NAMES) if c is not None]
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in dict.fromkeys(specials)])
    _add_decoder_tokens(tok, config, folder)
    return tok


def _add_decoder_tokens(tok: Tokenizer, config: dict[str, Any], folder: Path) -> None:
    """tokenizer_config.json's added_tokens_decoder ({id: token}), each at its id or a ValueError: a token that
    landed elsewhere would shift every id after it."""
    entries = sorted(((int(i), e) for i, e in (config.get("added_tokens_decoder") or {}).items()),
                     key=lambda item: item[0])
    for token_id, entry in entries:
        content = _content(entry)
        if content is None:
            continue
        if tok.token_to_id(content) is None:
            special = not isinstance(entry, dict) or entry.get("special", True) is not False
            token = AddedToken(content, special=special, normalized=not special)
            (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != token_id:
            raise ValueError(f"{folder}: the added token {content!r} has id {tok.token_to_id(content)} in the "
                             f"converted tokenizer, not the {token_id} tokenizer_config.json / added_tokens.json give")


def _id(vocab: dict[str, int], token: str, folder: Path) -> int:
    if token not in vocab:
        raise ValueError(f"{folder}: the special token {token!r} that tokenizer_config.json names is not in its "
                         "vocabulary")
    return vocab[token]


def _byte_level_bpe(folder: Path, config: dict[str, Any], roberta: bool) -> Tokenizer:
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        a, b = line.split(" ")
        merges.append((a, b))
    unk = _content(config.get("unk_token"))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk if unk in vocab else None, fuse_unk=False))
    prefix = bool(config.get("add_prefix_space", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    tok.decoder = decoders.ByteLevel()
    if roberta:
        cls, sep = _content(config.get("cls_token")) or "<s>", _content(config.get("sep_token")) or "</s>"
        tok.post_processor = processors.RobertaProcessing((sep, _id(vocab, sep, folder)),
                                                          (cls, _id(vocab, cls, folder)), trim_offsets=True,
                                                          add_prefix_space=prefix)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _wordpiece(folder: Path, config: dict[str, Any], mpnet: bool) -> Tokenizer:
    words = (folder / "vocab.txt").read_text(encoding="utf-8").split("\n")
    if words and words[-1] == "":
        words.pop()
    vocab = {w: i for i, w in enumerate(words)}
    unk = _content(config.get("unk_token")) or "[UNK]"
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True,
                                                handle_chinese_chars=config.get("tokenize_chinese_chars", True),
                                                strip_accents=config.get("strip_accents"),
                                                lowercase=config.get("do_lower_case", True))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    cls = _content(config.get("cls_token")) or ("<s>" if mpnet else "[CLS]")
    sep = _content(config.get("sep_token")) or ("</s>" if mpnet else "[SEP]")
    pair = f"{cls}:0 $A:0 {sep}:0 {sep}:0 $B:1 {sep}:1" if mpnet else f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1"
    tok.post_processor = processors.TemplateProcessing(single=f"{cls}:0 $A:0 {sep}:0", pair=pair,
                                                       special_tokens=[(cls, _id(vocab, cls, folder)),
                                                                       (sep, _id(vocab, sep, folder))])
    return tok


def _sentencepiece(path: Path, config: dict[str, Any], cls: str) -> Tokenizer:
    if cls and cls not in _LLAMA_STYLE + _T5_STYLE:
        raise ValueError(f"{path.parent}: converting {path.name} for tokenizer_class {cls!r} is not supported (only "
                         f"for {', '.join(_LLAMA_STYLE + _T5_STYLE)}); save the tokenizer with transformers to get a "
                         "tokenizer.json")
    if cls not in _T5_STYLE:
        return sentencepiece_llama(path, config)
    tok = build_tokenizer(SentencePieceModel.read(path), legacy=config.get("legacy", True) is not False)
    vocab = tok.get_vocab(with_added_tokens=False)
    extra = int(config.get("extra_ids", 100))
    tok.add_special_tokens([AddedToken(f"<extra_id_{i}>", special=True, normalized=False)
                            for i in reversed(range(extra))])
    eos = _content(config.get("eos_token")) or "</s>"
    tok.post_processor = processors.TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
                                                       special_tokens=[(eos, _id(vocab, eos, path.parent))])
    return tok


def sentencepiece_llama(path: Path, config: dict[str, Any]) -> Tokenizer:
    """A SentencePiece model framed as LlamaTokenizerFast.update_post_processor frames it: a BOS first unless
    add_bos_token is false, an EOS last where add_eos_token is true (also where no tokenizer class is named)."""
    tok = build_tokenizer(SentencePieceModel.read(path), legacy=config.get("legacy", True) is not False)
    vocab = tok.get_vocab(with_added_tokens=False)
    bos = _content(config.get("bos_token")) or "<s>" if config.get("add_bos_token", True) else None
    eos = _content(config.get("eos_token")) or "</s>" if config.get("add_eos_token", False) else None
    ends = [t for t in (bos, eos) if t is not None]
    first = f"{bos}:0 " if bos else ""
    last = f" {eos}:0" if eos else ""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first}$A:0{last}", pair=f"{first}$A:0{last} {first.replace(':0', ':1')}$B:1{last.replace(':0', ':1')}",
        special_tokens=[(t, _id(vocab, t, path.parent)) for t in dict.fromkeys(ends)])
    return tok

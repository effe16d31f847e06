"""tokenizer.json's equivalent for checkpoint folders that ship only a "slow" tokenizer's files (facebook/opt-*, the
model of vLLM's quickstart, has vocab.json + merges.txt and no tokenizer.json), built with the `tokenizers` library
as transformers' `convert_slow_tokenizer` builds it:

- byte-level BPE, `vocab.json` + `merges.txt` (GPT2Tokenizer, and OPT's, which is one; CodeGen's; RobertaTokenizer
  and BartTokenizer, which frame a text as <s> ... </s>): GPT-2's byte-level pre-tokenizer and decoder; a BOS first
  where tokenizer_config.json's add_bos_token asks for one (the Tokenizer applies that flag itself);
- WordPiece, `vocab.txt` (BertTokenizer and its kin; MPNetTokenizer, whose pair puts two separators between its
  texts): BERT's normaliser (lower-casing as do_lower_case says) and pre-tokenizer, [CLS] $A [SEP] [$B [SEP]].

Named special tokens (tokenizer_config.json's, or special_tokens_map.json's where it has none) become added special
tokens, matched whole. SentencePiece `tokenizer.model` files are not converted (they need the sentencepiece
library's model reader).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ROBERTA_STYLE = ("RobertaTokenizer", "BartTokenizer", "LongformerTokenizer", "MarkupLMTokenizer")
_MPNET_STYLE = ("MPNetTokenizer",)


def _content(value: Any) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def slow_config(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json's settings, with special_tokens_map.json's tokens where it names none."""
    path = folder / "special_tokens_map.json"
    extra = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {**{k: v for k, v in extra.items() if k in SPECIAL_NAMES}, **config}


def convert(folder: Path, config: dict[str, Any]) -> Optional[Tokenizer]:
    """The folder's slow tokenizer as a `tokenizers.Tokenizer`, or None if it has no files of a kind converted."""
    cls = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        tok = _byte_level_bpe(folder, config, roberta=cls in _ROBERTA_STYLE)
    elif (folder / "vocab.txt").is_file():
        tok = _wordpiece(folder, config, mpnet=cls in _MPNET_STYLE)
    else:
        return None
    specials = [c for c in (_content(config.get(n)) for n in SPECIAL_NAMES) if c is not None]
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in dict.fromkeys(specials)])
    return tok


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

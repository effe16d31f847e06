"""SentencePiece `tokenizer.model` files (Llama 1/2, Mistral v0.1, Gemma, T5 and their fine-tunes, when they ship no
tokenizer.json), read without the sentencepiece or protobuf libraries and rebuilt as a `tokenizers.Tokenizer` that
encodes as `SentencePieceProcessor.encode` does, following the model's own settings as transformers'
`build_tokenizer_from_spm_proto` does:

- the model: BPE, merges ranked by the merged piece's score (only normal pieces merge), or Unigram with its scores;
  byte fallback where the model was trained with it;
- the normaliser spec, in SentencePiece's order: its precompiled character map (nmt_nfkc and kin), extra-whitespace
  removal, whitespace escaping to "▁", the dummy prefix;
- control pieces become special added tokens; user-defined pieces are emitted whole, never merged.

A model file is a serialised `ModelProto` (sentencepiece_model.proto); `_fields` reads protobuf's wire format, which
is all it takes for the handful of fields used here.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece.Type
UNIGRAM, BPE = 1, 2  # TrainerSpec.ModelType (WORD and CHAR models are not converted)


@dataclass
class Piece:
    text: str
    score: float = 0.0
    kind: int = NORMAL


@dataclass
class SentencePieceModel:
    """The fields of a ModelProto that decide how it encodes (defaults: the .proto's)."""
    pieces: list[Piece] = field(default_factory=list)
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    unk_piece: str = "<unk>"
    treat_whitespace_as_suffix: bool = False
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True

    @classmethod
    def read(cls, path: Path) -> "SentencePieceModel":
        try:
            return cls._parse(path.read_bytes())
        except (IndexError, UnicodeDecodeError, struct.error, ValueError) as e:
            raise ValueError(f"{path} is not a SentencePiece model file: {e}") from e

    @classmethod
    def _parse(cls, data: bytes) -> "SentencePieceModel":
        model = cls()
        for number, value in _fields(data):
            if number == 1:  # repeated SentencePiece pieces
                model.pieces.append(_piece(value))
            elif number == 2:  # TrainerSpec
                model._trainer_spec(value)
            elif number == 3:  # NormalizerSpec
                model._normalizer_spec(value)
        if not model.pieces:
            raise ValueError("it has no pieces")
        return model

    def _trainer_spec(self, data: bytes) -> None:
        self._read_spec(data, _TRAINER_FIELDS)

    def _normalizer_spec(self, data: bytes) -> None:
        self._read_spec(data, _NORMALIZER_FIELDS)

    def _read_spec(self, data: bytes, known: dict[int, tuple[str, Any]]) -> None:
        for number, value in _fields(data):
            if number in known:
                name, convert = known[number]
                setattr(self, name, convert(value))


# field number -> (SentencePieceModel attribute, how its wire value converts), per sentencepiece_model.proto
_TRAINER_FIELDS: dict[int, tuple[str, Any]] = {
    3: ("model_type", int), 24: ("treat_whitespace_as_suffix", bool), 35: ("byte_fallback", bool),
    40: ("unk_id", int), 45: ("unk_piece", lambda v: bytes(v).decode("utf-8"))}
_NORMALIZER_FIELDS: dict[int, tuple[str, Any]] = {
    2: ("precompiled_charsmap", bytes), 3: ("add_dummy_prefix", bool), 4: ("remove_extra_whitespaces", bool),
    5: ("escape_whitespaces", bool)}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one serialised message: varints as ints, the rest as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        wire = key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield key >> 3, value
            continue
        if wire == 2:
            size, pos = _varint(data, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos + size > len(data):
            raise ValueError("truncated message")
        yield key >> 3, data[pos:pos + size]
        pos += size


def _piece(data: bytes) -> Piece:
    piece = Piece("")
    for number, value in _fields(data):
        if number == 1:
            piece.text = bytes(value).decode("utf-8")
        elif number == 2:
            piece.score = struct.unpack("<f", value)[0]
        elif number == 3:
            piece.kind = int(value)
    return piece


def spm_merges(tokens: list[str], scores: list[float], mergeable: list[bool]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a mergeable piece into two mergeable pieces,
    ranked by the merged piece's score (higher first), then its id; SentencePiece's BPE merges in that order."""
    ranks = {t: (-s, i) for i, (t, s, ok) in enumerate(zip(tokens, scores, mergeable)) if ok}
    ranked = [(rank, left, right) for token, rank in ranks.items() for k in range(1, len(token))
              if (left := token[:k]) in ranks and (right := token[k:]) in ranks]
    return [(left, right) for _, left, right in sorted(ranked)]


def build_tokenizer(model: SentencePieceModel, legacy: bool = True) -> Tokenizer:
    """The model as a `tokenizers.Tokenizer` (no BOS/EOS framing: that is the checkpoint's tokenizer class's).

    `legacy` (tokenizer_config.json's, True unless it says otherwise, as transformers' LlamaTokenizer reads it):
    every stretch of text between special tokens gets the dummy prefix, not only the first."""
    if model.treat_whitespace_as_suffix:
        raise ValueError("SentencePiece models with treat_whitespace_as_suffix are not supported")
    tokens = [p.text for p in model.pieces]
    user_defined = [p.text for p in model.pieces if p.kind == USER_DEFINED]
    if model.model_type == BPE:
        merges = spm_merges(tokens, [p.score for p in model.pieces], [p.kind == NORMAL for p in model.pieces])
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=model.unk_piece,
                                   fuse_unk=True, byte_fallback=model.byte_fallback, ignore_merges=bool(user_defined)))
    elif model.model_type == UNIGRAM:
        tok = Tokenizer(models.Unigram([(p.text, p.score) for p in model.pieces], unk_id=model.unk_id,
                                       byte_fallback=model.byte_fallback))
    else:
        raise ValueError(f"SentencePiece model type {model.model_type} is not supported (BPE and Unigram are)")
    tok.normalizer = normalizers.Sequence(_normalizers(model, legacy))
    tok.pre_tokenizer = _pre_tokenizer(model, user_defined, legacy)
    tok.decoder = _decoder(model)
    # user-defined pieces stay in the model's text (the pre-tokenizer isolates them): as added tokens they would
    # start a new stretch of text, which legacy tokenizers give a dummy prefix that SentencePiece does not
    tok.add_special_tokens([AddedToken(p.text, special=True, normalized=False)
                            for p in model.pieces if p.kind == CONTROL])
    return tok


def _normalizers(model: SentencePieceModel, legacy: bool) -> list[normalizers.Normalizer]:
    steps: list[normalizers.Normalizer] = []
    if model.precompiled_charsmap:
        steps.append(normalizers.Precompiled(model.precompiled_charsmap))
    if model.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone here
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if model.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if model.add_dummy_prefix and legacy:
        # Metaspace skips the dummy prefix where the text already starts with "▁"; SentencePiece does not
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
    return steps


def _pre_tokenizer(model: SentencePieceModel, user_defined: list[str],
                   legacy: bool) -> pre_tokenizers.PreTokenizer | None:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if model.add_dummy_prefix:
        steps.append(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if legacy else "first",
                                              split=False))
    if user_defined:  # SentencePiece emits them whole: isolate them after the dummy prefix is in place
        pattern = "|".join(re.escape(t) for t in sorted(user_defined, key=len, reverse=True))
        steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    return pre_tokenizers.Sequence(steps) if steps else None


def _decoder(model: SentencePieceModel) -> decoders.Decoder:
    steps: list[decoders.Decoder] = [decoders.Replace("▁", " ")]
    if model.byte_fallback:
        steps.append(decoders.ByteFallback())
    if model.add_dummy_prefix:  # Strip acts per token: fuse first so that only the text's first space goes
        steps += [decoders.Fuse(), decoders.Strip(content=" ", left=1, right=0)]
    elif model.byte_fallback:
        steps.append(decoders.Fuse())
    return decoders.Sequence(steps)

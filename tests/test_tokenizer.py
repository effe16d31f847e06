"""Tokenizer vs transformers' AutoTokenizer on the factory folders (and config variants), plus loading errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from streamer.tokenizer.tokenizer import Tokenizer
from tests.tokenizer_factory import CHAT_TEMPLATE, CORPUS, make_bytelevel_tokenizer, make_sentencepiece_tokenizer

transformers = pytest.importorskip("transformers")

FACTORIES: dict[str, Callable[[Path], Path]] = {
    "bytelevel": make_bytelevel_tokenizer, "sentencepiece": make_sentencepiece_tokenizer}

TEXTS = CORPUS.splitlines() + [
    "", " ", "  two leading spaces", "trailing  ", "\n\n\tindented\n", "a", "Hello world",
    "你好，世界！🙂", "👨‍👩‍👧‍👦 family", "ça va? ÇA VA!", "def f(x):\n    return x ** 2\n",
    "<|begin_of_text|>literal special<|end_of_text|>", "<s>[INST] hi [/INST]</s>", "<unk> <|pad|>",
    "\u0000 nul and \u00ad soft hyphen \u200b zwsp", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters", "Ǆ ǅ ǆ ŉ ﬁ ligatures",
]


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data, ensure_ascii=False))


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FACTORIES[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


# ---------------------------------------------------------------- factory
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_factory_is_deterministic(kind: str, tmp_path: Path) -> None:
    a, b = FACTORIES[kind](tmp_path / "a"), FACTORIES[kind](tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("size", [400, 512, 1024])
def test_factory_vocab_size(kind: str, size: int, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(FACTORIES[kind](tmp_path, vocab_size=size))
    assert 300 < tok.vocab_size <= size
    assert max(tok.all_special_ids) < tok.vocab_size


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_factory_rejects_bad_vocab_size(kind: str, tmp_path: Path) -> None:
    for size in (100, 4096):
        with pytest.raises(ValueError, match="vocab_size"):
            FACTORIES[kind](tmp_path, vocab_size=size)


def test_bytelevel_splits_multibyte_characters(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(make_bytelevel_tokenizer(tmp_path))
    for ch in "好😀한∑":
        ids = tok.encode(ch, add_special_tokens=False)
        assert len(ids) > 1, ch
        assert "\ufffd" in tok.decode(ids[:1])


def test_sentencepiece_byte_fallback(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(make_sentencepiece_tokenizer(tmp_path))
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    assert byte_ids == list(range(3, 259))
    assert not set(byte_ids) & tok.all_special_ids  # bytes are text, never skipped
    ids = tok.encode("好😀", add_special_tokens=False)
    assert sum(i in byte_ids for i in ids) == 7  # 3 + 4 UTF-8 bytes
    assert tok.decode(ids) == "好😀"
    assert "é" in tok.decode([tok.token_to_id("é")])  # frequent accented letters stay whole symbols


# ---------------------------------------------------------------- vs transformers
def test_encode_matches_hf(pair: tuple[Tokenizer, Any]) -> None:
    tok, hf = pair
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    assert tok.encode_batch(TEXTS) == [hf.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS, add_special_tokens=False) == [hf.encode(t, add_special_tokens=False)
                                                                  for t in TEXTS]


def test_one_bos(pair: tuple[Tokenizer, Any]) -> None:
    tok, _ = pair
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_decode_matches_hf(pair: tuple[Tokenizer, Any]) -> None:
    tok, hf = pair
    for text in TEXTS:
        ids = hf.encode(text) + [tok.eos_token_id]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    mid = hf.encode("a") + [tok.eos_token_id, tok.bos_token_id] + hf.encode(" b", add_special_tokens=False)
    assert tok.decode(mid) == hf.decode(mid, skip_special_tokens=True)
    assert tok.decode(mid, skip_special_tokens=False) == hf.decode(mid, skip_special_tokens=False)


def test_special_tokens_match_hf(pair: tuple[Tokenizer, Any]) -> None:
    tok, hf = pair
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                      hf.pad_token_id)
    assert (tok.bos_token, tok.eos_token) == (hf.bos_token, hf.eos_token)
    assert tok.eos_token_ids == {hf.eos_token_id}
    assert tok.all_special_ids == set(hf.all_special_ids)
    assert tok.vocab_size == len(hf)
    for i in (0, 5, 300, tok.vocab_size - 1):
        assert tok.id_to_token(i) == hf.convert_ids_to_tokens(i)
    assert tok.id_to_token(tok.vocab_size + 10) is None


def test_chat_template_kept(pair: tuple[Tokenizer, Any]) -> None:
    tok, hf = pair
    assert tok.chat_template == hf.chat_template == CHAT_TEMPLATE
    rendered = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                      tokenize=False)
    assert rendered == f"{tok.bos_token}<|user|>\nhi\n<|assistant|>\n"


# config variants: with add_bos_token / add_eos_token in tokenizer_config.json the flags decide (HF's
# update_post_processor rule); without them tokenizer.json's post-processor does.
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "no_post_processor+add_bos": (True, {"add_bos_token": True, "add_eos_token": ...}),
    "post_processor+add_bos": (False, {"add_bos_token": True}),
    "post_processor+add_bos+add_eos": (False, {"add_bos_token": True, "add_eos_token": True}),
    "post_processor+no_add_bos": (False, {"add_bos_token": False, "add_eos_token": ...}),
    "post_processor+no_flags": (False, {"add_bos_token": ..., "add_eos_token": ...}),
    "no_post_processor+no_flags": (True, {"add_bos_token": ..., "add_eos_token": ...}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_add_bos_eos_rules_match_hf(variant: str, folder: Path, tmp_path: Path) -> None:
    drop_post, changes = VARIANTS[variant]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    if drop_post:
        _edit_json(tmp_path / "tokenizer.json", post_processor=None)
    _edit_json(tmp_path / "tokenizer_config.json", **changes)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # transformers 5 drops these flags from tokenizer_config.json when a tokenizer.json exists, but honours
    # them when passed explicitly (and transformers 4's Llama tokenizers honour them from the file).
    flags = {k: config[k] for k in ("add_bos_token", "add_eos_token") if k in config}
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), **flags)
    tok = Tokenizer.from_pretrained(tmp_path)
    for text in ("hello", "", "<s>x", "你好"):
        assert tok.encode(text) == hf.encode(text), text
        assert tok.encode_batch([text]) == [hf.encode(text)]
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    ids = tok.encode("hello")
    bos_expected = config.get("add_bos_token", not drop_post)
    assert (ids[0] == tok.bos_token_id) == bos_expected
    assert (ids[-1] == tok.eos_token_id) == bool(config.get("add_eos_token"))


# ---------------------------------------------------------------- config parsing
def test_config_forms(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    eos = config["eos_token"]
    _edit_json(tmp_path / "tokenizer_config.json",
               eos_token={"content": eos, "special": True} if isinstance(eos, str) else eos["content"],
               chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    _edit_json(tmp_path / "generation_config.json", eos_token_id=[7, 8])
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == "D"
    eos_id = tok.token_to_id(eos if isinstance(eos, str) else eos["content"])
    assert tok.eos_token_id == eos_id and tok.eos_token_ids == {eos_id, 7, 8}
    assert {7, 8} <= tok.all_special_ids

    _edit_json(tmp_path / "generation_config.json", eos_token_id=9)
    (tmp_path / "chat_template.jinja").write_text("J")
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_ids == {eos_id, 9} and tok.chat_template == "J"


def test_eos_from_generation_config_only(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    _edit_json(tmp_path / "tokenizer_config.json", eos_token=..., chat_template=...)
    _edit_json(tmp_path / "generation_config.json", eos_token_id=[5, 6])
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == 5 and tok.eos_token_ids == {5, 6}
    assert tok.chat_template is None


def test_added_tokens_decoder_extra_token(folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    decoder = dict(config["added_tokens_decoder"])
    new_id = str(len(json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]))
    decoder[new_id] = {"content": "<|tool|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True}
    _edit_json(tmp_path / "tokenizer_config.json", added_tokens_decoder=decoder)
    tok = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.token_to_id("<|tool|>") == hf.convert_tokens_to_ids("<|tool|>") == int(new_id)
    assert tok.encode("a<|tool|>b") == hf.encode("a<|tool|>b")
    assert int(new_id) in tok.all_special_ids and tok.vocab_size == len(hf)
    assert tok.decode(tok.encode("a<|tool|>b")) == hf.decode(hf.encode("a<|tool|>b"), skip_special_tokens=True)


def test_named_special_token_missing_from_added_tokens(folder: Path, tmp_path: Path) -> None:
    """eos named in tokenizer_config.json but a plain vocabulary entry in tokenizer.json is still special."""
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    eos = config["eos_token"]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != eos]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    _edit_json(tmp_path / "tokenizer_config.json", added_tokens_decoder={
        k: v for k, v in config["added_tokens_decoder"].items() if v["content"] != eos})
    tok = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode("hi") + [tok.eos_token_id] + tok.encode(" yo", add_special_tokens=False)
    assert tok.eos_token_id in tok.all_special_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "hi yo"
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.encode(f"x{eos}y") == hf.encode(f"x{eos}y")


def test_decode_ignores_out_of_vocab_ids(pair: tuple[Tokenizer, Any]) -> None:
    tok, _ = pair
    ids = tok.encode("hi there", add_special_tokens=False)
    assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 100]) == tok.decode(ids)


def test_decode_token_keeps_leading_space(pair: tuple[Tokenizer, Any]) -> None:
    tok, _ = pair
    ids = tok.encode("hello world, fine", add_special_tokens=False)
    pieces = [tok.decode_token(i) for i in ids]
    assert "".join(pieces).strip() == "hello world, fine"
    assert any(p.startswith(" ") for p in pieces)
    assert tok.decode_token(tok.eos_token_id) == tok.eos_token
    assert tok.decode_token(tok.encode("好", add_special_tokens=False)[-1]).endswith("\ufffd")


def test_encode_rejects_non_str(pair: tuple[Tokenizer, Any]) -> None:
    tok, _ = pair
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tok.encode_batch(["ok", 3])  # type: ignore[list-item]


# ---------------------------------------------------------------- errors
def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        Tokenizer.from_pretrained(missing)


def test_missing_tokenizer_json(folder: Path, tmp_path: Path) -> None:
    shutil.copy(folder / "tokenizer_config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_malformed_files(name: str, folder: Path, tmp_path: Path) -> None:
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / name).write_text("{not json")
    with pytest.raises(ValueError, match=name):
        Tokenizer.from_pretrained(tmp_path)

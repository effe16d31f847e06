"""Checkpoints with only a slow tokenizer's files (streamer/tokenizer/slow_tokenizer.py): GPT-2 / OPT byte-level BPE
(vocab.json + merges.txt), RoBERTa's framing, BERT and MPNet WordPiece (vocab.txt). Their ids equal transformers'
AutoTokenizer on the same folder (which converts them itself), special tokens included; and a whole checkpoint with
.bin weights and a slow tokenizer (as facebook/opt-125m ships) generates transformers' text."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamer import LLM, SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer

pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "  leading spaces and   runs", "Hello, world! 42 3.14",
         "unicode: café, naïve, 日本語, emoji 🙂", "def f(x):\n    return x + 1\n", ""]


def _hf(folder: Path):
    import transformers as tf
    return tf.AutoTokenizer.from_pretrained(folder)


def bpe_slow(tmp: Path, config: dict) -> Path:
    """A byte-level BPE tokenizer trained here, written as GPT-2's slow files (no tokenizer.json)."""
    from tests.tokenizer_factory import make_bytelevel_tokenizer
    fast = make_bytelevel_tokenizer(tmp / "fast")
    data = json.loads((fast / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for t in data["added_tokens"]:
        vocab[t["content"]] = t["id"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    out = tmp / "slow"
    out.mkdir()
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def wordpiece_slow(tmp: Path, family: str, config: dict) -> Path:
    from tests.encoder_checkpoints import make_wordpiece_tokenizer
    make_wordpiece_tokenizer(tmp / "fast", "bert" if family == "bert" else "roberta")
    vocab = json.loads((tmp / "fast" / "tokenizer.json").read_text())["model"]["vocab"]
    out = tmp / "slow"
    out.mkdir()
    (out / "vocab.txt").write_text("\n".join(sorted(vocab, key=vocab.get)) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _same_ids(folder: Path, pairs: bool = False) -> Tokenizer:
    ours, theirs = Tokenizer.from_pretrained(folder), _hf(folder)
    assert not (folder / "tokenizer.json").exists()
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids)
    if pairs:
        from streamer.engine.pooling import encode_pair
        texts = [t for t in TEXTS if t]  # (transformers reads an empty second text as no pair)
        for a, b in zip(texts, texts[1:]):
            assert encode_pair(ours, a, b) == theirs(a, b)["input_ids"]
    return ours


def test_gpt2_bpe(tmp_path):
    folder = bpe_slow(tmp_path, {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|begin_of_text|>",
                                 "eos_token": "<|end_of_text|>", "unk_token": "<|end_of_text|>"})
    tok = _same_ids(folder)
    assert tok.encode("x<|end_of_text|>y", add_special_tokens=False)[1] == tok.eos_token_id  # (matched whole)


def test_opt_prepends_its_bos(tmp_path):
    # OPT's GPT2Tokenizer: add_bos_token, "</s>" both BOS and EOS (here the trained vocabulary's end token), tokens
    # from special_tokens_map.json
    folder = bpe_slow(tmp_path, {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True,
                                 "add_prefix_space": False})
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
        "unk_token": "<|end_of_text|>"}))
    tok = _same_ids(folder)
    assert tok.encode("hello")[0] == tok.bos_token_id == tok.eos_token_id


def test_roberta_framing(tmp_path):
    folder = bpe_slow(tmp_path, {"tokenizer_class": "RobertaTokenizer", "bos_token": "<|begin_of_text|>",
                                 "cls_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                 "sep_token": "<|end_of_text|>", "unk_token": "<|pad|>", "pad_token": "<|pad|>"})
    _same_ids(folder, pairs=True)


@pytest.mark.parametrize("family, config", [
    ("bert", {"tokenizer_class": "BertTokenizer", "do_lower_case": True}),
    ("bert", {"tokenizer_class": "BertTokenizer", "do_lower_case": False}),
    ("mpnet", {"tokenizer_class": "MPNetTokenizer", "bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>",
               "sep_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>"}),
])
def test_wordpiece(tmp_path, family, config):
    _same_ids(wordpiece_slow(tmp_path, family, config), pairs=True)


def test_a_special_token_missing_from_the_vocabulary(tmp_path):
    folder = wordpiece_slow(tmp_path, "bert", {"tokenizer_class": "BertTokenizer", "cls_token": "[BOS]"})
    with pytest.raises(ValueError, match="'\\[BOS\\]'.*not in its vocabulary"):
        Tokenizer.from_pretrained(folder)


def test_no_tokenizer_files_at_all(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="vocab.json \\+ merges.txt, vocab.txt, a SentencePiece"):
        Tokenizer.from_pretrained(tmp_path)


def test_a_checkpoint_as_opt_125m_ships_it(llama_dir, tmp_path):
    """pytorch_model.bin and vocab.json + merges.txt, nothing else of the tokenizer: the text transformers gives."""
    import torch
    import transformers as tf

    from tests.test_pt_checkpoints import to_bin
    folder = to_bin(llama_dir, tmp_path / "ckpt")
    slow = bpe_slow(tmp_path / "tok", {})  # (the checkpoint's own tokenizer, rewritten slow below)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]})
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", **{k: cfg[k] for k in ("bos_token", "eos_token", "add_bos_token")}}))
    (folder / "tokenizer.json").unlink()
    shutil.rmtree(slow.parent)
    prompt = "The quick brown fox"
    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=10,
                         do_sample=False, pad_token_id=0)
    want = tok.decode(gen[0, ids.shape[1]:])
    with LLM(str(folder), dtype="float32") as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids[0].tolist() and out.outputs[0].text == want

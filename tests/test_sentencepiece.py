"""SentencePiece tokenizer.model files (streamer/tokenizer/sentencepiece_model.py): models trained here with the sentencepiece
library (BPE with byte fallback as Llama's, Unigram with nmt_nfkc as T5's, Gemma's settings, an unknown-piece BPE)
encode to `SentencePieceProcessor.encode`'s ids for any text hypothesis writes and decode back as it does; the
checkpoint classes frame them as transformers' slow tokenizers do; a tiny Llama whose only tokenizer file is
tokenizer.model generates transformers' tokens."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer.tokenizer.sentencepiece_model import CONTROL, USER_DEFINED, SentencePieceModel, build_tokenizer
from streamer.tokenizer.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

SYLLABLES = ["ka", "to", "ri", "mu", "sen", "ber", "ing", "tion", "qu", "ex", "café", "naï", "東", "京", "語", "😀",
             "ß", "Ω", "12", "7"]
# what texts are made of: the corpus' syllables and characters it never saw (byte fallback / unknown pieces),
# whitespace runs, tabs and newlines, full-width and ligature forms nmt_nfkc rewrites, "▁" itself, a user piece
PARTS = SYLLABLES + list("abcdefghxyz ") + ["  ", "   ", "\n", "\t", "Ａ", "ﬁ", "\u3000", "\u00a0", "▁", "é", "<tool>"]

# name -> SentencePieceTrainer options (besides input and model_prefix)
MODELS = {
    # (512: the tiny test checkpoints' vocabulary size)
    "llama": dict(model_type="bpe", vocab_size=512, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, split_digits=True, user_defined_symbols=["<tool>"]),
    "t5": dict(model_type="unigram", vocab_size=250, hard_vocab_limit=False),
    "gemma": dict(model_type="bpe", vocab_size=300, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
                  control_symbols=["<start_of_turn>"], user_defined_symbols=["<tool>", "▁▁"]),
    "unigram_bytes": dict(model_type="unigram", vocab_size=300, byte_fallback=True, hard_vocab_limit=False),
    "bpe_unk": dict(model_type="bpe", vocab_size=200, character_coverage=0.98),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 15)))
                                for _ in range(3000)), encoding="utf-8")
    for name, options in MODELS.items():
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / name), minloglevel=2,
                                       num_threads=1, **options)
    return {name: root / f"{name}.model" for name in MODELS}


texts = st.lists(st.sampled_from(PARTS), max_size=24).map("".join)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_reader_sees_what_sentencepiece_sees(models, name):
    sp = spm.SentencePieceProcessor(model_file=str(models[name]))
    model = SentencePieceModel.read(models[name])
    assert [p.text for p in model.pieces] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert [p.score for p in model.pieces] == pytest.approx([sp.get_score(i) for i in range(sp.get_piece_size())])
    assert [p.kind == CONTROL for p in model.pieces] == [sp.is_control(i) for i in range(sp.get_piece_size())]
    assert model.unk_id == sp.unk_id() and model.byte_fallback == (name in ("llama", "gemma", "unigram_bytes"))
    assert model.add_dummy_prefix == (name != "gemma")
    assert model.remove_extra_whitespaces == (name in ("t5", "unigram_bytes", "bpe_unk"))
    assert bool(model.precompiled_charsmap) == (name in ("t5", "unigram_bytes", "bpe_unk"))  # nmt_nfkc's map
    if name == "gemma":
        assert [p.text for p in model.pieces if p.kind == USER_DEFINED] == ["<tool>", "▁▁"]


@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_encodes_and_decodes_as_sentencepiece(models, name, text):
    sp = spm.SentencePieceProcessor(model_file=str(models[name]))
    tok = _built(models[name])
    ids, want = tok.encode(text, add_special_tokens=False).ids, sp.encode(text)
    if ids != want and MODELS[name]["model_type"] == "unigram":
        # Unigram ties ("ririri": ri + riri or riri + ri score the same): the two Viterbi searches may pick
        # either best path (transformers' fast T5 tokenizer does as this one does). Both must be best paths.
        score = lambda pieces: sum(sp.get_score(i) for i in pieces)  # noqa: E731
        assert score(ids) == pytest.approx(score(want), abs=1e-4) and sp.decode(ids) == sp.decode(want), text
        return
    assert ids == want, (text, sp.encode(text, out_type=str), tok.encode(text).tokens)
    if sp.unk_id() not in ids:  # (sentencepiece decodes <unk> as " ⁇ ", transformers as "<unk>")
        assert tok.decode(ids) == sp.decode(ids)


_BUILT: dict[Path, object] = {}


def _built(path: Path):
    if path not in _BUILT:
        _BUILT[path] = build_tokenizer(SentencePieceModel.read(path))
    return _BUILT[path]


def test_not_a_model_file(tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\x0a\xff\xff\xff")  # field 1, a length past the end
    with pytest.raises(ValueError, match="not a SentencePiece model file"):
        SentencePieceModel.read(bad)


def _folder(tmp: Path, model: Path, filename: str, config: dict, **files: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, tmp / filename)
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (tmp / f"{name}.json").write_text(json.dumps(content))
    return tmp


LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def test_llama_framing(models, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=str(models["llama"]))
    text = "kato café 東京 x<tool>y"
    plain = _folder(tmp_path / "a", models["llama"], "tokenizer.model", LLAMA_CONFIG)
    tok = Tokenizer.from_pretrained(plain)
    assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)  # LlamaTokenizer adds BOS unless told not to
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id() and tok.unk_token_id == sp.unk_id()
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    # the special tokens are matched whole; legacy (the default): each stretch after one gets the dummy prefix
    assert tok.encode("ka</s>to", add_special_tokens=False) == sp.encode("ka") + [sp.eos_id()] + sp.encode("to")
    both = _folder(tmp_path / "b", models["llama"], "tokenizer.model",
                   {**LLAMA_CONFIG, "add_bos_token": False, "add_eos_token": True, "legacy": False})
    tok = Tokenizer.from_pretrained(both)
    assert tok.encode(text) == sp.encode(text) + [sp.eos_id()]
    ids = tok.encode("ka</s>to", add_special_tokens=False)  # not legacy: only the text's start gets the prefix
    assert ids[:len(sp.encode("ka")) + 1] == sp.encode("ka") + [sp.eos_id()]
    assert "".join(sp.id_to_piece(i) for i in ids[len(sp.encode("ka")) + 1:]) == "to"


def test_tokens_added_after_the_vocabulary(models, tmp_path):
    """added_tokens.json (older slow tokenizers) and added_tokens_decoder put tokens at the ids they name."""
    size = spm.SentencePieceProcessor(model_file=str(models["llama"])).get_piece_size()
    added = {"<|im_start|>": size, "<|im_end|>": size + 1}
    folder = _folder(tmp_path / "a", models["llama"], "tokenizer.model",
                     {**LLAMA_CONFIG, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]},
                     added_tokens=added)
    tok = Tokenizer.from_pretrained(folder)
    assert tok.encode("<|im_start|>ka<|im_end|>", add_special_tokens=False)[::2] == [size, size + 1]
    assert {size, size + 1} <= tok.all_special_ids
    gap = _folder(tmp_path / "b", models["llama"], "tokenizer.model",
                  {**LLAMA_CONFIG, "added_tokens_decoder": {str(size + 5): {"content": "<x>", "special": True}}})
    with pytest.raises(ValueError, match=f"'<x>' has id {size} .*not the {size + 5}"):
        Tokenizer.from_pretrained(gap)


def test_t5_framing(models, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=str(models["t5"]))
    folder = _folder(tmp_path, models["t5"], "spiece.model",
                     {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "unk_token": "<unk>", "extra_ids": 4})
    tok = Tokenizer.from_pretrained(folder)
    text = "  Kato  ＡＢ café  "
    assert tok.encode(text) == sp.encode(text) + [sp.eos_id()]
    size = sp.get_piece_size()
    assert [tok.encode(f"<extra_id_{i}>", add_special_tokens=False) for i in range(4)] == \
        [[size + 3], [size + 2], [size + 1], [size]]


def test_t5_framing_as_transformers_frames_it(models, tmp_path):
    tf = pytest.importorskip("transformers")
    folder = _folder(tmp_path, models["t5"], "spiece.model",
                     {"tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "unk_token": "<unk>",
                      "pad_token": "<pad>", "extra_ids": 4})
    theirs, ours = tf.AutoTokenizer.from_pretrained(folder), Tokenizer.from_pretrained(folder)
    for text in ["kato sen", "ri mu", "<extra_id_1> kato"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text


def test_classes_with_a_framing_of_their_own_are_refused(models, tmp_path):
    folder = _folder(tmp_path, models["t5"], "tokenizer.model", {"tokenizer_class": "XLMRobertaTokenizer"})
    with pytest.raises(ValueError, match="'XLMRobertaTokenizer' is not supported"):
        Tokenizer.from_pretrained(folder)


def test_a_llama_checkpoint_with_only_tokenizer_model(models, llama_dir, tmp_path):
    """The tiny Llama with its tokenizer.json replaced by a tokenizer.model: prompt ids are SentencePiece's (after
    BOS) and the continuation is transformers' greedy one from those ids, decoded as SentencePiece decodes it."""
    import torch
    import transformers as tf

    from streamer import LLM, SamplingParams
    folder = tmp_path / "ckpt"
    shutil.copytree(llama_dir, folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    _folder(folder, models["llama"], "tokenizer.model", LLAMA_CONFIG)
    sp = spm.SentencePieceProcessor(model_file=str(models["llama"]))
    prompt = "kato sentionqu 東京"
    ids = torch.tensor([[sp.bos_id()] + sp.encode(prompt)])
    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    with LLM(str(folder), dtype="float32") as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids[0].tolist()
    assert list(out.outputs[0].token_ids) == want
    assert sp.get_piece_size() == model.config.vocab_size
    prompt_ids = sp.encode(prompt)  # (the continuation's text: the whole text's past the prompt's, space and all)
    assert out.outputs[0].text == sp.decode(prompt_ids + [t for t in want if not sp.is_control(t)])[len(prompt):]

"""GGUF checkpoints: tiny random Hugging Face checkpoints written as GGUF the way llama.cpp's convert_hf_to_gguf.py
writes them (its tensor names from the `gguf` package, Llama's q/k rows permuted, Gemma's norms + 1, Llama 3's rope
factors as a tensor, the vocabulary as `tokenizer.ggml.*`), then loaded by streamer and checked against transformers'
own GGUF loader (`from_pretrained(..., gguf_file=...)`) or, where that loader drops something, the HF original."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from streamer import LLM, SamplingParams  # noqa: E402
from streamer.models import gguf as sgguf  # noqa: E402
from tests.parity import greedy, random_prompts  # noqa: E402

Q = gguf.GGMLQuantizationType
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
         "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
TEXT = "The quick brown fox, 你好 世界! def f(x):\n    return x * 42  # café 😀"


# ----------------------------------------------------------------------------------------- writing GGUF files
def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_vocab(w: Any, hf_dir: Path, model: str, pre: str) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    if model == "gpt2":  # BpeVocab: the byte-level merges as given
        w.add_tokenizer_pre(pre)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    else:  # as SentencePieceVocab: scores in merge order (later pieces lower), <unk> UNKNOWN, <0xNN> BYTE
        types = [gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.UNKNOWN if t == "<unk>" else k
                 for t, k in zip(tokens, types)]
        w.add_token_scores([0.0 if k != gguf.TokenType.NORMAL else -float(i) for i, k in enumerate(types)])
        w.add_unk_token_id(vocab["<unk>"])
        w.add_add_space_prefix(True)
    w.add_token_types(types)
    name = lambda v: v if isinstance(v, str) else (v or {}).get("content")  # noqa: E731
    w.add_bos_token_id(vocab[name(tcfg["bos_token"])])
    w.add_eos_token_id(vocab[name(tcfg["eos_token"])])
    if name(tcfg.get("pad_token")) in vocab:
        w.add_pad_token_id(vocab[name(tcfg["pad_token"])])
    w.add_add_bos_token(bool(tcfg.get("add_bos_token")))
    w.add_chat_template(tcfg["chat_template"])


def write_gguf(hf_dir: Path, out: Path, family: str, qtype: Any = Q.F32, tokenizer: str = "gpt2",
               pre: str = "llama-bpe", encode: Any = None) -> Path:
    """hf_dir as llama.cpp's converter writes it: 2-D weights as `qtype` (1-D ones F32), tensor names from gguf's
    own name map, Llama's q/k permuted, Gemma's norms + 1, Llama 3's rope factors as `rope_freqs`. encode(name,
    weights): a 2-D tensor's (raw bytes, type) in place of `qtype`'s."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCH[family]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # (Gemma 3's per layer type: the file holds the global layers' base)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("sliding_window") and family in ("gemma3", "phi3"):
        w.add_sliding_window(cfg["sliding_window"])
    _write_vocab(w, hf_dir, tokenizer, pre)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    for hf_name, t in load_file(str(hf_dir / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if family == "llama" and "q_proj" in hf_name:
            t = _permute(t, heads)
        if family == "llama" and "k_proj" in hf_name:
            t = _permute(t, kv_heads)
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            t = t + 1
        data = t.float().numpy()
        if data.ndim > 1 and encode is not None:
            raw, raw_type = encode(name, data)
            w.add_tensor(name, raw, raw_dtype=raw_type)
        elif data.ndim > 1 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    if family == "llama" and (cfg.get("rope_scaling") or rope).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_minimal_gguf(out: Path, arch: str, qtype: Any = Q.F32) -> Path:
    """A GGUF holding only its architecture, a block count and one [32, 256] tensor of type `qtype` (zeros)."""
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(1)
    size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((32, 256), np.float32) if qtype == Q.F32 else np.zeros((32, 256 // size[0] * size[1]), np.uint8)
    w.add_tensor("token_embd.weight", data, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# ----------------------------------------------------------------------------------------- oracles
def _generate(model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """A transformers model's greedy tokens, EOS banned (as tests.parity.greedy bans it for the engine)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def hf_gguf_model(path: Path, quantized: bool) -> Any:
    """transformers' own GGUF loader's model (fp32). Quantized: its 2-D weights rounded to float16, as streamer's
    conversion stores them (its 1-D ones stay F32 in both)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    if quantized:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim > 1:
                    p.copy_(p.half().float())
    return model


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Each test converts into its own cache."""
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


PROMPTS = random_prompts(6, seed=7, max_len=40)
MAX_NEW = 8

# (checkpoint family, its overrides, HF tokenizer flavour) by name, built once per session by conftest's make_ckpt
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("llama", {"rope_scaling": None}, "bytelevel"),  # (transformers' GGUF loader drops Llama 3's rope)
    "llama3-rope": ("llama", {}, "bytelevel"),
    "mistral-sp": ("mistral", {}, "sentencepiece"),
    "qwen2": ("qwen2", {}, "bytelevel"),
    # head_dim 128 (not hidden / heads): transformers' GGUF loader takes Qwen3Config's default, not key_length
    "qwen3": ("qwen3", {"head_dim": 128}, "bytelevel"),
    # Gemma 3 as llama.cpp runs it: query_pre_attn_scalar = head_dim, every 6th layer global, no final soft-cap
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 32, "final_logit_softcapping": None, "layer_types": None,
                          "num_hidden_layers": 6}, "bytelevel"),
    "phi3": ("phi3", {}, "bytelevel"),
}


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    def get(name: str) -> Path:
        family, overrides, tokenizer = CHECKPOINTS[name]
        return make_ckpt(f"gguf-{name}", family=family, tokenizer=tokenizer, **overrides)
    return get


def _gguf(ckpt: Any, tmp_path: Path, name: str, qtype: Any = Q.F32) -> Path:
    family, _, tokenizer = CHECKPOINTS[name]
    family = "llama" if family == "mistral" else family  # (llama.cpp writes Mistral as llama)
    return write_gguf(ckpt(name), tmp_path / f"{name}-{qtype.name}.gguf", family, qtype,
                      tokenizer="gpt2" if tokenizer == "bytelevel" else "llama",
                      pre="qwen2" if family.startswith("qwen") else "llama-bpe")


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name, qtype", [("llama", "F32"), ("llama", "Q8_0"), ("mistral-sp", "Q4_0"),
                                         ("qwen2", "F32"), ("qwen2", "BF16"), ("qwen3", "Q8_0")])
def test_greedy_matches_transformers_gguf(ckpt, tmp_path, name, qtype):
    """streamer's greedy tokens on a GGUF equal transformers' on the same file (fp32; quantized weights rounded to
    float16 on both sides, BF16 ones kept bfloat16 by the conversion)."""
    path = _gguf(ckpt, tmp_path, name, Q[qtype])
    want = _generate(hf_gguf_model(path, quantized=qtype not in ("F32", "BF16")), PROMPTS, MAX_NEW)
    assert len({tuple(r) for r in want}) == len(PROMPTS), "degenerate reference"
    llm = LLM(str(path), dtype="float32")
    assert greedy(llm, PROMPTS, MAX_NEW) == want


def _random_k_blocks(rows: int, cols: int, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant blocks of random weights (the gguf package dequantizes K-quants but cannot write them):
    Q4_K blocks whose every sub-block's minimum sits 7.5 steps down (values centred on zero), Q6_K blocks with small
    positive scales. Bytes [rows, cols / 256 * block size], as the writer takes quantized data."""
    half = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    n = rows * cols // 256
    if qtype == Q.Q4_K:  # d, dmin (fp16), 12 bytes of packed 6-bit scales and mins, 128 bytes of 4-bit values
        b = rng.integers(0, 256, (n, 144), dtype=np.uint8)
        b[:, 0:2], b[:, 2:4], b[:, 4:16] = half(1e-3), half(7.5e-3), 0x11  # (scale = min: 17 or 1)
    else:  # Q6_K: 128 + 64 bytes of 6-bit values, 16 int8 scales, d (fp16)
        b = rng.integers(0, 256, (n, 210), dtype=np.uint8)
        b[:, 192:208] = rng.integers(1, 9, (n, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = half(5e-4)
    return b.reshape(rows, -1)


def test_k_quants_match_transformers_gguf(make_ckpt, tmp_path):
    """A Q4_K_M-style file (Q4_K weights; the output, attn_v and ffn_down ones Q6_K), the most common GGUF kind:
    streamer's greedy tokens equal transformers' on it (both dequantize with the gguf package's reference)."""
    hf_dir = make_ckpt("gguf-llama-256", family="llama", tokenizer="bytelevel", rope_scaling=None, hidden_size=256,
                       intermediate_size=512)
    rng = np.random.default_rng(0)
    types: dict[str, Any] = {}

    def encode(name: str, data: np.ndarray) -> tuple[np.ndarray, Any]:
        qtype = Q.Q6_K if any(k in name for k in ("output.", "attn_v", "ffn_down")) else Q.Q4_K
        types[name] = qtype
        return _random_k_blocks(*data.shape, qtype, rng), qtype

    path = write_gguf(hf_dir, tmp_path / "k.gguf", "llama", encode=encode)
    assert set(types.values()) == {Q.Q4_K, Q.Q6_K} and types["output.weight"] == Q.Q6_K
    want = _generate(hf_gguf_model(path, quantized=True), PROMPTS, MAX_NEW)
    assert len({tuple(r) for r in want}) == len(PROMPTS), "degenerate reference"
    assert greedy(LLM(str(path), dtype="float32"), PROMPTS, MAX_NEW) == want


@pytest.mark.parametrize("name", ["llama3-rope", "gemma3", "phi3"])
def test_matches_hf_original(ckpt, tmp_path, name):
    """Where transformers' GGUF loader loses something (Llama 3's rope factors, Gemma 3's query scale, Phi-3's
    sliding window), the oracle is the HF checkpoint the GGUF was written from: the same prompt logprobs and greedy
    tokens in fp32."""
    import transformers

    from tests.parity import assert_logprobs_match
    hf_dir = ckpt(name)
    path = _gguf(ckpt, tmp_path, name)
    llm = LLM(str(path), dtype="float32")
    assert_logprobs_match(llm, hf_dir, PROMPTS[:3])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert greedy(llm, PROMPTS, MAX_NEW) == _generate(model, PROMPTS, MAX_NEW)


def test_llama3_rope_recovered(ckpt, tmp_path):
    """Llama 3's rope scaling, which the GGUF keeps only as a `rope_freqs` tensor, comes back as the HF config's;
    and it matters: transformers' GGUF loader, which drops it, picks other tokens than the original."""
    hf_dir = ckpt("llama3-rope")
    path = _gguf(ckpt, tmp_path, "llama3-rope")
    config = json.loads((sgguf.hf_folder(path) / "config.json").read_text())
    original = json.loads((hf_dir / "config.json").read_text())
    want = original.get("rope_scaling") or original["rope_parameters"]
    assert {k: config["rope_scaling"][k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings")} == \
        {k: want[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                              "original_max_position_embeddings")}
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert _generate(hf_gguf_model(path, quantized=False), PROMPTS, MAX_NEW) != _generate(model, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("name, undo", [("llama", "permute_qk"), ("gemma3", "norm_offset")])
def test_undoing_llama_cpp_changes_matters(ckpt, tmp_path, monkeypatch, name, undo):
    """Converting without undoing llama.cpp's q/k permutation (Llama) or its 1 + w norms (Gemma) changes the tokens,
    so the parity tests above check that each is undone."""
    import dataclasses
    path = _gguf(ckpt, tmp_path, name)
    want = greedy(LLM(str(path), dtype="float32"), PROMPTS, MAX_NEW)
    arch = "gemma3" if name == "gemma3" else "llama"
    monkeypatch.setitem(sgguf.ARCHITECTURES, arch, dataclasses.replace(sgguf.ARCHITECTURES[arch], **{undo: False}))
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(tmp_path / "other-cache"))
    assert greedy(LLM(str(path), dtype="float32"), PROMPTS, MAX_NEW) != want


@pytest.mark.parametrize("name, pre", [("llama", "llama-bpe"), ("qwen2", "qwen2"), ("mistral-sp", None)])
def test_tokenizer_matches_transformers_gguf(ckpt, tmp_path, name, pre):
    """The tokenizer built from `tokenizer.ggml.*` (byte-level BPE with Llama 3's or Qwen2's split, or
    SentencePiece BPE with byte fallback and merges derived from the scores) encodes like transformers' GGUF
    tokenizer and like the original tokenizer.json, decodes back, and carries the special tokens and the chat
    template."""
    import transformers

    from streamer.tokenizer.tokenizer import Tokenizer
    path = _gguf(ckpt, tmp_path, name)
    ours = Tokenizer.from_pretrained(sgguf.hf_folder(path))
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    original = Tokenizer.from_pretrained(ckpt(name))
    for text in (TEXT, " leading space", "line\n\n  two", "<|begin_of_text|>x</s>"):
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"] == original.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    assert ours.chat_template == original.chat_template


def test_converted_folder_is_reused(ckpt, tmp_path, cache_dir, monkeypatch):
    """The second load reuses the converted folder (nothing rewritten); a changed file converts again; a conversion
    that fails leaves no folder behind, complete or temporary."""
    path = _gguf(ckpt, tmp_path, "qwen2", Q.Q8_0)
    folder = sgguf.hf_folder(path)
    assert folder.parent == cache_dir
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(stamps)

    def fail(*args: Any) -> None:
        raise AssertionError("converted again")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sgguf, "convert", fail)
        assert sgguf.hf_folder(path) == folder
        assert sgguf.hf_folder(tmp_path) == folder  # (a folder holding the one GGUF)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps

    path.touch()  # (a new mtime: another file as far as the cache knows)
    monkeypatch.setattr(sgguf, "_write_weights", fail)
    with pytest.raises(AssertionError, match="converted again"):
        sgguf.hf_folder(path)
    assert [p.name for p in cache_dir.iterdir()] == [folder.name]


def test_split_file(ckpt, tmp_path):
    """A split GGUF (gguf-split's -0000i-of-0000N shards) loads from its first shard into the same weights as the
    whole file; a later shard alone is refused."""
    whole = _gguf(ckpt, tmp_path, "qwen2", Q.Q8_0)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    family, _, _ = CHECKPOINTS["qwen2"]
    # write_gguf's writer, split every 8 tensors
    orig = gguf.GGUFWriter.__init__

    def split_writer(self, path, arch, **kw):
        orig(self, path, arch, split_max_tensors=8, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "__init__", split_writer)
        write_gguf(ckpt("qwen2"), split_dir / "m.gguf", family, Q.Q8_0, pre="qwen2")
    shards = sorted(p.name for p in split_dir.iterdir())
    assert len(shards) > 1 and shards[0].endswith("-00001-of-" + f"{len(shards):05d}.gguf"), shards
    a = load_file(str(sgguf.hf_folder(whole) / "model.safetensors"))
    b = load_file(str(sgguf.hf_folder(split_dir / shards[0]) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sgguf.hf_folder(split_dir) == sgguf.hf_folder(split_dir / shards[0])
    with pytest.raises(ValueError, match="first one"):
        sgguf.hf_folder(split_dir / shards[1])


def test_unsupported_architecture_and_type(tmp_path):
    with pytest.raises(ValueError, match="architecture 'bloom' is not supported"):
        sgguf.hf_folder(write_minimal_gguf(tmp_path / "bloom.gguf", "bloom"))
    with pytest.raises(ValueError, match="Q8_K cannot be dequantized"):
        sgguf.hf_folder(write_minimal_gguf(tmp_path / "q8k.gguf", "llama", Q.Q8_K))
    for name, content in (("empty.gguf", b""), ("text.gguf", b"not a gguf file at all")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"{name}: not a readable GGUF file"):
            sgguf.hf_folder(tmp_path / name)
    assert not list(sgguf.cache_root().glob(".tmp-*")), "a failed conversion left its temporary folder"


def test_live_llm_generate(ckpt, tmp_path, caplog):
    """LLM(path to a quantized GGUF) with the default dtype generates text from a text prompt, and says that the
    weights were dequantized."""
    path = _gguf(ckpt, tmp_path, "mistral-sp", Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="streamer"):
        llm = LLM(str(path))
    assert "dequantized Q4_0 -> float16: weights are not kept quantized" in caplog.text
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id  # (add_bos_token carried over)


def test_gguf_draft_model(ckpt, tmp_path):
    """`speculative_model` takes a GGUF file too (converted like a model's): a Q8_0 copy of a GGUF target drafts
    for it. Its drafts are the target's own argmax up to quantization, so most are accepted; the output stays the
    target's plain greedy output."""
    target = _gguf(ckpt, tmp_path, "llama", Q.F32)
    draft = _gguf(ckpt, tmp_path, "llama", Q.Q8_0)
    want = greedy(LLM(str(target), dtype="float32"), PROMPTS, MAX_NEW)
    llm = LLM(str(target), dtype="float32", speculative_model=str(draft), num_speculative_tokens=3)
    assert greedy(llm, PROMPTS, MAX_NEW) == want
    e = llm.engine
    assert type(llm.engine.runner.drafter).__name__ == "DraftModel"
    assert e.num_accepted_tokens > 0.8 * e.num_draft_tokens > 0
    with pytest.raises(FileNotFoundError, match="a Hugging Face checkpoint folder or a GGUF file"):
        LLM(str(target), dtype="float32", speculative_model=str(tmp_path / "nothing.gguf"), num_speculative_tokens=3)

"""GGUF checkpoints (llama.cpp's format), converted once into a Hugging Face folder that the engine loads unchanged.

`hf_folder(path)` reads a .gguf file (or a folder holding one, or the first shard of a split file) with the `gguf`
package (llama.cpp's own reader), and writes config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and safetensors under ~/.cache/streamer/gguf/<hash of path, size, mtime>/ (a temporary folder
renamed into place, so a crash never leaves half a folder; a complete one is reused). Quantized tensors are
dequantized (to float16, or bfloat16 when the file's float weights are bfloat16): the engine runs them unquantized.
What llama.cpp's converter changed is undone on the way: Llama's q/k rows permuted for its rotary layout, Gemma's
norms stored as 1 + w, Llama 3's rope scaling stored as a tensor of frequency factors, Phi-3's LongRoPE factors too.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

logger = logging.getLogger("streamer")

CONVERTER_VERSION = 1  # part of the cache key: bump when the converted folder's contents change
_SHARD_BYTES = 2 << 30  # safetensors shard size of the converted folder
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


# --------------------------------------------------------------------------------------------- finding the files
def gguf_files(path: Path) -> Optional[list[Path]]:
    """The GGUF file(s) `path` names (all shards of a split file, in order), or None when it names no GGUF: a
    .gguf file, or a folder without config.json that holds exactly one GGUF (one file or one split set)."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _shards(path)
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    firsts = [p for p in found if (m := _SPLIT.search(p.name)) is None or m.group(1) == "00001"]
    if not firsts:
        return None
    if len(firsts) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(p.name for p in firsts)}): name one")
    return _shards(firsts[0])


def _shards(first: Path) -> list[Path]:
    m = _SPLIT.search(first.name)
    if m is None:
        return [first]
    if m.group(1) != "00001":
        raise ValueError(f"{first} is shard {int(m.group(1))} of a split GGUF: give the first one (-00001-of-...)")
    count = int(m.group(2))
    files = [first.with_name(_SPLIT.sub(f"-{i:05d}-of-{count:05d}.gguf", first.name)) for i in range(1, count + 1)]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"split GGUF {first.name}: missing shard(s) {', '.join(missing)}")
    return files


def cache_root() -> Path:
    """Where converted folders live ($STREAMER_CACHE_DIR/gguf, default ~/.cache/streamer/gguf)."""
    base = os.environ.get("STREAMER_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "streamer"
    return Path(base).expanduser() / "gguf"


def _cache_key(files: list[Path]) -> str:
    h = hashlib.sha256(f"v{CONVERTER_VERSION}".encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


def hf_folder(path: Path) -> Path:
    """`path` itself when it names no GGUF; else the (cached) Hugging Face folder converted from it."""
    files = gguf_files(path)
    if files is None:
        return path
    root = cache_root()
    target = root / _cache_key(files)
    if (target / "config.json").is_file():
        logger.info("GGUF %s: using the converted folder %s", files[0].name, target)
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        convert(files, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same conversion first: keep its folder
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF %s converted to %s", files[0].name, target)
    return target


# --------------------------------------------------------------------------------------------- architectures
# blk.N.<gguf name> -> model.layers.N.<HF name>, as llama.cpp's converter names Llama's parts
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA2_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # Phi-3 keeps them fused


@dataclass(frozen=True)
class _Arch:
    architecture: str  # config.json's architectures[0]
    model_type: str
    names: dict[str, str] = field(default_factory=dict)  # per-layer names that differ from _LAYER_NAMES
    permute_qk: bool = False  # llama.cpp permuted q/k rows for its interleaved rotary (Llama-family only)
    norm_offset: bool = False  # norms stored as 1 + w (Gemma, whose HF norms scale by 1 + w)
    config: Optional[Callable[["_Meta", dict[str, Any]], dict[str, Any]]] = None  # the family's own config keys


# --------------------------------------------------------------------------------------------- metadata
class _Meta:
    """The GGUF's key/value metadata, read with the `{arch}.` prefix filled in."""

    def __init__(self, values: dict[str, Any], tensors: dict[str, Any]) -> None:
        self.values = values
        self.tensors = tensors  # name -> gguf ReaderTensor (all shards)
        self.arch: str = values["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key.replace("{arch}", self.arch), default)

    def tensor(self, name: str) -> Optional[np.ndarray]:
        """A small configuration tensor (F32 in llama.cpp's files) as numpy, or None."""
        t = self.tensors.get(name)
        return None if t is None else _dequantize(t)


def _read_values(reader: Any) -> dict[str, Any]:
    from gguf import GGUFValueType
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = f.contents()
        if f.types == [GGUFValueType.FLOAT32]:  # (its shortest float32 spelling: 1e-06, not 9.99e-07)
            value = float(str(np.float32(value)))
        out[key] = value
    return out


def _gemma_query_scalar(meta: _Meta, c: dict[str, Any], big_layers: int) -> float:
    # llama.cpp scales Gemma's queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the 27B models
    # (recognised by their layer count), as their HF configs' query_pre_attn_scalar say
    big = c["num_hidden_layers"] == big_layers
    return c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"]


def _gemma_config(meta: _Meta, c: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_activation": "gelu_pytorch_tanh"}


def _gemma2_config(meta: _Meta, c: dict[str, Any]) -> dict[str, Any]:
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(meta, c, 46),
            "attn_logit_softcapping": meta.get("{arch}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get("{arch}.final_logit_softcapping"),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(c["num_hidden_layers"])]}


def _gemma3_config(meta: _Meta, c: dict[str, Any]) -> dict[str, Any]:
    n = c["num_hidden_layers"]
    pattern = meta.get("{arch}.attention.sliding_window_pattern", 6)  # llama.cpp's default: every 6th layer global
    sliding = [bool(x) for x in pattern] if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(n)]
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(meta, c, 62),
            "rope_local_base_freq": float(meta.get("{arch}.rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": meta.get("{arch}.final_logit_softcapping"),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _phi3_config(meta: _Meta, c: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is not None and short is not None:  # LongRoPE: its factors are tensors in the GGUF
        out["original_max_position_embeddings"] = meta.get("{arch}.rope.scaling.original_context_length")
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
    return out


def _qwen_config(meta: _Meta, c: dict[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False}


ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", config=_qwen_config),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", config=_qwen_config),
    "gemma": _Arch("GemmaForCausalLM", "gemma", norm_offset=True, config=_gemma_config),
    "gemma2": _Arch("Gemma2ForCausalLM", "gemma2", _GEMMA2_NAMES, norm_offset=True, config=_gemma2_config),
    "gemma3": _Arch("Gemma3ForCausalLM", "gemma3_text", _GEMMA2_NAMES, norm_offset=True, config=_gemma3_config),
    "phi3": _Arch("Phi3ForCausalLM", "phi3", _PHI3_NAMES, config=_phi3_config),
}
# Tensors that are configuration, not weights (read into config.json)
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _hf_config(meta: _Meta, spec: _Arch, dtype: torch.dtype) -> dict[str, Any]:
    heads = meta.get("{arch}.attention.head_count")
    hidden = meta.get("{arch}.embedding_length")
    kv_heads = meta.get("{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list) or isinstance(heads, list):
        raise ValueError(f"GGUF {meta.arch}: per-layer head counts are not supported")
    head_dim = meta.get("{arch}.attention.key_length") or hidden // heads
    c: dict[str, Any] = {
        "architectures": [spec.architecture], "model_type": spec.model_type,
        "hidden_size": hidden, "intermediate_size": meta.get("{arch}.feed_forward_length"),
        "num_hidden_layers": meta.get("{arch}.block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": meta.get("{arch}.context_length", 4096),
        "rms_norm_eps": meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(meta.get("{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(meta.tensors["token_embd.weight"].shape[-1]),  # (GGUF shapes run innermost first)
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if (window := meta.get("{arch}.attention.sliding_window")) is not None:
        c["sliding_window"] = window
    rotary = meta.get("{arch}.rope.dimension_count")
    if rotary and rotary != head_dim:
        c["partial_rotary_factor"] = rotary / head_dim
    if (scaling := _rope_scaling(meta, c, rotary or head_dim)) is not None:
        c["rope_scaling"] = scaling
    if spec.config is not None:
        c.update(spec.config(meta, c))
    return c


def _rope_scaling(meta: _Meta, c: dict[str, Any], rotary_dim: int) -> Optional[dict[str, Any]]:
    kind = meta.get("{arch}.rope.scaling.type")
    factor = meta.get("{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings":
               meta.get("{arch}.rope.scaling.original_context_length", c["max_position_embeddings"])}
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := meta.get(f"{{arch}}.rope.scaling.{key}")) is not None:
                out[hf_key] = float(value)
        return out
    if kind not in (None, "none", "linear", "yarn"):
        raise ValueError(f"GGUF {meta.arch}: rope scaling {kind!r} is not supported")
    freqs = meta.tensor("rope_freqs.weight")
    return None if freqs is None else _llama3_scaling(freqs, c["rope_theta"], rotary_dim)


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, length: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3's rope scaling (as transformers')."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (length / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < length / high, 1.0, np.where(wavelen > length / low, factor, mid))


def _llama3_scaling(freqs: np.ndarray, theta: float, dim: int) -> Optional[dict[str, Any]]:
    """Llama 3's rope_scaling, recovered from its `rope_freqs` tensor. The smooth part of the curve fixes two
    combinations of the original length and the two frequency factors, so low_freq_factor is taken as 1 (Llama 3's)
    and the others fitted; with fewer than two points there, Llama 3's own values must fit."""
    freqs = freqs.astype(np.float64)
    factor = float(freqs.max())
    if factor <= 1.0:
        return None
    low, high, length = 1.0, 4.0, 8192.0
    x = 1 / (2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # 1 / wavelength
    mid = (freqs > 1 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if mid.sum() >= 2:  # smooth = a x - b, with a = length / (high - low) and b = low / (high - low)
        smooth = (1 / freqs[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(x[mid], smooth, 1) * (1, -1)
        if b > 0:
            high, length = 1 + 1 / b, a / b
    if not np.allclose(_llama3_factors(theta, dim, factor, low, high, length), freqs, rtol=1e-3, atol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not follow Llama 3's rope scaling; not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": round(high, 4),
            "original_max_position_embeddings": int(round(length))}


# --------------------------------------------------------------------------------------------- weights
def _dequantize(t: Any) -> np.ndarray:
    """A tensor as numpy: F16 / BF16 / F32 as stored (BF16 as its uint16 bits), others dequantized to float32."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    if t.tensor_type == Q.F16:
        return t.data.view(np.float16)
    if t.tensor_type == Q.BF16:
        return t.data.view(np.uint16)
    return dequantize(t.data, t.tensor_type)


def _to_torch(t: Any, float_dtype: torch.dtype) -> torch.Tensor:
    from gguf import GGMLQuantizationType as Q
    data = _dequantize(t)
    if t.tensor_type == Q.BF16:
        return torch.from_numpy(data.copy().view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(np.array(data))  # (a copy: the file's memory map is read-only)
    if t.tensor_type in (Q.F32, Q.F16):
        return out
    if float_dtype == torch.float16 and out.abs().max() > torch.finfo(torch.float16).max:
        return out  # (would overflow float16: kept float32)
    return out.to(float_dtype)


def _check_dequantizable(types: set[Any]) -> None:
    """Fail before writing anything on a type the `gguf` package cannot dequantize (a block of zeros tells)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
    for qtype in types - {Q.F32, Q.F16, Q.BF16}:
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except (NotImplementedError, KeyError) as e:
            raise ValueError(f"GGUF tensor type {qtype.name} cannot be dequantized by the gguf package "
                             f"(gguf {_gguf_version()}): not supported") from e


def _gguf_version() -> str:
    from importlib.metadata import version
    return version("gguf")


def _float_dtype(types: set[Any]) -> torch.dtype:
    """The dtype of the converted weights: the file's float type; quantized ones become float16 (bfloat16 beside
    bfloat16 weights)."""
    from gguf import GGMLQuantizationType as Q
    if Q.BF16 in types:
        return torch.bfloat16
    if types - {Q.F32}:
        return torch.float16
    return torch.float32


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head: the rotary pairs interleaved instead of in two halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str, spec: _Arch) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    part = m and (spec.names.get(m.group(2)) or _LAYER_NAMES.get(m.group(2)))
    if not part:
        raise ValueError(f"GGUF {spec.model_type}: unknown tensor {name!r}")
    return f"model.layers.{m.group(1)}.{part}.{kind}"


def _hf_tensor(t: Any, spec: _Arch, c: dict[str, Any], dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    name = _hf_name(t.name, spec)
    w = _to_torch(t, dtype)
    if spec.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
        w = _unpermute(w, c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"])
    if spec.norm_offset and name.endswith("norm.weight"):
        w = (w.float() - 1).to(w.dtype)
    return name, w.contiguous()


def _write_weights(meta: _Meta, spec: _Arch, c: dict[str, Any], dtype: torch.dtype, out: Path) -> None:
    from safetensors.torch import save_file
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for t in meta.tensors.values():
        if t.name in _CONFIG_TENSORS:
            continue
        name, w = _hf_tensor(t, spec, c, dtype)
        if size and size + w.nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --------------------------------------------------------------------------------------------- tokenizer
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's names; others: GPT-2's)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3"}  # llama.cpp takes a whole word in the vocab as is
_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2  # tokenizer.ggml.token_type values


def _bpe_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into two tokens, best merged score first
    (ties: longer left then longer right piece, then by ids), as transformers' `generate_merges` orders them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges.extend((left, right, score) for left, right in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level_tokenizer(meta: _Meta, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in _IGNORE_MERGES))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        if pre not in ("default", "gpt-2", "gpt2"):
            logger.warning("GGUF tokenizer pre-tokenizer %r unknown: splitting text as GPT-2 does", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_tokenizer(meta: _Meta, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if meta.arch.startswith("gemma"):
        # Gemma's vocabulary stores runs of spaces as spaces and its merge order is the file's order, not its scores
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    given = meta.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in given] if given else _bpe_merges(tokens, scores)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk] if unk is not None else None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if meta.arch == "phi3" and prefix:  # Phi-3's tokenizer.json prepends the space in its normalizer, as old Llama
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _tokenizer(meta: _Meta) -> tuple[Any, dict[str, Any]]:
    """tokenizer.json (a `tokenizers.Tokenizer`) and tokenizer_config.json built from `tokenizer.ggml.*`."""
    from tokenizers import AddedToken
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if model == "gpt2":
        tok = _byte_level_tokenizer(meta, tokens)
    elif model == "llama":
        tok = _sentencepiece_tokenizer(meta, tokens)
    else:
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind in (_CONTROL, _UNKNOWN)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(types) if kind == _USER_DEFINED])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": meta.get("{arch}.context_length", 4096),
                              # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
                              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
                              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and token_id < len(tokens):
            config[name] = tokens[token_id]
    if (template := _chat_template(meta)) is not None:
        config["chat_template"] = template
    return tok, config


def _chat_template(meta: _Meta) -> Any:
    default = meta.get("tokenizer.chat_template")
    named = [{"name": n, "template": meta.get(f"tokenizer.chat_template.{n}")}
             for n in meta.get("tokenizer.chat_templates") or []]
    if not named:
        return default
    return ([{"name": "default", "template": default}] if default is not None else []) + named


# --------------------------------------------------------------------------------------------- conversion
def _reader(path: Path) -> Any:
    from gguf import GGUFReader
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as e:  # (empty, truncated, or not a GGUF: the reader's message alone names no file)
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def _open(files: list[Path]) -> _Meta:
    readers = [_reader(p) for p in files]
    values = _read_values(readers[0])  # (a split file's metadata is in its first shard)
    if "general.architecture" not in values:
        raise ValueError(f"{files[0]}: no general.architecture in its metadata: not a model GGUF")
    return _Meta(values, {t.name: t for r in readers for t in r.tensors})


def convert(files: list[Path], out: Path) -> None:
    """Write the Hugging Face folder for the GGUF `files` (one file, or a split file's shards in order) into `out`."""
    meta = _open(files)
    spec = ARCHITECTURES.get(meta.arch)
    if spec is None:
        raise ValueError(f"GGUF architecture {meta.arch!r} is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    types = {t.tensor_type for t in meta.tensors.values()}
    quantized = sorted(t.name for t in types if t.name not in ("F32", "F16", "BF16"))
    _check_dequantizable(types)
    dtype = _float_dtype(types)
    config = _hf_config(meta, spec, dtype)
    if quantized:
        logger.warning("GGUF %s: dequantized %s -> %s: weights are not kept quantized", files[0].name,
                       ", ".join(quantized), str(dtype).removeprefix("torch."))
    out.mkdir(parents=True, exist_ok=True)
    tok, tok_config = _tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": list(dict.fromkeys(e for e in eos
                                                                                             if e is not None))}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_weights(meta, spec, config, dtype, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: a folder with config.json is complete

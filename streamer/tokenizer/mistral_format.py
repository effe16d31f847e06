"""Mistral's own checkpoint format, served as it ships (Mistral-7B-v0.3, Mistral-Small-3.x, Devstral, Magistral...
publish it; some only in it): `params.json` instead of config.json, `consolidated*.safetensors` with Mistral's
tensor names and Meta's rotary layout, and `tekken.json` (a tiktoken-style byte-level BPE) or a SentencePiece
`tokenizer.model.v*` instead of tokenizer.json. A folder is read this way when it has params.json and no
config.json (as vLLM's `--config-format auto` decides).

- `hf_config`: params.json as the config.json transformers' conversion script would write (Mistral, or Mixtral for
  a `moe` block). The vision encoder of a multimodal checkpoint is not loaded: the model serves text.
- `hf_weights`: the tensors renamed to transformers' names, q/k rows permuted from Meta's interleaved rotary pairs to
  the half-split layout the models here use (transformers' conversion does the same).
- `tekken_tokenizer`: tekken.json as a `tokenizers` BPE (ranks -> merges, as transformers' TikTokenConverter
  derives them); special tokens take ids 0..n-1 and the vocabulary follows, as mistral_common numbers them.
- `chat_template`: mistral_common (an optional dependency, Mistral's own library) generates the Jinja template that
  matches the tokenizer's version, as transformers does for such folders; without it there is no chat template.
"""
from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from streamer.tokenizer.byte_level import byte_level_chars

logger = logging.getLogger("streamer")

# Special tokens of tekken files that do not list their own (versions up to v7), in id order (mistral_common's)
LEGACY_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                   "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                   "[TOOL_CONTENT]")
_SKIPPED_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.", "pre_mm_projector_norm.")
_LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                "feed_forward.w3": "mlp.up_proj", "feed_forward.gate": "block_sparse_moe.gate"}
_GLOBAL_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)\Z")
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(w[123])\Z")
_UNSUPPORTED = ("quantization", "yarn", "llama_4_scaling", "q_lora_rank", "kv_lora_rank")


def is_mistral_folder(folder: Path) -> bool:
    return (folder / "params.json").is_file() and not (folder / "config.json").is_file()


def read_params(folder: Path) -> dict[str, Any]:
    with open(folder / "params.json") as f:
        return json.load(f)


def hf_config(folder: Path) -> dict[str, Any]:
    """params.json as a transformers config.json dict."""
    p = read_params(folder)
    found = [k for k in _UNSUPPORTED if p.get(k)]
    if found:
        raise ValueError(f"{folder}/params.json: {', '.join(found)} not supported in Mistral's format (a "
                         "transformers-format copy of the checkpoint, with config.json, may load)")
    missing = [k for k in ("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size") if k not in p]
    if missing:
        raise ValueError(f"{folder}/params.json lacks {', '.join(missing)}")
    heads = p["n_heads"]
    c: dict[str, Any] = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": p["dim"],
        "num_hidden_layers": p["n_layers"], "num_attention_heads": heads,
        "num_key_value_heads": p.get("n_kv_heads", heads), "head_dim": p.get("head_dim", p["dim"] // heads),
        "intermediate_size": p["hidden_dim"], "rms_norm_eps": p.get("norm_eps", 1e-5),
        "vocab_size": p["vocab_size"], "rope_theta": p.get("rope_theta", 10000.0),
        "max_position_embeddings": p.get("max_seq_len") or p.get("max_position_embeddings")
        or (131072 if _tekken_file(folder) else 32768),
        "sliding_window": p.get("sliding_window"), "tie_word_embeddings": bool(p.get("tied_embeddings", False)),
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if isinstance(c["sliding_window"], list):  # (per-layer windows: not in this format's text models we load)
        raise ValueError(f"{folder}/params.json: per-layer sliding windows are not supported")
    moe = p.get("moe")
    if moe and not (isinstance(moe, dict) and {"num_experts", "num_experts_per_tok"} <= moe.keys()):
        raise ValueError(f"{folder}/params.json: moe must give num_experts and num_experts_per_tok, got {moe!r}")
    if moe:
        c.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                 num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"])
    if p.get("vision_encoder"):
        logger.warning("%s: a multimodal Mistral-format checkpoint; its vision encoder is not loaded (text only)",
                       folder)
    return c


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's rotary layout (each head's dims in interleaved pairs) -> the half-split one (first halves, then
    second halves), as transformers' convert_mistral_weights_to_hf permutes q and k."""
    rows = w.shape[0]
    return w.view(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(name: str) -> Optional[str]:
    """A Mistral-format tensor's transformers name (None: a part not loaded, e.g. the vision encoder)."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} in a Mistral-format checkpoint")
    layer, part, kind = m.groups()
    expert = _EXPERT.match(part)
    if expert is not None:
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert.group(1)}.{expert.group(2)}.{kind}"
    if part not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {name!r} in a Mistral-format checkpoint")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def hf_weights(weights: Iterable[tuple[str, torch.Tensor]], heads: int,
               kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = 0
    for name, t in weights:
        new = hf_name(name)
        if new is None:
            skipped += 1
            continue
        if new.endswith("self_attn.q_proj.weight"):
            t = _permute(t, heads)
        elif new.endswith("self_attn.k_proj.weight"):
            t = _permute(t, kv_heads)
        yield new, t
    if skipped:
        logger.info("skipped %d vision-encoder tensors of the Mistral-format checkpoint", skipped)


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("consolidated*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has Mistral's params.json but no consolidated*.safetensors weights "
                                "(consolidated.pth files are not read: only safetensors)")
    return files


# ------------------------------------------------------------------------------------------------ tokenizer
def _tekken_file(folder: Path) -> Optional[Path]:
    return next(iter(sorted(p for p in folder.glob("*tekken*.json"))), None)


def spm_file(folder: Path) -> Optional[Path]:
    """A Mistral-format SentencePiece model (tokenizer.model.v1 / .v3 / .v7 ...)."""
    return next(iter(sorted(folder.glob("tokenizer.model.v*"))), None)


def tekken_tokenizer(path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """tekken.json as a `tokenizers.Tokenizer`, and the tokenizer_config.json settings it implies (a ValueError
    naming the file for one that is not a tekken vocabulary)."""
    try:
        return _tekken(path, json.loads(path.read_text(encoding="utf-8")))
    except (KeyError, TypeError, AttributeError, binascii.Error, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a tekken tokenizer file ({type(e).__name__}: {e})") from None


def _tekken(path: Path, data: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    cfg = data["config"]
    num_special = int(cfg["default_num_special_tokens"])
    inner = int(cfg["default_vocab_size"]) - num_special
    entries = data["vocab"][:inner]
    if len(entries) < inner:
        raise ValueError(f"{path}: {len(entries)} vocabulary entries, fewer than default_vocab_size - "
                         f"default_num_special_tokens = {inner}")
    specials = [t["token_str"] for t in data.get("special_tokens") or []] or list(LEGACY_SPECIALS)
    specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special)]
    table = {b: c for c, b in byte_level_chars().items()}  # byte -> GPT-2's printable stand-in
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        ranks[base64.b64decode(entry["token_bytes"])] = i
    as_text = {b: "".join(table[x] for x in b) for b in ranks}
    vocab = {**{t: i for i, t in enumerate(specials)}, **{as_text[b]: r + num_special for b, r in ranks.items()}}
    merges = []
    for token, rank in ranks.items():
        splits = [(ranks[token[:k]], ranks[token[k:]], k) for k in range(1, len(token))
                  if token[:k] in ranks and token[k:] in ranks]
        merges += [(rank, left, right, token[:k], token[k:]) for left, right, k in splits]
    merges.sort()
    tok = Tokenizer(models.BPE(vocab, [(as_text[a], as_text[b]) for *_, a, b in merges], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(cfg["pattern"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False}
    if "<pad>" in specials:
        config["pad_token"] = "<pad>"
    return tok, config


def tokenizer_files(folder: Path) -> Optional[tuple[Tokenizer, dict[str, Any]]]:
    """The folder's Mistral tokenizer (tekken.json, else tokenizer.model.v*), or None if it has neither."""
    tekken, spm = _tekken_file(folder), spm_file(folder)
    if tekken is not None:
        tok, config = tekken_tokenizer(tekken)
    else:
        if spm is None:
            return None
        from streamer.tokenizer.slow_tokenizer import sentencepiece_llama
        # not legacy: no dummy prefix after a control token (mistral_common's chat template writes "[INST] Hello")
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                  "add_eos_token": False, "legacy": False}
        tok = sentencepiece_llama(spm, config)
    template = chat_template(tekken or spm)  # type: ignore[arg-type]
    if template is not None:
        config["chat_template"] = template
    return tok, config


def chat_template(path: Path) -> Optional[str]:
    """mistral_common's chat template for the tokenizer file, or None (mistral_common is not installed)."""
    try:
        from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template
    except ImportError:
        logger.warning("%s: no chat template (install mistral_common, Mistral's library, to generate the one this "
                       "tokenizer's version uses)", path.parent)
        return None
    try:
        return convert_tokenizer_to_chat_template(str(path))
    except Exception as e:  # (as transformers does: a tokenizer it cannot template still tokenizes)
        logger.warning("%s: mistral_common could not write a chat template for it (%s): no chat template", path, e)
        return None

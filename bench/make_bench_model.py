"""Write the shared benchmark checkpoint: a ~90M-parameter Llama with real random bf16 weights (safetensors).

    python bench/make_bench_model.py [--out DIR] [--force]     # prints the folder

Both engines (streamer and vLLM-CPU, or transformers) then load the very same weights from disk, so their
outputs and costs are comparable. The config is bench/offline_throughput.py's LLAMA_90M (hidden 768, 12 layers,
12 heads, intermediate 2048, vocab 8192, tied embeddings), weights from LlamaForCausalLM's own initialiser with
torch seed 0. The tokenizer covers the whole model vocabulary (8192 ids): a random-weight model emits every id
about equally often, and with a smaller tokenizer (the demo model's, or tests/tokenizer_factory.py's, <= 1024
ids) nearly every generated token would decode to nothing, so a streaming client would see no text at all and
the serving benchmarks could not time tokens. It is a byte-level BPE in the style of
tests/tokenizer_factory.make_bytelevel_tokenizer (same special tokens <|begin_of_text|>=0, <|end_of_text|>=1,
<|pad|>=2, BOS template and tokenizer_config.json), with the 256 byte symbols and then two-character merges of
printable ASCII up to 8192 ids, built deterministically without training; the config's bos/eos ids are the
tokenizer's. Idempotent: an existing complete folder is left as it is (unless --force).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_DIR = Path.home() / ".cache" / "streamer-bench" / "llama-90m"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "BENCH_MODEL.json")


def _tokenizer_into(folder: Path, vocab_size: int) -> str:
    """Byte-level BPE with exactly vocab_size ids: 3 specials, 256 bytes, then printable-ASCII pair merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    from tests.tokenizer_factory import _bos_template, _special, _write_config
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (ord(c) > 0x7E, ord(c)))  # bytes
    vocab = {t: i for i, t in enumerate(specials)}
    for c in alphabet:
        vocab[c] = len(vocab)
    printable = [c for c in alphabet if 0x21 <= ord(c) <= 0x7E] + ["\u0120"]  # "Ġ" is the space byte
    merges = []
    for a in printable:
        for b in printable:
            if len(vocab) >= vocab_size:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    if len(vocab) != vocab_size:
        raise ValueError(f"could not make {vocab_size} ids (got {len(vocab)})")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.add_special_tokens([_special(t) for t in specials])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos = specials[0]
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                              _bos_template(bos, tok.token_to_id(bos))])
    _write_config(folder, tok, {"bos_token": bos, "eos_token": specials[1], "pad_token": specials[2],
                                "add_bos_token": True, "add_eos_token": False})
    return f"byte-level BPE, {vocab_size} ids (3 specials, 256 bytes, {len(merges)} ASCII-pair merges)"


def make(out: Path, force: bool = False) -> Path:
    if not force and all((out / n).is_file() for n in REQUIRED):
        made = json.loads((out / "BENCH_MODEL.json").read_text())
        if made.get("tokenizer_size") == json.loads((out / "config.json").read_text()).get("vocab_size"):
            return out  # complete, and from this version of the script
    import torch
    from offline_throughput import LLAMA_90M
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    def fill(tmp: Path) -> None:
        source = _tokenizer_into(tmp, LLAMA_90M["vocab_size"])
        tok = AutoTokenizer.from_pretrained(tmp)
        assert len(tok) == LLAMA_90M["vocab_size"], (len(tok), LLAMA_90M["vocab_size"])
        cfg = dict(LLAMA_90M)
        cfg.pop("architectures", None)
        cfg.pop("model_type", None)
        cfg["torch_dtype"] = "bfloat16"
        if tok.bos_token_id is not None:
            cfg["bos_token_id"] = tok.bos_token_id
        if tok.eos_token_id is not None:
            cfg["eos_token_id"] = tok.eos_token_id
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "BENCH_MODEL.json").write_text(json.dumps(
            {"made_by": "bench/make_bench_model.py", "seed": 0, "parameters": n_params, "tokenizer": source,
             "tokenizer_size": len(tok)}, indent=1) + "\n")
    return _build(out, fill)


def _build(out: Path, fill: Callable[[Path], None]) -> Path:
    """`fill` writes the checkpoint into a fresh folder beside `out`, which then replaces `out` whole (so that an
    interrupted build never leaves a half-written folder where a complete one is expected)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent if out.parent.exists() else None))
    try:
        fill(tmp)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# --qwen2-audio: a Qwen2-Audio of the same text size (Qwen2 layers) behind a whisper-base-sized audio encoder over
# 128 mel bins (the real model's is large-v3's: too slow for these CPUs), with Qwen2-Audio-Instruct's chat
# template and a saved Qwen2AudioProcessor, so that vLLM serves it too.
AUDIO_DIR = Path.home() / ".cache" / "streamer-bench" / "qwen2-audio-random"
AUDIO_ENCODER = dict(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048, num_mel_bins=128,
                     max_source_positions=1500)
AUDIO_SPECIALS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"]


def make_qwen2_audio(out: Path, force: bool = False) -> Path:
    if not force and all((out / n).is_file() for n in REQUIRED):
        return out
    import torch
    from offline_throughput import LLAMA_90M
    from tokenizers import AddedToken, Tokenizer
    from transformers import (
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from tests.checkpoints import QWEN2_AUDIO_CHAT_TEMPLATE

    def fill(tmp: Path) -> None:
        source = _tokenizer_into(tmp, LLAMA_90M["vocab_size"])
        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in AUDIO_SPECIALS])
        tok.save(str(tmp / "tokenizer.json"))
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        for t in AUDIO_SPECIALS:
            config.setdefault("added_tokens_decoder", {})[str(tok.token_to_id(t))] = {
                "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": True}
        config["chat_template"] = QWEN2_AUDIO_CHAT_TEMPLATE
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        hf_tok = AutoTokenizer.from_pretrained(tmp)
        text = {k: v for k, v in LLAMA_90M.items() if k not in ("architectures", "model_type")}
        text.update(model_type="qwen2", vocab_size=len(hf_tok), tie_word_embeddings=False,
                    bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))
        cfg = Qwen2AudioConfig(audio_config=dict(model_type="qwen2_audio_encoder", **AUDIO_ENCODER),
                               text_config=text, audio_token_index=tok.token_to_id("<|AUDIO|>"))
        torch.manual_seed(0)
        model = Qwen2AudioForConditionalGeneration(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=hf_tok,
                            chat_template=QWEN2_AUDIO_CHAT_TEMPLATE).save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "BENCH_MODEL.json").write_text(json.dumps(
            {"made_by": "bench/make_bench_model.py --qwen2-audio", "seed": 0, "parameters": n_params,
             "tokenizer": source + f" + {len(AUDIO_SPECIALS)} specials", "audio_encoder": AUDIO_ENCODER}, indent=1)
            + "\n")
    return _build(out, fill)


# --qwen3-5: a Qwen3.5-shaped hybrid text model (Qwen3_5ForCausalLM) of about the same size: 12 layers, every 4th
# gated full attention (8 heads of 128, 2 kv heads, rotary over a quarter), the rest Gated DeltaNet (8 key heads and
# 16 value heads of 64), a dense SwiGLU MLP of 2048; the Llama bench model's tokenizer.
QWEN3_5_DIR = Path.home() / ".cache" / "streamer-bench" / "qwen3_5-100m"
QWEN3_5 = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
               num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
               linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
               max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True})


# --qwen3-next: the same layers as Qwen3-Next (its packed DeltaNet projections) with its sparse MoE in every layer
# (8 experts of 512, 2 a token, a gated shared expert of 512) and an untied head: vLLM-CPU 0.32 runs Qwen3-Next
# (not Qwen3.5: its module imports torchvision), but only with a MoE layer, and it leaves a tied head unloaded.
QWEN3_NEXT_DIR = Path.home() / ".cache" / "streamer-bench" / "qwen3_next-100m"
QWEN3_NEXT_MOE = dict(mlp_only_layers=[], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, tie_word_embeddings=False)


def make_hybrid(out: Path, force: bool = False, next_moe: bool = False) -> Path:
    """The Qwen3.5-shaped bench model (QWEN3_5), or with next_moe its Qwen3-Next MoE sibling (QWEN3_NEXT_MOE)."""
    if not force and all((out / n).is_file() for n in REQUIRED):
        return out
    import torch
    import transformers as tf
    from offline_throughput import LLAMA_90M

    def fill(tmp: Path) -> None:
        source = _tokenizer_into(tmp, LLAMA_90M["vocab_size"])
        tok = tf.AutoTokenizer.from_pretrained(tmp)
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(12)]
        kw = dict(QWEN3_5, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  layer_types=layer_types)
        if next_moe:
            rope = {k: v for k, v in QWEN3_5["rope_parameters"].items() if not k.startswith("mrope")}
            cfg, cls = tf.Qwen3NextConfig(**dict(kw, **QWEN3_NEXT_MOE, rope_parameters=rope)), tf.Qwen3NextForCausalLM
        else:
            cfg, cls = tf.Qwen3_5TextConfig(**kw), tf.Qwen3_5ForCausalLM
            cfg.architectures = ["Qwen3_5ForCausalLM"]
        torch.manual_seed(0)
        model = cls(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "BENCH_MODEL.json").write_text(json.dumps(
            {"made_by": f"bench/make_bench_model.py {'--qwen3-next' if next_moe else '--qwen3-5'}", "seed": 0,
             "parameters": n_params, "tokenizer": source, "tokenizer_size": len(tok)}, indent=1) + "\n")
    return _build(out, fill)


# --gemma4: a Gemma 4 E2B-shaped text model (Gemma4ForCausalLM) of about the same size: 12 layers, every 6th global
# (heads of 256 against the sliding layers' 128, proportional rotary), a 512-token window, per-layer embeddings of 64
# a layer, the last 4 layers sharing the KV of layers 7 (sliding) and 5 (global) with double-wide MLPs, soft-capped
# logits; the Llama bench model's tokenizer.
GEMMA4_DIR = Path.home() / ".cache" / "streamer-bench" / "gemma4-100m"
GEMMA4 = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, global_head_dim=256, sliding_window=512,
              hidden_size_per_layer_input=64, num_kv_shared_layers=4, use_double_wide_mlp=True,
              final_logit_softcapping=30.0, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)


def make_gemma4(out: Path, force: bool = False) -> Path:
    if not force and all((out / n).is_file() for n in REQUIRED):
        return out
    import torch
    import transformers as tf
    from offline_throughput import LLAMA_90M

    def fill(tmp: Path) -> None:
        source = _tokenizer_into(tmp, LLAMA_90M["vocab_size"])
        tok = tf.AutoTokenizer.from_pretrained(tmp)
        cfg = tf.Gemma4TextConfig(**GEMMA4, vocab_size=len(tok), vocab_size_per_layer_input=len(tok),
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = tf.Gemma4ForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "BENCH_MODEL.json").write_text(json.dumps(
            {"made_by": "bench/make_bench_model.py --gemma4", "seed": 0, "parameters": n_params,
             "tokenizer": source, "tokenizer_size": len(tok)}, indent=1) + "\n")
    return _build(out, fill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_DIR} ({AUDIO_DIR} with --qwen2-audio)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    ap.add_argument("--qwen2-audio", action="store_true",
                    help="the audio-language bench model instead (Qwen2-Audio-shaped; see AUDIO_ENCODER)")
    ap.add_argument("--qwen3-5", action="store_true",
                    help=f"the hybrid bench model instead (Qwen3.5-shaped, text only; see QWEN3_5; {QWEN3_5_DIR})")
    ap.add_argument("--qwen3-next", action="store_true",
                    help=f"its Qwen3-Next MoE sibling, which vLLM-CPU runs (QWEN3_NEXT_MOE; {QWEN3_NEXT_DIR})")
    ap.add_argument("--gemma4", action="store_true",
                    help=f"the Gemma 4 bench model instead (E2B-shaped, text only; see GEMMA4; {GEMMA4_DIR})")
    args = ap.parse_args()
    kind = (GEMMA4_DIR, make_gemma4) if args.gemma4 else (AUDIO_DIR, make_qwen2_audio) if args.qwen2_audio else (QWEN3_5_DIR, make_hybrid) if args.qwen3_5 \
        else (QWEN3_NEXT_DIR, lambda out, force: make_hybrid(out, force, next_moe=True)) if args.qwen3_next \
        else (DEFAULT_DIR, make)
    out = (args.out or kind[0]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    print(kind[1](out, args.force))


if __name__ == "__main__":
    main()

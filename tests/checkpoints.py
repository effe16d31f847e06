"""Tiny Hugging Face checkpoints with random weights, built by the tests (nothing is downloaded).

Each folder is what `save_pretrained` writes (config.json + safetensors, sharded when asked) plus a
tokenizer trained with `tokenizers`, so streamer and `transformers` load exactly the same model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tests.tokenizer_factory import make_bytelevel_tokenizer, make_sentencepiece_tokenizer

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_moe", "mixtral", "gemma2", "gpt_oss",
            "phi4_mini", "granite", "olmo2", "smollm3")

# Families defined in other test modules (one per family group, so that groups grow without editing this file):
# family -> (config builder(vocab_size, **kw) -> a transformers config, optional randomiser(model) run before saving).
# `register_family` adds one; hf_config and make_checkpoint consult them first.
EXTRA_FAMILIES: dict[str, tuple[Callable[..., Any], Optional[Callable[[Any], None]]]] = {}
# model_types that transformers must run with eager attention in the oracle (SDPA lacks something they use).
EAGER_ATTENTION_TYPES = {"gemma2", "gpt_oss"}


def register_family(name: str, config: Callable[..., Any], randomise: Optional[Callable[[Any], None]] = None,
                    eager_attention_type: Optional[str] = None) -> None:
    EXTRA_FAMILIES[name] = (config, randomise)
    if eager_attention_type:
        EAGER_ATTENTION_TYPES.add(eager_attention_type)


_BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                             initializer_range=0.08)


def hf_config(family: str, vocab_size: int, **overrides: Any):
    import transformers as tf
    kw = dict(_BASE, vocab_size=vocab_size, **overrides)
    if family in EXTRA_FAMILIES:
        return EXTRA_FAMILIES[family][0](**kw)
    if family == "llama":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return tf.LlamaConfig(**kw)
    if family == "mistral":
        kw.setdefault("sliding_window", None)
        return tf.MistralConfig(**kw)
    if family == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        return tf.Qwen2Config(**kw)
    if family == "qwen3":
        kw.setdefault("head_dim", 32)
        return tf.Qwen3Config(**kw)
    if family == "gemma3":  # sliding layers (window 16, local rope base) and a global one; four norms a layer
        kw.setdefault("head_dim", 32)
        kw.setdefault("sliding_window", 16)
        kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
        kw.setdefault("query_pre_attn_scalar", 24)
        kw.setdefault("final_logit_softcapping", 30.0)
        kw.setdefault("pad_token_id", 0)
        return tf.Gemma3TextConfig(**kw)
    if family == "gemma2":  # sliding then global layer, one rope base; attention scores soft-capped at 5 (see below)
        kw.setdefault("head_dim", 32)
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1000.0})  # not a default
        kw.setdefault("sliding_window", 16)
        kw.setdefault("query_pre_attn_scalar", 24)
        kw.setdefault("attn_logit_softcapping", 5.0)
        kw.setdefault("final_logit_softcapping", 30.0)
        kw.setdefault("pad_token_id", 0)
        return tf.Gemma2Config(**kw)
    if family == "qwen3_moe":  # 4 experts, top 2; layer 1 keeps a dense MLP (mlp_only_layers)
        kw.setdefault("head_dim", 16)
        kw.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
        kw.setdefault("moe_intermediate_size", 32)
        kw.setdefault("mlp_only_layers", [1])
        return tf.Qwen3MoeConfig(**kw)
    if family == "mixtral":  # 4 experts, top 2, every layer sparse; Hub names (block_sparse_moe, w1/w2/w3)
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
        kw.setdefault("sliding_window", None)
        return tf.MixtralConfig(**kw)
    if family == "gpt_oss":  # sliding (window 8) then full layer, YaRN, 4 experts top 2; sinks and biases: see below
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
        kw.setdefault("head_dim", 16)
        kw.setdefault("sliding_window", 8)
        kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
        kw.setdefault("swiglu_limit", 1.0)  # (7 in the real models) low enough that the clamps bite
        kw.setdefault("rope_parameters", {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 64,
                                          "rope_theta": 150000.0})
        return tf.GptOssConfig(**kw)
    if family == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint; a sliding window, as Phi-3-mini's
        kw.setdefault("sliding_window", 24)
        kw.setdefault("pad_token_id", 0)
        return tf.Phi3Config(**kw)
    if family == "phi4_mini":  # Phi-4-mini's shape: 3/4 of each head rotates, LongRoPE past 32 tokens, tied head
        kw.setdefault("partial_rotary_factor", 0.75)
        half = int(kw["hidden_size"] // kw["num_attention_heads"] * kw["partial_rotary_factor"]) // 2
        kw.setdefault("original_max_position_embeddings", 32)
        kw.setdefault("rope_scaling", {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                       "long_factor": [1.0 + 2.0 * i for i in range(half)]})
        kw.setdefault("tie_word_embeddings", True)
        kw.setdefault("sliding_window", None)
        kw.setdefault("pad_token_id", 0)
        # Larger weights: at 0.08 the tied head mostly repeats each prompt's last token.
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.Phi3Config(**kw)
    if family == "granite":  # Granite-3-like multipliers (the attention scale 4x head_dim ** -0.5). Untied head: with
        # random weights, a tied one and 12x embeddings over 0.22x branches, every prompt's last token just repeats.
        kw.setdefault("embedding_multiplier", 12.0)
        kw.setdefault("residual_multiplier", 0.22)
        kw.setdefault("attention_multiplier", 1.0)
        kw.setdefault("logits_scaling", 8.0)
        kw.setdefault("tie_word_embeddings", False)
        return tf.GraniteConfig(**kw)
    if family == "olmo2":  # post-norms, whole-projection q/k norms (their weights randomised: see below)
        kw.setdefault("pad_token_id", 0)
        return tf.Olmo2Config(**kw)
    if family == "llama4":
        # 4 layers: rope layers attend in chunks of 8 (prompts of 20-40 tokens cross several) with q/k L2-normed; layer
        # 1 is a NoPE layer with query temperature tuning (floor_scale 4: it scales from position 3 on); layers 1 and
        # 3 are MoE (4 experts, top 1, sigmoid scores on the input, shared expert), 0 and 2 dense (96 wide);
        # interleaved llama3-scaled rotary
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
        kw.update(num_local_experts=overrides.get("num_local_experts", 4), intermediate_size=32)
        kw.setdefault("head_dim", 16)
        kw.setdefault("intermediate_size_mlp", 96)
        kw.setdefault("num_experts_per_tok", 1)
        kw.setdefault("interleave_moe_layer_step", 2)
        kw.setdefault("no_rope_layers", [1, 0, 1, 1])
        kw.setdefault("attention_chunk_size", 8)
        kw.setdefault("floor_scale", 4)
        kw.setdefault("attn_scale", 0.5)
        kw.setdefault("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                          "rope_theta": 10000.0})
        # Larger weights: at 0.08 continuations mostly repeat one token, and fewer of Llama 4's differences show.
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.Llama4TextConfig(**kw)
    if family in ("deepseek_v2", "deepseek_v3"):
        # MLA with small ranks (V: 12 dims beside K's 16 + 8, padded in the cache), 3 layers: a dense one
        # (first_k_dense_replace), then sparse ones of 8 experts top 2 plus shared experts. V2: no q LoRA (V2-Lite),
        # softmax "greedy" routing (or group_limited_greedy when asked); V3: q LoRA, sigmoid + correction bias (random:
        # see below) within the best 2 of 4 groups, interleaved rope.
        v3 = family == "deepseek_v3"
        kw.update(num_key_value_heads=kw["num_attention_heads"])  # (MLA ignores it; V3's config defaults to 128)
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 3)
        kw.setdefault("q_lora_rank", 24 if v3 else None)
        kw.setdefault("kv_lora_rank", 16)
        kw.setdefault("qk_nope_head_dim", 16)
        kw.setdefault("qk_rope_head_dim", 8)
        kw.setdefault("v_head_dim", 12)
        kw.setdefault("n_routed_experts", 8)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 16)
        kw.setdefault("n_shared_experts", 1 if v3 else 2)
        kw.setdefault("first_k_dense_replace", 1)
        kw.setdefault("routed_scaling_factor", 2.5 if v3 else 1.5)
        if v3:
            kw.setdefault("n_group", 4)
            kw.setdefault("topk_group", 2)
            kw.setdefault("norm_topk_prob", True)
            kw.setdefault("rope_interleave", True)
            return tf.DeepseekV3Config(**kw)
        kw.setdefault("topk_method", "greedy")
        return tf.DeepseekV2Config(**kw)
    if family == "glm4":  # sandwich norms (randomised: see below), fused gate_up_proj, half of each head rotating
        # in interleaved pairs, q/k/v biases
        kw.setdefault("head_dim", 16)
        kw.setdefault("pad_token_id", 0)
        return tf.Glm4Config(**kw)
    if family == "glm4_moe":
        # 3 layers: a dense one (first_k_dense_replace), then MoE ones of 8 experts top 2 within the best 2 of 4
        # groups, sigmoid + correction bias (random: see below), a shared expert; q/k norms, q/k/v biases, half of
        # each head rotating (Llama's halves)
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 3)
        kw.setdefault("head_dim", 16)
        kw.setdefault("attention_bias", True)
        kw.setdefault("use_qk_norm", True)
        kw.setdefault("n_routed_experts", 8)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 16)
        kw.setdefault("n_group", 4)
        kw.setdefault("topk_group", 2)
        kw.setdefault("routed_scaling_factor", 2.5)
        kw.setdefault("first_k_dense_replace", 1)
        return tf.Glm4MoeConfig(**kw)
    if family == "smollm3":  # NoPE layers 1 and 3 (no_rope_layer_interval 2), tied head
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
        kw.setdefault("no_rope_layer_interval", 2)
        kw.setdefault("pad_token_id", 0)
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
        # Larger weights: with a tied head at 0.08, continuations mostly repeat each prompt's last token.
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.SmolLM3Config(**kw)
    if family == "granitemoehybrid":  # Granite 4.0-H-like: Mamba2 layers around an attention layer (NoPE unless
        # position_embedding_type="rope"), 2 groups of B/C, SSD chunks of 8 (prompts span several); a shared MLP per
        # layer plus, unless num_local_experts=0, 4 experts top 2. Granite's multipliers, untied head (see granite).
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
        kw.setdefault("layer_types", ["mamba", "attention", "mamba", "mamba"][:kw["num_hidden_layers"]])
        kw.update(intermediate_size=overrides.get("intermediate_size", 32))
        kw.setdefault("num_local_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("shared_intermediate_size", 48)
        kw.setdefault("mamba_n_heads", 8)
        kw.setdefault("mamba_n_groups", 2)
        kw.setdefault("mamba_d_state", 16)
        kw.setdefault("mamba_chunk_size", 8)
        kw.setdefault("embedding_multiplier", 12.0)
        kw.setdefault("residual_multiplier", 0.22)
        kw.setdefault("attention_multiplier", 0.25)
        kw.setdefault("logits_scaling", 8.0)
        kw.setdefault("tie_word_embeddings", False)
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.GraniteMoeHybridConfig(**kw)
    if family == "bamba":  # Granite's hybrid without multipliers or experts: attention at layer 1, half-rotary heads
        kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 3)
        kw.setdefault("attn_layer_indices", [1])
        kw.setdefault("mamba_n_heads", 8)
        kw.setdefault("mamba_n_groups", 2)
        kw.setdefault("mamba_d_state", 16)
        kw.setdefault("mamba_chunk_size", 8)
        kw.setdefault("pad_token_id", 0)
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.BambaConfig(**kw)
    if family == "qwen3_next":  # Qwen3-Next-like: Gated DeltaNet layers around a gated full-attention layer (rotary
        # over a quarter of each head), 2 key heads / 4 value heads; 4 experts top 2 plus a gated shared expert, layer
        # 2 dense (mlp_only_layers). Untied head.
        _gated_deltanet_shape(kw, overrides, head_dim=16)
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 32)
        kw.setdefault("shared_expert_intermediate_size", 48)
        kw.setdefault("mlp_only_layers", [2])
        kw.setdefault("tie_word_embeddings", False)
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        return tf.Qwen3NextConfig(**kw)
    if family == "ministral3":  # Ministral 3: Mistral with YaRN (scaled from 16 positions) and Llama 4's query
        # scale past the original length, so that the test prompts (up to 130 tokens) reach several scale steps
        kw.setdefault("head_dim", 16)
        kw.setdefault("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                          "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "llama_4_scaling_beta": 0.5})
        kw.setdefault("tie_word_embeddings", False)
        return tf.Ministral3Config(**kw)
    if family in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5-like: Qwen3-Next's layer pattern and head shapes, separate
        # DeltaNet projections, interleaved M-RoPE over a quarter of each 32-wide head; dense, or 4 experts top 2 + a
        # gated shared expert in every layer. Untied head.
        _gated_deltanet_shape(kw, overrides, head_dim=32)
        kw.setdefault("rope_parameters", {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                          "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        kw.setdefault("tie_word_embeddings", False)
        kw["initializer_range"] = overrides.get("initializer_range", 0.2)
        if family == "qwen3_5":
            return tf.Qwen3_5TextConfig(**kw)
        kw.pop("intermediate_size")
        kw.setdefault("num_experts", 4)
        kw.setdefault("num_experts_per_tok", 2)
        kw.setdefault("moe_intermediate_size", 32)
        kw.setdefault("shared_expert_intermediate_size", 48)
        return tf.Qwen3_5MoeTextConfig(**kw)
    raise ValueError(family)


def _gated_deltanet_shape(kw: dict[str, Any], overrides: dict[str, Any], head_dim: int) -> None:
    """The tiny Qwen3-Next / Qwen3.5 layer pattern (layer 1 full attention, the others Gated DeltaNet) and head
    shapes (2 key heads of 16, 4 value heads of 8), unless `overrides` gives them."""
    kw["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
    kw.setdefault("layer_types", ["linear_attention", "full_attention", "linear_attention",
                                  "linear_attention"][:kw["num_hidden_layers"]])
    kw.setdefault("head_dim", head_dim)
    kw.update(linear_num_key_heads=overrides.get("linear_num_key_heads", 2),
              linear_num_value_heads=overrides.get("linear_num_value_heads", 4),
              linear_key_head_dim=overrides.get("linear_key_head_dim", 16),
              linear_value_head_dim=overrides.get("linear_value_head_dim", 8))


def _randomise_qwen3_next(model: Any) -> None:
    """transformers starts the (1 + w) norms at zero, the gated norm and dt_bias at one, A_log at log U(0.01, 16):
    random ones show that each is loaded and used where it belongs."""
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.3)
        elif "norm" in name and "visual" not in name:
            p.normal_(0.0, 0.3)
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 1.0)
        elif name.endswith("A_log"):
            p.uniform_(-1.0, 1.5)


def make_checkpoint(out_dir: Path, family: str = "llama", tokenizer: str = "bytelevel", seed: int = 0,
                    dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                    **overrides: Any) -> Path:
    import transformers as tf
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tok = make_bytelevel_tokenizer if tokenizer == "bytelevel" else make_sentencepiece_tokenizer
    make_tok(out_dir)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok["added_tokens"] if t["id"] >= len(tok["model"]["vocab"]))
    cfg_tok = json.loads((out_dir / "tokenizer_config.json").read_text())
    cfg = hf_config(family, vocab, **overrides)
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    bos, eos = cfg_tok.get("bos_token"), cfg_tok.get("eos_token")
    cfg.bos_token_id = ids.get(bos if isinstance(bos, str) else (bos or {}).get("content"))
    cfg.eos_token_id = ids.get(eos if isinstance(eos, str) else (eos or {}).get("content"))
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype)
    if family in ("gemma3", "gemma2"):
        # Gemma's norms start at zero (a scale of 1 + w): random ones show that each is loaded.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.3)
                if family == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    # Scores up to ~3x the soft cap (median ~3, 90th percentile ~7 at cap 5): without the cap,
                    # transformers itself picks other tokens for 14 of the parity test's 16 prompts.
                    p.mul_(3.0)
    if family in ("olmo2", "glm4", "glm4_moe"):
        # transformers starts the norms at one: random ones show that each is loaded and used where it belongs.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)
    if family == "gpt_oss":
        # transformers starts the expert biases at zero and the sinks near it: random ones show that each is loaded
        # and used (sinks ~ N(0, 1.5^2): each takes a real share of its head's softmax).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_bias"):
                    p.normal_(0.0, 0.3)
                elif name.endswith("sinks"):
                    p.normal_(0.0, 1.5)
    if family in ("deepseek_v3", "glm4_moe"):
        # transformers starts the routers' correction biases at zero: random ones (about the spread of the
        # sigmoid scores) change which experts some tokens choose, and show that the bias only chooses.
        with torch.no_grad():
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0.0, 0.1)
    if family in ("granitemoehybrid", "bamba"):
        # transformers starts D, dt_bias and the gated norm at one and A_log at log(1..heads): random ones show that
        # each is loaded and used where it belongs.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("mamba.D", "mamba.norm.weight")):
                    p.normal_(1.0, 0.3)
                elif name.endswith("mamba.dt_bias"):
                    p.normal_(0.0, 1.0)
                elif name.endswith("mamba.A_log"):
                    p.uniform_(-1.0, 1.5)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        with torch.no_grad():
            _randomise_qwen3_next(model)
    if family in EXTRA_FAMILIES and EXTRA_FAMILIES[family][1] is not None:
        with torch.no_grad():
            EXTRA_FAMILIES[family][1](model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects), fp32."""
    import transformers as tf
    # Eager attention for Gemma 2 and gpt-oss (transformers' default for them today): SDPA cannot soft-cap the
    # scores nor take sinks.
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    kw = {"attn_implementation": "eager"} if model_type in EAGER_ATTENTION_TYPES else {}
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _vlm_tokenizer(out_dir: Path, specials: list[str], chat_template: str | None) -> dict[str, int]:
    """The byte-level test tokenizer with `specials` added as special tokens (also in tokenizer_config.json) and
    the given chat template (None: keep the text models'); returns every added token's id."""
    from tokenizers import AddedToken, Tokenizer
    make_bytelevel_tokenizer(out_dir)
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg_tok = json.loads((out_dir / "tokenizer_config.json").read_text())
    for t in specials:
        cfg_tok["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    if chat_template is not None:
        cfg_tok["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg_tok, indent=2) + "\n")
    ids = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    ids["vocab_size"] = tok.get_vocab_size()
    return ids


def _hf_greedy_with_logprobs(model, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                             inputs) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation and each token's logprob; inputs(ids tensor, images) gives the model's
    image inputs (on the model's device)."""
    outs = []
    with torch.no_grad():
        for ids, images in prompts:
            t = torch.tensor([ids], device=model.device)
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True,
                                 **(inputs(t, images) if images else {}))
            tokens = gen.sequences[0, len(ids):].tolist()
            lps = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(gen.logits, tokens)]
            outs.append((tokens, lps))
    return outs


# A LLaVA-1.5-style chat template: content is a list of parts, images rendered as the image token.
LLAVA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_llava_checkpoint(out_dir: Path, vision: str = "clip", text: str = "llama", seed: int = 0,
                          chat_template: str | None = LLAVA_CHAT_TEMPLATE, **text_overrides: Any) -> Path:
    """A tiny LlavaForConditionalGeneration (a CLIP or SigLIP encoder at 32x32 pixels, 8x8 patches: 16 image
    tokens) over a tiny text model, with `<image>` as an added special token, the matching image processor's
    preprocessor_config.json and a LLaVA-style chat template (None: the text models' string template)."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<image>"], chat_template)
    image_id = ids["<image>"]
    text_cfg = hf_config(text, ids["vocab_size"], **text_overrides)
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                 patch_size=8)
    if vision == "clip":
        vision_cfg, strategy = tf.CLIPVisionConfig(**shape), "default"
        processor = tf.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        vision_cfg, strategy = tf.SiglipVisionConfig(**shape), "full"
        processor = tf.SiglipImageProcessor(size={"height": 32, "width": 32})
    cfg = tf.LlavaConfig(vision_config=vision_cfg, text_config=text_cfg, image_token_index=image_id,
                         vision_feature_layer=-2, vision_feature_select_strategy=strategy, image_seq_length=16)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # image features as large as token embeddings: the images then steer the output
        model.model.multi_modal_projector.linear_2.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def hf_llava_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                    ) -> list[list[int]]:
    """transformers' greedy continuation of each (expanded prompt ids, PIL images), fp32, its own processor."""
    import transformers as tf
    model = tf.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(model_dir)
    outs = []
    with torch.no_grad():
        for ids, images in prompts:
            t = torch.tensor([ids])
            kw = {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]} if images else {}
            gen = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def make_classifier_checkpoint(out_dir: Path, family: str = "llama", labels: tuple[str, ...] = ("negative", "neutral",
                               "positive"), seed: int = 0, max_shard_size: str | None = None,
                               **overrides: Any) -> Path:
    """A tiny `*ForSequenceClassification` (transformers' class for the family: the decoder and a `score` head, no LM
    head) with one label per name in `labels` (one: a cross-encoder / reward model), pad_token_id set (transformers
    pools the last token that is not padding) and the byte-level tokenizer."""
    import transformers as tf
    out_dir = Path(out_dir)
    make_bytelevel_tokenizer(out_dir)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + sum(1 for t in tok["added_tokens"] if t["id"] >= len(tok["model"]["vocab"]))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg = hf_config(family, vocab, id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)},
                    pad_token_id=ids["<|pad|>"], bos_token_id=ids["<|begin_of_text|>"],
                    eos_token_id=ids["<|end_of_text|>"], **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():  # logits of a few units: probabilities that differ between prompts
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out_dir


# Gemma 3's chat template, in short: string or parts, images written as <start_of_image>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def make_gemma3_vlm_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration: SigLIP at 32x32 pixels, 4x4 patches (64), pooled to 16 image tokens,
    over a two-layer Gemma 3 text model (a sliding layer, a global one), with <start_of_image>, <end_of_image> and
    <image_soft_token> as added special tokens, Gemma 3's image processor config and a Gemma 3-style template."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                         GEMMA3_CHAT_TEMPLATE)
    boi, eoi, image = ids["<start_of_image>"], ids["<end_of_image>"], ids["<image_soft_token>"]
    # (no final soft-capping: real Gemma 3 configs have none, and transformers' Gemma3ForConditionalGeneration,
    # unlike its Gemma3ForCausalLM, would not apply one)
    text_cfg = hf_config("gemma3", ids["vocab_size"], final_logit_softcapping=None)
    text_cfg.bos_token_id, text_cfg.eos_token_id = ids.get("<|begin_of_text|>"), ids.get("<|end_of_text|>")
    vision_cfg = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=32, patch_size=4)
    cfg = tf.Gemma3Config(text_config=text_cfg, vision_config=vision_cfg, mm_tokens_per_image=16,
                          boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vision" not in name:  # Gemma's norms start at zero (a scale of 1 + w)
                p.normal_(0.0, 0.3)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)  # features that matter
    model.save_pretrained(out_dir)
    tf.Gemma3ImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out_dir)
    return out_dir


def hf_gemma3_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                     device: str = "cpu") -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation of each (expanded prompt ids, PIL images), with each token's logprob:
    token_type_ids mark the image tokens, whose attention within each image is bidirectional."""
    import transformers as tf
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval().to(device)
    processor = tf.AutoImageProcessor.from_pretrained(model_dir)
    image_id = model.config.image_token_index
    return _hf_greedy_with_logprobs(model, prompts, max_new_tokens, lambda t, images: {
        "pixel_values": processor(images=images, return_tensors="pt")["pixel_values"].to(device),
        "token_type_ids": (t == image_id).long()})


# Qwen2-VL's chat template, in short: string or parts, each image as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_qwen_vl_checkpoint(out_dir: Path, version: str = "qwen2_vl", seed: int = 0) -> Path:
    """A tiny Qwen2-VL (or Qwen2.5-VL): 4x4-pixel patches, 2x2 merged into one token (so a 32x32 image takes 16
    tokens; other sizes other counts), over a two-layer Qwen2 text model with M-RoPE, with the vision tokens as
    added special tokens, Qwen2VLImageProcessor's config (small min/max pixels) and a Qwen2-VL-style template."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_start|>",
                                   "<|im_end|>"], QWEN_VL_CHAT_TEMPLATE)
    start, end, image = ids["<|vision_start|>"], ids["<|vision_end|>"], ids["<|image_pad|>"]
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=ids["vocab_size"], max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    if version == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=4, mlp_ratio=2)
        cls, cfg_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                      window_size=16, fullatt_block_indexes=[1])
        cls, cfg_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLConfig
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=image, vision_start_token_id=start,
                  vision_end_token_id=end, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(out_dir)
    tf.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48}).save_pretrained(out_dir)
    return out_dir


def make_qwen3_vl_checkpoint(out_dir: Path, seed: int = 0, moe: bool = False) -> Path:
    """A tiny Qwen3-VL: 4x4-pixel patches, 2x2 merged into one token, a 4x4 learned position table (resampled to
    each image's grid), DeepStack taps of vision blocks 0 and 1 (added after text layers 0 and 1 of 3), over a
    Qwen3 text model (q/k norms) with interleaved M-RoPE; Qwen2-VL's tokens, template and image processor (with
    Qwen3-VL's mean and std of 0.5). moe: Qwen3-VL-MoE (4 experts of 24, 2 a token, stacked per layer)."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_start|>",
                                   "<|im_end|>"], QWEN_VL_CHAT_TEMPLATE)
    start, end, image = ids["<|vision_start|>"], ids["<|vision_end|>"], ids["<|image_pad|>"]
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=ids["vocab_size"], max_position_embeddings=512,
                rms_norm_eps=1e-6, bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                 "rope_theta": 10000.0})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    if moe:
        text.update(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    cfg_cls, cls = (tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration) if moe else \
        (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration)
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=image, vision_start_token_id=start,
                  vision_end_token_id=end, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "pos_embed" in name or "deepstack" in name:
                p.normal_(0.0, 0.3)  # (big enough to matter in the tiny model)
    model.save_pretrained(out_dir)
    tf.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3,
                             size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48}).save_pretrained(out_dir)
    return out_dir


def make_qwen3_5_vl_checkpoint(out_dir: Path, seed: int = 0, moe: bool = False,
                               chat_template: str = QWEN_VL_CHAT_TEMPLATE) -> Path:
    """A tiny Qwen3.5 (Qwen3_5ForConditionalGeneration, as every Qwen3.5 release is): Qwen3-VL's tiny tower without
    DeepStack over the tiny Qwen3.5 text model (hf_config "qwen3_5" / "qwen3_5_moe": Gated DeltaNet layers around
    a gated full-attention layer, interleaved M-RoPE); Qwen2-VL's tokens, template and image processor."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                   "<|im_start|>", "<|im_end|>"], chat_template)
    family = "qwen3_5_moe" if moe else "qwen3_5"
    text = hf_config(family, ids["vocab_size"], bos_token_id=ids["<|begin_of_text|>"],
                     eos_token_id=ids["<|end_of_text|>"]).to_dict()
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4,
                  num_position_embeddings=16)
    cfg_cls, cls = (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration) if moe else \
        (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration)
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        _randomise_qwen3_next(model)
        for name, p in model.named_parameters():
            if "visual" in name and "norm" in name:
                p.normal_(1.0, 0.3)
            elif "pos_embed" in name:
                p.normal_(0.0, 0.3)  # (big enough to matter in the tiny model)
    model.save_pretrained(out_dir)
    tf.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3,
                             size={"shortest_edge": 8 * 8, "longest_edge": 48 * 48}).save_pretrained(out_dir)
    return out_dir


def hf_qwen_vl_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                      ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation (and each token's logprob) of each (expanded prompt ids, PIL images)."""
    import transformers as tf
    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(model_dir)

    def inputs(t: torch.Tensor, images: list) -> dict:
        px = processor(images=images, return_tensors="pt")
        # (what its processor returns beside the ids: which tokens are image tokens, for M-RoPE)
        return {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"],
                "mm_token_type_ids": (t == model.config.image_token_id).int()}
    return _hf_greedy_with_logprobs(model, prompts, max_new_tokens, inputs)


# Qwen2-Audio-7B-Instruct's chat template (its tokenizer_config.json's): a clip is "Audio N: " and its tokens
QWEN2_AUDIO_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] != "
    "'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
    "{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: "
    "<|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_qwen2_audio_checkpoint(out_dir: Path, seed: int = 0, **audio_overrides: Any) -> Path:
    """A tiny Qwen2AudioForConditionalGeneration: Whisper's encoder shape over 128 mel bins at 32 wide (two layers,
    an average pool), one linear projection, a two-layer Qwen2 text model; <|AUDIO|>, <|audio_bos|>,
    <|audio_eos|> and the chat tokens added as specials, Qwen2-Audio-Instruct's chat template and a
    WhisperFeatureExtractor of 128 mel bins (Qwen2-Audio's preprocessor_config.json)."""
    import transformers as tf
    out_dir = Path(out_dir)
    ids = _vlm_tokenizer(out_dir, ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"],
                         QWEN2_AUDIO_CHAT_TEMPLATE)
    text = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=ids["vocab_size"],
                max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=ids["<|begin_of_text|>"],
                eos_token_id=ids["<|end_of_text|>"], tie_word_embeddings=False)
    audio = dict(model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=4,
                 encoder_ffn_dim=64, num_mel_bins=128, max_source_positions=1500, **audio_overrides)
    cfg = tf.Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=ids["<|AUDIO|>"])
    torch.manual_seed(seed)
    model = tf.Qwen2AudioForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        model.model.multi_modal_projector.linear.weight.mul_(8.0)  # (the clips then steer the output)
    model.save_pretrained(out_dir)
    tf.WhisperFeatureExtractor(feature_size=128).save_pretrained(out_dir)
    return out_dir


def hf_qwen2_audio_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int,
                          ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy continuation (and each token's logprob) of each (expanded prompt ids, clips: float32
    16 kHz arrays), its features made as Qwen2AudioProcessor makes them."""
    import transformers as tf
    model = tf.Qwen2AudioForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    fe = tf.WhisperFeatureExtractor.from_pretrained(model_dir)

    def inputs(t: torch.Tensor, clips: list) -> dict:
        f = fe(clips, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
        return {"input_features": f["input_features"], "feature_attention_mask": f["attention_mask"]}
    return _hf_greedy_with_logprobs(model, prompts, max_new_tokens, inputs)

"""Each model family's config.json in ModelConfig's common names (models/config.py: `ModelConfig.from_dict`).

Most families write the common keys (hidden_size, num_attention_heads, rms_norm_eps, ...) themselves; the ones
here spell them their own way or leave them to their transformers config class's defaults. Each function takes the
raw config.json dict and returns a new one with the common names filled in (the family's own keys kept: its model
file reads them from `ModelConfig.raw`). A family's registry entry (models/registry.py, `ModelEntry.config`) names
its function.

This module imports no model file and, at import time, not torch either: models/config.py and models/registry.py
stay importable without torch. The model files that read the same settings (the Mamba mixers' sizes, Nemotron-H's
layer kinds, BERT's position offset, ...) import them from here.
"""
from __future__ import annotations

from typing import Any


def _gelu_names() -> Any:
    """The GELU activations the encoders support (models/layers.py's table: it imports torch, so only on use)."""
    from streamer.models.layers import GELU_APPROXIMATE
    return GELU_APPROXIMATE


# --- encoders (the registry's ENCODER models) ---

_BERT_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "hidden_act": "gelu", "max_position_embeddings": 512,
                  "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}  # (BertConfig's)


def position_offset(raw: dict[str, Any]) -> int:
    """Where position 0's row is: (XLM-)RoBERTa numbers positions from pad_token_id + 1 (create_position_ids_
    from_input_ids), BERT from 0."""
    family = raw.get("_encoder_family")
    if family == "mpnet":  # (MPNet's embeddings fix their padding index at 1, whatever the config's pad_token_id)
        return 2
    return int(raw.get("pad_token_id") or 0) + 1 if family == "roberta" else 0


def bert_config(c: dict[str, Any], family: str = "bert") -> dict[str, Any]:
    """BERT (or RoBERTa / XLM-RoBERTa / MPNet: `family`; models/bert.py): the LayerNorm eps as the norm eps, biased attention, no KV-head
    grouping, no LM head, and a context of the position rows left after the offset; BertConfig's defaults."""
    c = {**_BERT_DEFAULTS, **c, "_encoder_family": family}
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {c['position_embedding_type']!r} is not supported (absolute is)")
    gelu = _gelu_names()
    if c["hidden_act"] not in gelu:
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported ({', '.join(gelu)} are)")
    c["encoder_positions"] = c["max_position_embeddings"]  # (the table's rows)
    c["max_position_embeddings"] -= position_offset(c)
    c["num_key_value_heads"] = c["num_attention_heads"]
    c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    c["rms_norm_eps"] = c["layer_norm_eps"]
    c["attention_bias"] = True
    c["tie_word_embeddings"] = True  # (no LM head: an encoder only pools)
    return c


MPNET_NUM_BUCKETS = 32  # (transformers' compute_position_bias passes 32 whatever relative_attention_num_buckets says)
_MPNET_DEFAULTS = {"vocab_size": 30527, "pad_token_id": 1, "max_position_embeddings": 514, "layer_norm_eps": 1e-5,
                   "relative_attention_num_buckets": 32}  # (MPNetConfig's, where they differ from BertConfig's)


def mpnet_config(c: dict[str, Any]) -> dict[str, Any]:
    """MPNet (models/mpnet.py): BERT's, with MPNet's defaults, no token types, and at least the 32 relative
    position buckets its attention reads."""
    c = bert_config({**_MPNET_DEFAULTS, **c}, "mpnet")
    if int(c["relative_attention_num_buckets"]) < MPNET_NUM_BUCKETS:
        raise ValueError(f"relative_attention_num_buckets {c['relative_attention_num_buckets']} is below the "
                         f"{MPNET_NUM_BUCKETS} buckets MPNet's attention reads")
    c["type_vocab_size"] = 0
    return c


_MODERNBERT_DEFAULTS = {"vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
                        "num_attention_heads": 12, "hidden_activation": "gelu", "max_position_embeddings": 8192,
                        "norm_eps": 1e-5, "norm_bias": False, "attention_bias": False, "mlp_bias": False,
                        "local_attention": 128, "classifier_pooling": "cls", "classifier_bias": False,
                        "classifier_activation": "gelu", "global_attn_every_n_layers": 3}  # (ModernBertConfig's)
_MODERNBERT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}


def modernbert_config(c: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT (models/modernbert.py): the layer types (every n-th global, the rest sliding), each type's rotary
    base, `norm_eps`, `hidden_activation` as the MLP's GELU, no LM head; ModernBertConfig's defaults."""
    c = {**_MODERNBERT_DEFAULTS, **c}
    n = c["num_hidden_layers"]
    every = c["global_attn_every_n_layers"]
    types = c.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= set(_MODERNBERT_THETA):
        raise ValueError(f"layer_types must give one of {sorted(_MODERNBERT_THETA)} for each of the {n} layers")
    rope = c.pop("rope_parameters", None) or {}
    theta = {}
    for kind, old in (("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            raise ValueError("ModernBERT with rope scaling is not supported")
        theta[kind] = float(params.get("rope_theta") or c.get(old) or _MODERNBERT_THETA[kind])
    gelu = _gelu_names()
    for key in ("hidden_activation", "classifier_activation"):
        if c[key] not in gelu:
            raise ValueError(f"{key} {c[key]!r} is not supported ({', '.join(gelu)} are)")
    if c["classifier_pooling"] not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {c['classifier_pooling']!r}")
    c.update(layer_types=types, rope_theta=theta["full_attention"], local_rope_theta=theta["sliding_attention"],
             hidden_act=c["hidden_activation"], rms_norm_eps=c["norm_eps"], num_key_value_heads=c["num_attention_heads"],
             head_dim=c["hidden_size"] // c["num_attention_heads"], tie_word_embeddings=True)
    return c


_T5_ACTS = {"relu": ("relu", False), "gated-gelu": ("gelu_new", True)}


def t5_config(c: dict[str, Any]) -> dict[str, Any]:
    """T5's encoder (models/t5.py), as T5Config reads it: `d_model`, `d_kv`, `d_ff`, `num_layers`, `num_heads`,
    `feed_forward_proj` as the (gated or not) MLP activation, unbiased attention, no LM head; T5Config's defaults."""
    c = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
         "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
         "feed_forward_proj": "relu", "n_positions": 512, **c}  # (T5Config's defaults)
    if c["feed_forward_proj"] not in _T5_ACTS:
        raise ValueError(f"T5 with feed_forward_proj {c['feed_forward_proj']!r} is not supported "
                         f"({', '.join(_T5_ACTS)} are)")
    act, gated = _T5_ACTS[c["feed_forward_proj"]]
    c.update(hidden_size=c["d_model"], num_attention_heads=c["num_heads"], num_key_value_heads=c["num_heads"],
             head_dim=c["d_kv"], intermediate_size=c["d_ff"], num_hidden_layers=c["num_layers"],
             rms_norm_eps=c["layer_norm_epsilon"], hidden_act=act, t5_gated=gated, attention_bias=False,
             max_position_embeddings=c.get("max_position_embeddings") or c["n_positions"], tie_word_embeddings=True)
    return c


def roberta_config(c: dict[str, Any]) -> dict[str, Any]:
    """RoBERTa / XLM-RoBERTa (served by BERT's class, models/bert.py): BERT's, positions numbered from
    pad_token_id + 1."""
    return bert_config(c, "roberta")


# --- GPT-2-style decoders ---

_GPT_BIGCODE_DEFAULTS = {"n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024}  # (GPTBigCodeConfig's)


def gpt_bigcode_config(c: dict[str, Any], multi_query_default: bool = True) -> dict[str, Any]:
    """GPTBigCode (or GPT-2: no multi_query by default; models/gpt_bigcode.py): GPT-2's spellings (`n_embd`, `n_head`,
    `n_layer`, `n_positions`), the MLP width (n_inner, default 4 x hidden), one kv head with multi_query,
    head_dim = hidden / heads, the head tied by default."""
    c = dict(c)
    for old, new in (("n_embd", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
                     ("n_positions", "max_position_embeddings")):
        if c.get(new) is None:
            c[new] = c.get(old, _GPT_BIGCODE_DEFAULTS[old])
    if c.get("intermediate_size") is None:
        c["intermediate_size"] = c.get("n_inner") or 4 * c["hidden_size"]
    c["num_key_value_heads"] = 1 if c.get("multi_query", multi_query_default) else c["num_attention_heads"]
    c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    c.setdefault("tie_word_embeddings", True)
    return c


def gpt2_config(c: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 (served by models/gpt_bigcode.py): GPTBigCode's, without multi_query unless the config says so."""
    return gpt_bigcode_config(c, multi_query_default=False)


_GPTJ_DEFAULTS = {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                  "rotary_dim": 64, "tie_word_embeddings": False, "layer_norm_epsilon": 1e-5}


def gptj_config(c: dict[str, Any]) -> dict[str, Any]:
    """GPT-J (models/gptj.py): GPT-2's spellings, `rotary_dim` as the share of each head that rotates, base 10000
    (GPT-J reads no rope_theta nor scaling), no attention biases; GPTJConfig's defaults."""
    c = gpt_bigcode_config({**_GPTJ_DEFAULTS, **c}, multi_query_default=False)
    rotary, head_dim = c["rotary_dim"], c["head_dim"]
    if rotary is None or rotary % 2 or not 0 < rotary <= head_dim:
        # (transformers' rotary_dim null rotates hidden_size dims of each head: it only runs with one head)
        raise ValueError(f"GPT-J with rotary_dim {rotary!r} is not supported (an even number of dims up to "
                         f"head_dim {head_dim} is)")
    # Half a dim over: ModelConfig.rotary_dim truncates head_dim * factor, which rotary / head_dim can fall short of.
    c["partial_rotary_factor"] = (rotary + 0.5) / head_dim
    c.update(rope_theta=10000.0, rope_scaling=None, rope_parameters=None, attention_bias=False,
             layer_norm_eps=c["layer_norm_epsilon"])
    return c


_OPT_DEFAULTS = {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
                 "max_position_embeddings": 2048, "num_attention_heads": 12, "tie_word_embeddings": True}


def opt_config(c: dict[str, Any]) -> dict[str, Any]:
    """OPT (models/opt.py): `ffn_dim` as the MLP width, `enable_bias` as the attention biases, head_dim = hidden /
    heads, OPTConfig's defaults."""
    c = {**_OPT_DEFAULTS, **c}
    c["intermediate_size"] = c["ffn_dim"]
    c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    c["num_key_value_heads"] = c["num_attention_heads"]
    c["attention_bias"] = bool(c.get("enable_bias", True))
    return c


_BLOOM_DEFAULTS = {"vocab_size": 250880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
                   "tie_word_embeddings": True}  # (BloomConfig's)


def bloom_config(c: dict[str, Any]) -> dict[str, Any]:
    """BLOOM (models/bloom.py): `n_embed` (older) / `n_layer` / `n_head`, no KV-head grouping, a 4 x hidden MLP,
    `layer_norm_epsilon`, biased attention, `seq_length` as the context; BloomConfig's defaults."""
    c = {**_BLOOM_DEFAULTS, **c}
    if c.get("n_embed") is not None:  # (an older spelling)
        c["hidden_size"] = c["n_embed"]
    heads = c.get("num_attention_heads") or c["n_head"]
    c.update(num_hidden_layers=c.get("num_hidden_layers") or c["n_layer"], num_attention_heads=heads,
             num_key_value_heads=heads, head_dim=c["hidden_size"] // heads, intermediate_size=4 * c["hidden_size"],
             layer_norm_eps=c["layer_norm_epsilon"], attention_bias=True)
    c.setdefault("max_position_embeddings", c.get("seq_length") or 2048)
    return c


_FALCON_DEFAULTS = {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
                    "max_position_embeddings": 2048, "tie_word_embeddings": True}


def falcon_config(c: dict[str, Any]) -> dict[str, Any]:
    """Falcon (models/falcon.py), as FalconConfig reads it: `n_embed` (an older spelling, winning over hidden_size),
    the kv heads of each layout, the MLP width, `bias` on every linear, the LayerNorm eps as `layer_norm_eps`."""
    c = {**_FALCON_DEFAULTS, **c}
    if c.get("n_embed") is not None:
        c["hidden_size"] = c["n_embed"]
    heads = c["num_attention_heads"]
    if c.get("new_decoder_architecture"):
        c["num_key_value_heads"] = c.get("num_kv_heads") or heads
    else:  # (transformers builds [q; k; v] per head without multi_query, whatever num_kv_heads says)
        c["num_key_value_heads"] = 1 if c.get("multi_query", True) else heads
    c["head_dim"] = c["hidden_size"] // heads
    c["intermediate_size"] = c.get("ffn_hidden_size") or 4 * c["hidden_size"]
    c["attention_bias"] = bool(c.get("bias", False))
    c["layer_norm_eps"] = c.get("layer_norm_epsilon", 1e-5)
    return c


def mpt_config(c: dict[str, Any]) -> dict[str, Any]:
    """MPT (models/mpt.py): `d_model` / `n_heads` / `n_layers` / `max_seq_len`, its attention settings under
    `mpt_attn`, refusing what transformers' MPT ignores; MptConfig's defaults."""
    c = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "expansion_ratio": 4, "max_seq_len": 2048,
         "layer_norm_epsilon": 1e-5, "no_bias": True, "tie_word_embeddings": True, **c}  # (MptConfig's defaults)
    attn = {"alibi": True, "alibi_bias_max": 8, "qk_ln": False, "clip_qkv": None, "softmax_scale": None,
            "attn_type": "multihead_attention", **(c.get("attn_config") or {})}
    for key, want in (("alibi", True), ("qk_ln", False), ("attn_type", "multihead_attention")):
        if attn[key] != want:
            raise ValueError(f"MPT with attn_config.{key} = {attn[key]!r} is not supported ({want!r} is)")
    for key, want in (("no_bias", True), ("expansion_ratio", 4), ("logit_scale", None)):
        if c.get(key, want) != want:
            raise ValueError(f"MPT with {key} = {c[key]!r} is not supported ({want!r} is)")
    heads, hidden = c["n_heads"], c["d_model"]
    c.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
             num_hidden_layers=c["n_layers"], intermediate_size=4 * hidden, max_position_embeddings=c["max_seq_len"],
             layer_norm_eps=c["layer_norm_epsilon"], attention_bias=False, mpt_attn=attn)
    return c


def whisper_config(c: dict[str, Any]) -> dict[str, Any]:
    """Whisper (models/whisper.py), sized by its decoder (the model the engine schedules): d_model,
    decoder_layers / _attention_heads / _ffn_dim, max_target_positions (448 tokens); the LM head tied."""
    c = dict(c)
    d = c.get("d_model", 384)
    heads = c.get("decoder_attention_heads", 6)
    c.update(hidden_size=d, num_hidden_layers=c.get("decoder_layers", 4), num_attention_heads=heads,
             num_key_value_heads=heads, head_dim=d // heads, intermediate_size=c.get("decoder_ffn_dim", 1536),
             max_position_embeddings=c.get("max_target_positions", 448))
    c.setdefault("tie_word_embeddings", True)
    c.setdefault("vocab_size", 51865)
    c.setdefault("hidden_act", c.get("activation_function", "gelu"))
    return c


# --- newer decoders ---

# Gemma4TextConfig's defaults, for keys a config.json leaves out (a nested text_config may be written sparse)
GEMMA4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=512, vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256, attention_k_eq_v=False, num_kv_shared_layers=0, enable_moe_block=False,
    use_double_wide_mlp=False, pad_token_id=0, bos_token_id=2, eos_token_id=1)


def gemma4_config(c: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 (models/gemma4.py): the common names already, with Gemma4TextConfig's defaults for what is left out."""
    return {**GEMMA4_DEFAULTS, **c}  # (a null given stays null: `hidden_size_per_layer_input: null` means no PLE)


def qwen3_5_config(c: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5 text (models/qwen3_5.py): Qwen3.5-MoE's gives no intermediate_size (its shared expert's size stands
    in: no dense MLP reads it), and its router always renormalises the top-k weights."""
    if c.get("intermediate_size") is None:
        c = dict(c, intermediate_size=c.get("shared_expert_intermediate_size") or c.get("moe_intermediate_size"))
    if c.get("num_experts"):  # (its router always renormalises the top-k weights: no norm_topk_prob)
        c = dict(c, norm_topk_prob=True)
    return c


# --- recurrent and hybrid ---

def lfm2_ff_dim(c: dict[str, Any]) -> int:
    """LFM2's MLP width (Lfm2MLP's adjustment of `block_ff_dim` / `intermediate_size`)."""
    size = int(c.get("block_ff_dim") or c.get("intermediate_size") or 12288)
    if c.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        mult = c.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            size = int(mult * size)
            of = int(c.get("block_multiple_of", 256))
            size = of * ((size + of - 1) // of)
    return size


def lfm2_config(c: dict[str, Any]) -> dict[str, Any]:
    """LFM2 / LFM2-MoE (models/lfm2.py): `norm_eps`, `tie_embedding`, the MLP's actual width as `intermediate_size`
    (the config's kept as `block_ff_dim`), LFM2's rope base (1e6) when none is given."""
    c = dict(c)
    if "Lfm2MoeForCausalLM" not in (c.get("architectures") or []):  # (LFM2-MoE's dense MLPs: intermediate_size)
        c["block_ff_dim"] = c.get("block_ff_dim") or c.get("intermediate_size") or 12288
        c["intermediate_size"] = lfm2_ff_dim(c)
    else:
        c.setdefault("intermediate_size", 7168)
    c["rms_norm_eps"] = c.get("norm_eps", 1e-5)
    if "tie_embedding" in c:
        c["tie_word_embeddings"] = c["tie_embedding"]
    c.setdefault("tie_word_embeddings", True)
    if "rope_theta" not in c and "rope_theta" not in (c.get("rope_parameters") or {}):
        c["rope_theta"] = c.get("theta", 1_000_000.0)
    return c


def mamba_inner_size(c: dict[str, Any]) -> int:
    """Mamba v1's d_inner: the config's `intermediate_size` when it has one (transformers keeps it over expand x
    hidden_size: falcon-mamba-7b says expand 16 but intermediate_size 8192), else expand x hidden_size."""
    return int(c.get("intermediate_size") or int(c.get("expand", 2)) * int(c.get("hidden_size", 768)))


def mamba1_config(c: dict[str, Any]) -> dict[str, Any]:
    """Mamba / FalconMamba (models/mamba1.py): no attention (one nominal head of 2; no KV cache is built),
    `intermediate_size` the mixer's d_inner, norm eps `layer_norm_epsilon`, the head tied unless said otherwise
    (MambaConfig's default), and no length limit of its own (256K tokens, unless max_model_len says less)."""
    c = dict(c)
    c.setdefault("hidden_size", 768)
    c["intermediate_size"] = mamba_inner_size(c)
    c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"] = 1, 1, 2  # (a 2-wide rotary table, unused)
    c.setdefault("num_hidden_layers", 32)
    c.setdefault("vocab_size", 50280)
    c["rms_norm_eps"] = c.get("layer_norm_epsilon", 1e-5)
    c.setdefault("max_position_embeddings", 262144)
    c.setdefault("tie_word_embeddings", True)
    return c


def mamba2_config(c: dict[str, Any]) -> dict[str, Any]:
    """Mamba2 (models/mamba2.py): no attention (one nominal head of 2; no KV cache is built) nor MLP
    (`intermediate_size`: in_proj's width), its SSM heads' `head_dim` kept as `ssm_head_dim`, its norm eps
    `layer_norm_epsilon`, and no length limit of its own (no position embeddings: 256K tokens, unless max_model_len
    says less)."""
    c = dict(c)
    c.setdefault("ssm_head_dim", c.get("head_dim", 64))  # (its `head_dim` is the SSM heads')
    c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"] = 1, 1, 2  # (a 2-wide rotary table, unused)
    c.setdefault("hidden_size", 4096)
    # (no MLP: the mixer's in_proj width stands in, for the runner's estimate of a step's activations)
    inner = int(c.get("num_heads", 128)) * int(c["ssm_head_dim"])
    c.setdefault("intermediate_size", 2 * inner + 2 * int(c.get("n_groups", 8)) * int(c.get("state_size", 128))
                 + int(c.get("num_heads", 128)))
    c.setdefault("num_hidden_layers", 64)
    c.setdefault("vocab_size", 32768)
    c["rms_norm_eps"] = c.get("layer_norm_epsilon", 1e-5)
    c.setdefault("max_position_embeddings", 262144)  # (none in the config: Mamba-Codestral's 256K)
    c.setdefault("tie_word_embeddings", False)
    return c


def mamba2_mixer_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Mamba2Config's mixer settings (as `mamba2_config` left them) in models/mamba.py's names (and Mamba2Config's
    defaults)."""
    return {"mamba_n_heads": raw.get("num_heads", 128), "mamba_d_head": raw.get("ssm_head_dim", 64),
            "mamba_n_groups": raw.get("n_groups", 8), "mamba_d_state": raw.get("state_size", 128),
            "mamba_d_conv": raw.get("conv_kernel", 4), "mamba_chunk_size": raw.get("chunk_size", 256),
            "time_step_limit": raw.get("time_step_limit") or (0.0, float("inf")),
            "mamba_proj_bias": bool(raw.get("use_bias", False)),
            "mamba_conv_bias": bool(raw.get("use_conv_bias", True))}


_NEMOTRON_H_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe",
                     "mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                     "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


def nemotron_h_layer_kinds(raw: dict[str, Any]) -> list[str]:
    """"mamba", "attention", "mlp" or "moe" per layer, from `layers_block_type` / `layer_types` or
    `hybrid_override_pattern`."""
    kinds = raw.get("layers_block_type") or raw.get("layer_types") or list(raw.get("hybrid_override_pattern") or "")
    if not kinds:
        raise ValueError("a NemotronH config needs hybrid_override_pattern or layers_block_type")
    bad = [k for k in kinds if k not in _NEMOTRON_H_KINDS]
    if bad:
        raise ValueError(f"unsupported NemotronH layer type(s) {sorted(set(bad))!r} (supported: M * - E, "
                         f"or {', '.join(k for k in _NEMOTRON_H_KINDS if len(k) > 1)})")
    return [_NEMOTRON_H_KINDS[k] for k in kinds]


def nemotron_h_config(c: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H (models/nemotron_h.py): its layer count from the layer pattern (transformers 5 writes no
    num_hidden_layers), `layer_norm_epsilon`, the attention head size (older configs: `attention_head_dim`; else
    transformers' default, 128)."""
    c = dict(c, num_hidden_layers=len(nemotron_h_layer_kinds(c)))
    c.setdefault("rms_norm_eps", c.get("layer_norm_epsilon", 1e-5))
    c["head_dim"] = c.get("head_dim") or c.get("attention_head_dim") or 128
    return c


def nemotron_h_mixer_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's Mamba settings (and their older `mamba_*` spellings) in models/mamba.py's names."""
    def get(*keys: str, default: Any = None) -> Any:
        return next((raw[k] for k in keys if raw.get(k) is not None), default)
    return {"mamba_n_heads": get("mamba_num_heads", default=128), "mamba_d_head": get("mamba_head_dim", default=64),
            "mamba_n_groups": get("n_groups", "mamba_n_groups", default=8),
            "mamba_d_state": get("ssm_state_size", default=128), "mamba_d_conv": get("conv_kernel", "mamba_d_conv",
                                                                                     default=4),
            "mamba_chunk_size": get("chunk_size", "mamba_chunk_size", default=128),
            "time_step_limit": get("time_step_limit", "mamba_dt_limit", default=(0.0, float("inf"))),
            "mamba_proj_bias": bool(get("use_bias", default=False)),
            "mamba_conv_bias": bool(get("use_conv_bias", "mamba_conv_bias", default=True))}

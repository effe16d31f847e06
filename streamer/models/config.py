"""The model's shape, read from a Hugging Face config.json (both the classic and the transformers-5 spelling)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from streamer.models.family_configs import FAMILY_CONFIGS, encoder_config

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma4ForCausalLM",
                           "Qwen3MoeForCausalLM",
                           "GemmaForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM",
                           "MixtralForCausalLM", "GptOssForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Llama4ForCausalLM",
                           "Glm4ForCausalLM", "Glm4MoeForCausalLM", "SmolLM3ForCausalLM",
                           "Olmo3ForCausalLM", "Exaone4ForCausalLM", "Ernie4_5ForCausalLM", "SeedOssForCausalLM",
                           "ArceeForCausalLM", "ApertusForCausalLM", "HunYuanDenseV1ForCausalLM",
                           "MinistralForCausalLM", "Ministral3ForCausalLM",
                           "Qwen2MoeForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM",
                           "GraniteMoeSharedForCausalLM", "Ernie4_5_MoeForCausalLM", "HunYuanMoEV1ForCausalLM",
                           "PhimoeForCausalLM",
                           "GraniteMoeHybridForCausalLM", "BambaForCausalLM", "Qwen3NextForCausalLM",
                           "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "NemotronHForCausalLM", "Mamba2ForCausalLM", "FalconH1ForCausalLM", "Lfm2ForCausalLM",
                           "Lfm2MoeForCausalLM",
                           "MambaForCausalLM", "FalconMambaForCausalLM",
                           "GPTNeoXForCausalLM", "PhiForCausalLM", "StableLmForCausalLM", "GPTBigCodeForCausalLM",
                           "GPT2LMHeadModel", "FalconForCausalLM", "GPTJForCausalLM", "OPTForCausalLM",
                           "BloomForCausalLM", "MPTForCausalLM", "MptForCausalLM",
                           "OlmoForCausalLM", "NemotronForCausalLM",
                           "WhisperForConditionalGeneration")
# Hybrid models (Mamba2: models/granite_hybrid.py, nemotron_h.py; Gated DeltaNet: qwen3_next.py): per-request
# recurrent state besides the KV cache, so prefix caching resumes only from checkpoints of that state
# (kv_cache.StateCheckpoints), and no speculative decoding (no rollback). Under tensor parallelism their recurrent layers split by heads (channels), each rank's state slots
# holding its heads' state (models/mamba.py). Pure recurrent models (mamba2.py, mamba1.py) are among them: no
# attention layer, so no KV cache at all.
HYBRID_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "BambaForCausalLM", "Qwen3NextForCausalLM",
                        "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                        "NemotronHForCausalLM", "Mamba2ForCausalLM", "FalconH1ForCausalLM", "Lfm2ForCausalLM",
                        "Lfm2MoeForCausalLM",
                        "MambaForCausalLM", "FalconMambaForCausalLM")
# Encoder-decoder models (models/whisper.py): the encoder runs once per request, its output held in the request's
# state slot as the decoder's cross-attention K / V. Slots as the hybrid models' (eager, no speculative decoding, no
# tensor parallelism); no prefix caching (a prefix's KV depends on the audio).
ENCODER_DECODER_ARCHITECTURES = ("WhisperForConditionalGeneration",)
# Multi-head latent attention (models/deepseek.py): K and V come out of a low-rank latent, not a k/v projection.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Families whose layers cannot be split over tensor-parallel ranks (yet): refused before any worker starts.
NO_TENSOR_PARALLEL = {"Olmo2ForCausalLM": "its q/k norms span all heads, which tensor parallelism splits over ranks",
                      "Olmo3ForCausalLM": "its q/k norms span all heads, which tensor parallelism splits over ranks",
                      "OlmoeForCausalLM": "its q/k norms span all heads, which tensor parallelism splits over ranks",
                      "BertModel": "not implemented for encoders (small models: one device serves them)",
                      "ModernBertModel": "not implemented for encoders (small models: one device serves them)",
                      "MPNetModel": "not implemented for encoders (small models: one device serves them)",
                      "T5EncoderModel": "not implemented for encoders (small models: one device serves them)",
                      "WhisperForConditionalGeneration": "not implemented for Whisper (its largest model fits one "
                                                         "device)"}
# Bare backbones (what `AutoModel.save_pretrained` writes, e.g. some embedding checkpoints): the decoder of the family,
# without an LM head of its own (logits, if asked for, come from the embedding matrix: serve them for embeddings).
BACKBONES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
             "Qwen3Model": "Qwen3ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM"}
# Sequence classifiers (classifiers, reward models, cross-encoder rerankers): the family's decoder with a `score` head
# [num_labels, hidden] in place of the LM head; they classify the last token's hidden state (streamer/engine/pooling.py) and
# cannot generate.
SEQUENCE_CLASSIFIERS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                        "MistralForSequenceClassification": "MistralForCausalLM",
                        "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                        "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}

# BERT-family encoders (models/bert.py): embedding models and sequence classifiers whose tokens attend both ways.
# The checkpoint's architecture -> (family, sequence classifier?); the BERT and RoBERTa families are served by one
# model class, "BertModel"; ModernBERT (models/modernbert.py) by "ModernBertModel", MPNet (models/mpnet.py) by
# "MPNetModel". A masked-LM checkpoint (`*ForMaskedLM`, as some sentence-transformers models are saved) serves as an
# embedding model: its LM head is skipped.
ENCODER_ARCHITECTURES = {"BertModel": ("bert", False), "BertForSequenceClassification": ("bert", True),
                         "BertForMaskedLM": ("bert", False),
                         "RobertaModel": ("roberta", False), "RobertaForSequenceClassification": ("roberta", True),
                         "RobertaForMaskedLM": ("roberta", False),
                         "XLMRobertaModel": ("roberta", False),
                         "XLMRobertaForSequenceClassification": ("roberta", True),
                         "XLMRobertaForMaskedLM": ("roberta", False),
                         "ModernBertModel": ("modernbert", False),
                         "ModernBertForSequenceClassification": ("modernbert", True),
                         "MPNetModel": ("mpnet", False), "MPNetForMaskedLM": ("mpnet", False),
                         "MPNetForSequenceClassification": ("mpnet", True),
                         "T5EncoderModel": ("t5", False)}

ENCODER_MODELS = ("BertModel", "ModernBertModel", "MPNetModel", "T5EncoderModel")  # (the model classes they load as: ModelConfig.architecture)

# Vision-language checkpoints (a vision encoder + projector in front of one of the text families above): the
# architecture -> the text families (by text_config.model_type) it may wrap.
MULTIMODAL_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                            "Gemma3ForConditionalGeneration",
                            "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                            "Mistral3ForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                            "Qwen3VLMoeForConditionalGeneration", "InternVLForConditionalGeneration",
                            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                            "Gemma4ForConditionalGeneration",
                            "Qwen2AudioForConditionalGeneration")  # (audio, not images: models/vlm.py)
_TEXT_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               # Qwen2-VL's text model is Qwen2's with M-RoPE; older configs keep its fields at the top level
               "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
               "qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
               # Qwen3-VL's: Qwen3's (q/k norms) with interleaved M-RoPE and DeepStack (models/vlm.py)
               "qwen3_vl_text": "Qwen3ForCausalLM", "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM",  # (InternVL3.5's MoE models)
               # Qwen3.5's: Qwen3-Next's hybrid (models/qwen3_5.py) with interleaved M-RoPE, no DeepStack
               "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "ministral3": "Ministral3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}  # (Ministral 3's Mistral3ForConditionalGeneration)
_VISION_TYPES = {"LlavaForConditionalGeneration": ("clip_vision_model", "siglip_vision_model"),
                 "LlavaNextForConditionalGeneration": ("clip_vision_model", "siglip_vision_model"),
                 "Gemma3ForConditionalGeneration": ("siglip_vision_model",),
                 "Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_vl_vision"),
                 "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_5_vl_vision"),
                 "Mistral3ForConditionalGeneration": ("pixtral",),
                 "Qwen3VLForConditionalGeneration": ("qwen3_vl", "qwen3_vl_vision"),
                 "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", "qwen3_vl_moe_vision", "qwen3_vl",
                                                        "qwen3_vl_vision"),
                 "InternVLForConditionalGeneration": ("internvl_vision",),
                 "Qwen3_5ForConditionalGeneration": ("qwen3_5_vision", "qwen3_5"),
                 "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe_vision", "qwen3_5_moe", "qwen3_5_vision"),
                 "Gemma4ForConditionalGeneration": ("gemma4_vision",),
                 "Qwen2AudioForConditionalGeneration": ("qwen2_audio_encoder",)}  # (its audio_config's)
# What transformers' config classes default to: real LLaVA configs (llava-1.5) leave the text model's sizes out.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768),
    # (gemma-3-4b-it's text_config, for one, gives only its hidden/intermediate sizes, layers and window)
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, tie_word_embeddings=True),
    "qwen3_vl_text": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=128000),
}
# The image token each architecture's config defaults to.
_IMAGE_TOKEN = {"LlavaForConditionalGeneration": 32000, "LlavaNextForConditionalGeneration": 32000,
                "Gemma3ForConditionalGeneration": 262144,
                "Qwen2VLForConditionalGeneration": 151655, "Qwen2_5_VLForConditionalGeneration": 151655,
                "Mistral3ForConditionalGeneration": 10, "Qwen3VLForConditionalGeneration": 151655,
                "Qwen3VLMoeForConditionalGeneration": 151655, "InternVLForConditionalGeneration": 151667,
                "Qwen3_5ForConditionalGeneration": 248056, "Qwen3_5MoeForConditionalGeneration": 248056,
                "Gemma4ForConditionalGeneration": 258_880,
                "Qwen2AudioForConditionalGeneration": 151646}  # (its <|AUDIO|>: audio_token_index)
# The text config an architecture's config class builds when config.json has none (a given one takes its
# model_type's class defaults: _TEXT_DEFAULTS).
_DEFAULT_TEXT_CONFIG: dict[str, dict[str, Any]] = {
    "Mistral3ForConditionalGeneration": dict(
        model_type="mistral", head_dim=128, hidden_size=5120, intermediate_size=32768, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8, rms_norm_eps=1e-05,
        rope_theta=1000000000.0, sliding_window=None, vocab_size=131072),
    "InternVLForConditionalGeneration": dict(model_type="qwen2"),  # (Qwen2Config's defaults)
    "Qwen2AudioForConditionalGeneration": dict(model_type="qwen2"),
}

# Vision-language checkpoints served as their text model alone (vision weights skipped, images refused): the
# architecture -> its text model's. Llama 4 (Scout, Maverick) is released as Llama4ForConditionalGeneration; Gemma 4's
# are served so only without a vision_config (with one, its images are supported: MULTIMODAL_ARCHITECTURES).
TEXT_ONLY_ARCHITECTURES = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM",
                           "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM"}

# Families whose attention projections never have biases, whatever attention_bias says (as in transformers).
NO_ATTENTION_BIAS = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Ministral3ForCausalLM")
# Families whose attention_bias puts biases on q/k/v only, never on o_proj (Qwen2's are always there).
NO_O_PROJ_BIAS = ("Qwen2ForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM")
# transformers' config defaults that differ from Llama's, for keys a config.json leaves out.
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "Glm4ForCausalLM": dict(partial_rotary_factor=0.5, attention_bias=True),
    "Glm4MoeForCausalLM": dict(partial_rotary_factor=0.5),
    "GemmaForCausalLM": dict(tie_word_embeddings=True, head_dim=256),
    "CohereForCausalLM": dict(rope_theta=500_000.0, tie_word_embeddings=True),
    "Cohere2ForCausalLM": dict(tie_word_embeddings=True),
    "Starcoder2ForCausalLM": dict(tie_word_embeddings=True),
    "Qwen3NextForCausalLM": dict(partial_rotary_factor=0.25),
    "Qwen3_5ForCausalLM": dict(partial_rotary_factor=0.25),
    "Qwen3_5MoeForCausalLM": dict(partial_rotary_factor=0.25),
    "SmolLM3ForCausalLM": dict(rope_theta=2_000_000.0, tie_word_embeddings=True),
    "Olmo3ForCausalLM": dict(rope_theta=500_000.0, rms_norm_eps=1e-5),
    "Exaone4ForCausalLM": dict(rms_norm_eps=1e-5),
    "Ernie4_5ForCausalLM": dict(rope_theta=500_000.0, tie_word_embeddings=True, head_dim=128, rms_norm_eps=1e-5),
    "SeedOssForCausalLM": dict(attention_bias=True, head_dim=128),
    "ArceeForCausalLM": dict(rms_norm_eps=1e-5),
    "ApertusForCausalLM": dict(rms_norm_eps=1e-5),
    "HunYuanDenseV1ForCausalLM": dict(rms_norm_eps=1e-5),
    "OlmoeForCausalLM": dict(rms_norm_eps=1e-5),
    "HunYuanMoEV1ForCausalLM": dict(rms_norm_eps=1e-5),
    "PhimoeForCausalLM": dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5),
    "Ernie4_5_MoeForCausalLM": dict(rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "BambaForCausalLM": dict(partial_rotary_factor=0.5),  # (hard-coded by transformers' BambaConfig)
    "GPTNeoXForCausalLM": dict(partial_rotary_factor=0.25, attention_bias=True),
    "PhiForCausalLM": dict(partial_rotary_factor=0.5),
    "StableLmForCausalLM": dict(partial_rotary_factor=0.25),
    "NemotronForCausalLM": dict(partial_rotary_factor=0.5, rms_norm_eps=1e-5),  # (rms_norm_eps: its LayerNorms')
}

# Older spellings of common config keys, per family: GPT-NeoX's rotary share and base; Nemotron's norm eps.
_KEY_ALIASES: dict[str, dict[str, str]] = {
    "GPTNeoXForCausalLM": {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"},
    "NemotronForCausalLM": {"norm_eps": "rms_norm_eps"},
}


def rope_scaling(legacy: Optional[dict[str, Any]], params: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The rope scaling to apply, from the older `rope_scaling` or transformers-5 `rope_parameters`, with its kind
    under "rope_type"; None for plain rotary."""
    scaling = legacy or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "mrope":
        return None  # M-RoPE's table is plain rotary's (ModelConfig.mrope_section says how positions share it)
    if scaling is None:
        return None
    scaling = dict(scaling)
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    return None if scaling["rope_type"] == "default" else scaling


@dataclass
class MLADims:
    """Multi-head latent attention's sizes (DeepSeek-V2 / V3): q = q_b(norm(q_a(x))) (or q_proj(x) without
    `q_lora_rank`); kv_a(x) = a `kv_lora_rank` latent + a `qk_rope_head_dim` rope key shared by every head; kv_b(norm(
    latent)) = per head a `qk_nope_head_dim` key part and a `v_head_dim` value."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # The KV cache holds the latent (one kv head of kv_lora_rank + qk_rope_head_dim, kv_b_proj absorbed into the
    # queries and the output: models/deepseek.py); False: every head's K and V, attention as plain MHA
    latent_cache: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def cache_geometry(self, num_heads: int) -> tuple[int, int]:
        """(kv heads, head_dim) of the KV cache: latent, 1 x (kv_lora_rank + qk_rope_head_dim), shared by every
        head (and whole on every rank); MHA, every head at one width, max(qk_head_dim, v_head_dim)."""
        if self.latent_cache:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return num_heads, max(self.qk_head_dim, self.v_head_dim)

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "MLADims":
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(c.get(key), int) or c[key] <= 0:
                raise ValueError(f"a DeepSeek config needs a positive integer {key} (got {c.get(key)!r})")
        if c["qk_rope_head_dim"] % 2:
            raise ValueError(f"qk_rope_head_dim must be even (got {c['qk_rope_head_dim']})")
        return cls(c.get("q_lora_rank") or None, c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                   c["v_head_dim"])


# vLLM's `classifier_from_token` methods: a causal LM served as a sequence classifier whose score head is made of
# its LM head's rows for those tokens: "from_2_way_softmax" (two tokens [false, true]: one label, the logit
# difference true - false, whose sigmoid is the softmax of the pair: Qwen3-Reranker's yes / no, mxbai-rerank-v2's
# 1 / 0); "no_post_processing" (one label per token: the tokens' own logits, bge-reranker-v2-gemma's "Yes").
CLASSIFIER_FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")


def head_from_tokens(c: dict[str, Any]) -> tuple[list[str], str]:
    """(the labels' token strings, the method) of a config with `classifier_from_token` (set through hf_overrides,
    as vLLM's); checked. `is_original_qwen3_reranker` means ["no", "yes"] by the 2-way softmax."""
    tokens = c.get("classifier_from_token")
    method = c.get("method") or ("from_2_way_softmax" if c.get("is_original_qwen3_reranker")
                                 or (isinstance(tokens, list) and len(tokens) == 2) else "no_post_processing")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    if method not in CLASSIFIER_FROM_TOKEN_METHODS:
        raise ValueError(f"method must be one of {CLASSIFIER_FROM_TOKEN_METHODS} for classifier_from_token, got "
                         f"{method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"classifier_from_token with method from_2_way_softmax takes two tokens [false, true], got "
                         f"{tokens!r}")
    return (["true"] if method == "from_2_way_softmax" else tokens), method


def _quantization(qc: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    from streamer.models.quant import check_quantization  # (imports torch: this module does not)
    return check_quantization(qc)


def with_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json as `hf_overrides` (vLLM's) amends it: each key's value replaces the file's, except inside a
    nested model's config (`text_config`, `vision_config`, ...: a key ending in "_config" whose value is an object
    in both), whose keys are amended one by one the same way. A null value sets null (as if the key were absent)."""
    out = dict(config)
    for key, value in overrides.items():
        if key.endswith("_config") and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = with_overrides(out[key], value)
        else:
            _check_override(key, out.get(key), value)
            out[key] = value
    return out


# Sizes a model cannot have zero or fewer of
_POSITIVE = ("max_position_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size")


def _check_override(key: str, old: Any, new: Any) -> None:
    """ValueError for an override of another kind than the file's value (a number for a number, ...), or a size
    below 1: caught here, with the key's name, rather than deep inside the model's construction."""
    kinds = {bool: (bool,), int: (int, float), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
    want = next((k for t, k in kinds.items() if type(old) is t), None)
    fraction = type(old) is int and isinstance(new, float) and not new.is_integer()  # (1e6 for 1000000 is fine)
    if want is not None and new is not None and (type(new) not in want or fraction):
        raise ValueError(f"hf_overrides: {key} is {type(old).__name__} in config.json ({old!r}), got {new!r}")
    if key in _POSITIVE and new is not None and (not isinstance(new, int) or isinstance(new, bool) or new < 1):
        raise ValueError(f"hf_overrides: {key} must be a positive integer, got {new!r}")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; most others with config.attention_bias)
    o_proj_bias: bool  # and on o_proj (the same families with config.attention_bias; never Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    sliding_window: Optional[int]
    torch_dtype: str
    bos_token_id: Optional[int] = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    quantization: Optional[dict[str, Any]] = None  # an FP8 checkpoint's quantization_config (models/quant.py)
    partial_rotary_factor: float = 1.0  # the share of each head that rotates (Phi-4-mini: 0.75); the rest passes
    # A vision-language checkpoint's outer config.json (vision_config, image_token_index, ...; models/vlm.py);
    # everything above then describes its text model. None for a text-only model.
    multimodal: Optional[dict[str, Any]] = field(default=None, repr=False)
    # M-RoPE (Qwen2-VL): how many of the rotary frequencies take the temporal, height and width positions;
    # `mrope_interleaved` (Qwen3-VL, Qwen3.5): they cycle t, h, w (layers.py RotaryEmbedding.use_mrope)
    mrope_section: Optional[list[int]] = None
    mrope_interleaved: bool = False
    num_labels: Optional[int] = None  # a sequence classifier's labels (its score head's rows); None: not one
    # DeepSeek's latent attention; num_kv_heads and head_dim are then the KV cache's (MLADims.cache_geometry)
    mla: Optional[MLADims] = None
    # The vision-language architecture whose text model this is, served alone (TEXT_ONLY_ARCHITECTURES); None else
    text_only_of: Optional[str] = None
    # "mtp": build the checkpoint's multi-token-prediction layer as a speculative head (models/mtp.py), not the model
    draft_head: Optional[str] = None

    def with_mla_cache(self, latent: bool) -> "ModelConfig":
        """This config with DeepSeek's latent KV cache (True) or the per-head MHA cache (False), and the cache
        geometry that goes with it; any other model's config unchanged."""
        if self.mla is None or self.mla.latent_cache == latent:
            return self
        mla = replace(self.mla, latent_cache=latent)
        kv_heads, head_dim = mla.cache_geometry(self.num_heads)
        return replace(self, mla=mla, num_kv_heads=kv_heads, head_dim=head_dim)

    @property
    def multimodal_architecture(self) -> Optional[str]:
        mm = self.multimodal
        return None if mm is None else next(a for a in mm["architectures"] if a in MULTIMODAL_ARCHITECTURES)

    @property
    def image_token_id(self) -> Optional[int]:
        mm, arch = self.multimodal, self.multimodal_architecture
        if mm is None or arch is None:
            return None
        for key in ("image_token_index", "image_token_id", "audio_token_index", "audio_token_id"):
            if mm.get(key) is not None:
                return int(mm[key])
        return _IMAGE_TOKEN[arch]

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotary rotates (as transformers: int(head_dim * factor)); MLA: the
        rope part's width (models/deepseek.py rotates only that part)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def bidirectional(self) -> bool:
        """An encoder: every token attends to its whole prompt (BERT-family models, EmbeddingGemma)."""
        # (Gemma 4's "vision": only image tokens see each other both ways, models/vlm.py)
        return self.architecture in ENCODER_MODELS or self.raw.get("use_bidirectional_attention") in (True, "all")

    @classmethod
    def from_dir(cls, path: str | Path, overrides: Optional[dict[str, Any]] = None) -> "ModelConfig":
        """A folder's config.json, with `overrides` (the engine's `hf_overrides`) applied first."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        cfg_file = path / "config.json"
        from streamer.tokenizer.mistral_format import hf_config, is_mistral_folder
        if is_mistral_folder(path):  # Mistral's own format: params.json (streamer/tokenizer/mistral_format.py)
            raw = hf_config(path)
        elif not cfg_file.is_file():
            raise FileNotFoundError(f"config.json not found in model folder {path} (nor Mistral's params.json)")
        else:
            with open(cfg_file) as f:
                raw = json.load(f)
        return cls.from_dict(with_overrides(raw, overrides) if overrides else raw)

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "ModelConfig":
        archs = c.get("architectures") or []
        text_only = next((a for a in archs if a in TEXT_ONLY_ARCHITECTURES), None)
        if text_only is not None and (text_only not in MULTIMODAL_ARCHITECTURES or not c.get("vision_config")):
            return cls._text_only(c, text_only)
        if any(a in MULTIMODAL_ARCHITECTURES for a in archs):
            return cls._multimodal(c)
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and any(a in BACKBONES for a in archs):
            arch = next(BACKBONES[a] for a in archs if a in BACKBONES)
            c = dict(c, tie_word_embeddings=True)
        num_labels = None
        if arch is None and any(a in SEQUENCE_CLASSIFIERS for a in archs):
            arch = next(SEQUENCE_CLASSIFIERS[a] for a in archs if a in SEQUENCE_CLASSIFIERS)
            c = dict(c, tie_word_embeddings=True)  # no LM head to load
            # (transformers writes id2label, not num_labels, and neither for its default of 2)
            num_labels = len(c.get("id2label") or {}) or int(c.get("num_labels") or 2)
            if c.get("classifier_from_token") is not None:  # (a causal LM's head rows as its score head)
                num_labels = len(head_from_tokens(c)[0])
        if c.get("classifier_from_token") is not None and num_labels is None:
            raise ValueError("classifier_from_token makes a causal LM's head rows a sequence classifier's score head: "
                             "give a *ForSequenceClassification architecture too (hf_overrides: {\"architectures\": "
                             "[\"Qwen3ForSequenceClassification\"], ...})")
        if arch is None and any(a in ENCODER_ARCHITECTURES for a in archs):
            family, classifier = next(ENCODER_ARCHITECTURES[a] for a in archs if a in ENCODER_ARCHITECTURES)
            c, arch = encoder_config(c, family)  # (models/family_configs.py)
            num_labels = (len(c.get("id2label") or {}) or int(c.get("num_labels") or 2)) if classifier else None
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES + tuple(SEQUENCE_CLASSIFIERS) + tuple(ENCODER_ARCHITECTURES))}")
        for old, new in _KEY_ALIASES.get(arch, {}).items():  # (an older spelling, unless the newer one is given)
            if c.get(old) is not None and new not in c and new not in (c.get("rope_parameters") or {}):
                c = dict(c, **{new: c[old]})
        if arch in FAMILY_CONFIGS:  # (a family that spells the common keys its own way: models/family_configs.py)
            c = FAMILY_CONFIGS[arch](c)
        num_heads = c["num_attention_heads"]
        hidden = c["hidden_size"]
        rope = c.get("rope_parameters") or {}
        scaling = rope_scaling(c.get("rope_scaling"), rope)
        if scaling is not None and scaling["rope_type"] in ("longrope", "su"):
            # LongRoPE needs the lengths kept at the config's top level.
            scaling.setdefault("original_max_position_embeddings", c.get("original_max_position_embeddings"))
            scaling.setdefault("max_position_embeddings", c.get("max_position_embeddings"))
        if scaling is not None and scaling["rope_type"] == "yarn":
            # As transformers: a top-level original length wins over the rope dict's; without either, the model's.
            length = c.get("max_position_embeddings", 2048)
            if c.get("original_max_position_embeddings"):
                scaling["original_max_position_embeddings"] = c["original_max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", length)
            scaling.setdefault("max_position_embeddings", length)
        defaults = _ARCH_DEFAULTS.get(arch, {})
        partial = float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                        or defaults.get("partial_rotary_factor", 1.0))
        eos = c.get("eos_token_id")
        mla = MLADims.from_dict(c) if arch in MLA_ARCHITECTURES else None
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or (arch not in NO_ATTENTION_BIAS and bool(
            c.get("attention_bias", defaults.get("attention_bias", arch == "GptOssForCausalLM"))))
        sliding = c.get("sliding_window")
        if is_qwen2 or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM"):
            # Qwen (and SmolLM3) configs carry a sliding_window value that only applies when use_sliding_window is
            # set (SmolLM3: on its layer_types' sliding layers only, models/smollm3.py).
            sliding = sliding if c.get("use_sliding_window", False) else None
        mla_kv_heads, mla_head_dim = mla.cache_geometry(num_heads) if mla else (0, 0)
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=hidden,
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            # MLA: the cache's geometry (config.json's num_key_value_heads, 128 in V3's, plays no part, and its
            # head_dim is the rope part's)
            num_kv_heads=mla_kv_heads if mla else c.get("num_key_value_heads") or num_heads,
            head_dim=mla_head_dim if mla else c.get("head_dim") or defaults.get("head_dim") or hidden // num_heads,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            rms_norm_eps=c.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta", rope.get("rope_theta", defaults.get("rope_theta", 10000.0)))),
            rope_scaling=scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", defaults.get(
                "tie_word_embeddings", arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")))),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and arch not in NO_O_PROJ_BIAS,
            # (GLM-4.5's with use_qk_norm)
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or (
                arch == "Glm4MoeForCausalLM" and bool(c.get("use_qk_norm"))),
            sliding_window=sliding,
            torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
            raw=c,
            quantization=_quantization(c.get("quantization_config")),
            partial_rotary_factor=partial,
            num_labels=num_labels,
            mla=mla,
        )

    @classmethod
    def _text_only(cls, c: dict[str, Any], arch: str) -> "ModelConfig":
        """A vision-language config served as its text model: text_config (with the outer config's say on the
        dtype, quantization, tying and special tokens), marked `text_only_of`."""
        if not c.get("text_config"):
            raise ValueError(f"{arch} config.json has no text_config")
        text = {**c["text_config"], "architectures": [TEXT_ONLY_ARCHITECTURES[arch]]}
        for key in ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings", "eos_token_id",
                    "bos_token_id"):
            if c.get(key) is not None:
                text[key] = c[key]
        cfg = cls.from_dict(text)
        cfg.text_only_of = arch
        return cfg

    @classmethod
    def _multimodal(cls, c: dict[str, Any]) -> "ModelConfig":
        """A LLaVA-style config: the text model's own config (nested, with the defaults real configs leave out)
        plus the outer one under `multimodal`."""
        arch = next(a for a in c["architectures"] if a in MULTIMODAL_ARCHITECTURES)
        # (older Qwen2-VL configs keep the text model's fields at the top level)
        text = dict(c.get("text_config") or ({k: v for k, v in c.items() if k != "vision_config"}
                                             if arch.startswith(("Qwen2VL", "Qwen2_5")) else
                                             _DEFAULT_TEXT_CONFIG.get(arch, {})))
        model_type = text.get("model_type", "llama")
        if model_type not in _TEXT_ARCHS:
            raise ValueError(f"unsupported text model {model_type!r} in a vision-language checkpoint; supported: "
                             f"{', '.join(_TEXT_ARCHS)}")
        text = {**_TEXT_DEFAULTS.get(model_type, {}), **text, "architectures": [_TEXT_ARCHS[model_type]]}
        if model_type == "qwen3_vl_moe_text":  # (its router always renormalises the top-k weights)
            text["norm_topk_prob"] = True
        if arch == "InternVLForConditionalGeneration":  # (InternVLConfig ties the head unless a config says not)
            text.setdefault("tie_word_embeddings", True)
        for key in ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings", "eos_token_id",
                    "bos_token_id"):
            if c.get(key) is not None:  # the outer config's say for the whole model
                text[key] = c[key]
        kinds = _VISION_TYPES[arch]
        vision = (c.get("vision_config") or c.get("audio_config") or {}).get("model_type", kinds[0])
        if vision not in kinds:
            raise ValueError(f"unsupported vision encoder {vision!r} for {arch}; supported: {', '.join(kinds)}")
        cfg = cls.from_dict(text)
        cfg.multimodal = c
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if rope.get("mrope_section"):
            cfg.mrope_section = [int(x) for x in rope["mrope_section"]]
        elif arch.startswith("Qwen3VL"):  # (Qwen3VLTextRotaryEmbedding's default)
            cfg.mrope_section = [24, 20, 20]
        elif arch.startswith("Qwen3_5"):  # (Qwen3_5TextRotaryEmbedding's)
            cfg.mrope_section = [11, 11, 10]
        # (transformers' Qwen3-VL and Qwen3.5 rotary embeddings interleave whatever mrope_interleaved says)
        cfg.mrope_interleaved = arch.startswith(("Qwen3VL", "Qwen3_5"))
        return cfg

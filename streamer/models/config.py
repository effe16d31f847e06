"""The model's shape, read from a Hugging Face config.json (both the classic and the transformers-5 spelling)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from streamer.models import registry

# A vision-language checkpoint's text model (by text_config.model_type: registry.TEXT_MODEL_TYPES names its
# architecture) with what transformers' config classes default to: real LLaVA configs (llava-1.5) leave its sizes out.
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
    # The vision-language architecture whose text model this is, served alone (a registry `Served` GENERATE name);
    # None else
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
        return None if mm is None else next(a for a in mm["architectures"] if a in registry.VISION_LANGUAGE)

    @property
    def image_token_id(self) -> Optional[int]:
        mm, arch = self.multimodal, self.multimodal_architecture
        if mm is None or arch is None:
            return None
        for key in ("image_token_index", "image_token_id", "audio_token_index", "audio_token_id"):
            if mm.get(key) is not None:
                return int(mm[key])
        return registry.VISION_LANGUAGE[arch].image_token

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
        if self.raw.get("use_bidirectional_attention") in (True, "all"):
            return True
        model = registry.MODELS.get(self.architecture)
        return model is not None and model.bidirectional

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
        """config.json's dict, read as the registry's model for its `architectures` (models/registry.py)."""
        archs = c.get("architectures") or []
        # a vision-language checkpoint served as its text model (Gemma 4's only without a vision_config)
        hit = _first_served(archs, lambda e, s: s.task == registry.GENERATE and s.name != e.architecture)
        if hit is not None and (hit[1].name not in registry.VISION_LANGUAGE or not c.get("vision_config")):
            return cls._text_only(c, hit[1].name, hit[0].architecture)
        if any(a in registry.VISION_LANGUAGE for a in archs):
            return cls._multimodal(c)
        hit = _first_served(archs, lambda e, s: s.task == registry.GENERATE)
        if hit is None:  # a decoder family's bare backbone: its LM head, if asked for, is the embedding matrix
            hit = _first_served(archs, lambda e, s: s.task == registry.EMBED and e.kind == registry.DECODER)
            if hit is not None:
                c = dict(c, tie_word_embeddings=True)
        num_labels = None
        if hit is None:  # a decoder family's sequence classifier: a score head in place of the LM head
            hit = _first_served(archs, lambda e, s: s.task == registry.CLASSIFY and e.kind == registry.DECODER)
            if hit is not None:
                c = dict(c, tie_word_embeddings=True)  # no LM head to load
                # (transformers writes id2label, not num_labels, and neither for its default of 2)
                num_labels = len(c.get("id2label") or {}) or int(c.get("num_labels") or 2)
                if c.get("classifier_from_token") is not None:  # (a causal LM's head rows as its score head)
                    num_labels = len(head_from_tokens(c)[0])
        if c.get("classifier_from_token") is not None and num_labels is None:
            raise ValueError("classifier_from_token makes a causal LM's head rows a sequence classifier's score head: "
                             "give a *ForSequenceClassification architecture too (hf_overrides: {\"architectures\": "
                             "[\"Qwen3ForSequenceClassification\"], ...})")
        if hit is None:  # an encoder (BERT-style): embeddings, or a classifier
            hit = _first_served(archs, lambda e, s: e.kind == registry.ENCODER)
            if hit is not None and hit[1].task == registry.CLASSIFY:
                num_labels = len(c.get("id2label") or {}) or int(c.get("num_labels") or 2)
        if hit is None:
            supported = (name for name, e, s in registry.names() if e is None or s.task != registry.DRAFT)
            raise ValueError(f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                             f"{', '.join(dict.fromkeys(supported))}")
        model, served = hit
        arch = model.architecture
        for old, new in model.aliases.items():  # (an older spelling, unless the newer one is given)
            if c.get(old) is not None and new not in c and new not in (c.get("rope_parameters") or {}):
                c = dict(c, **{new: c[old]})
        to_common = served.config or model.config
        if to_common is not None:  # (a family that spells the common keys its own way: models/family_configs.py)
            c = to_common(c)
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
        defaults = model.defaults
        partial = float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                        or defaults.get("partial_rotary_factor", 1.0))
        eos = c.get("eos_token_id")
        mla = MLADims.from_dict(c) if model.mla else None
        attention_bias = model.attention_bias if model.attention_bias is not None else bool(
            c.get("attention_bias", defaults.get("attention_bias", False)))
        sliding = c.get("sliding_window")
        if model.sliding_window_flag is not None:
            # Qwen (and SmolLM3) configs carry a sliding_window value that only applies when use_sliding_window is
            # set (SmolLM3: on its layer_types' sliding layers only, models/smollm3.py).
            sliding = sliding if c.get(model.sliding_window_flag, False) else None
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
            tie_word_embeddings=bool(c.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and model.o_proj_bias,
            # (GLM-4.5's with use_qk_norm)
            qk_norm=model.qk_norm is True or (isinstance(model.qk_norm, str) and bool(c.get(model.qk_norm))),
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
    def _text_only(cls, c: dict[str, Any], arch: str, text_arch: str) -> "ModelConfig":
        """A vision-language config served as its text model: text_config (with the outer config's say on the
        dtype, quantization, tying and special tokens), marked `text_only_of`."""
        if not c.get("text_config"):
            raise ValueError(f"{arch} config.json has no text_config")
        text = {**c["text_config"], "architectures": [text_arch]}
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
        arch = next(a for a in c["architectures"] if a in registry.VISION_LANGUAGE)
        vl = registry.VISION_LANGUAGE[arch]
        # (older Qwen2-VL configs keep the text model's fields at the top level)
        text = dict(c.get("text_config") or ({k: v for k, v in c.items() if k != "vision_config"}
                                             if vl.flat_config else vl.default_text_config))
        model_type = text.get("model_type", "llama")
        text_arch = registry.TEXT_MODEL_TYPES.get(model_type)
        if text_arch is None:
            raise ValueError(f"unsupported text model {model_type!r} in a vision-language checkpoint; supported: "
                             f"{', '.join(registry.TEXT_MODEL_TYPES)}")
        text = {**_TEXT_DEFAULTS.get(model_type, {}), **text, "architectures": [text_arch]}
        if model_type == "qwen3_vl_moe_text":  # (its router always renormalises the top-k weights)
            text["norm_topk_prob"] = True
        for key, value in vl.text_config_defaults.items():  # (InternVLConfig ties the head unless a config says not)
            text.setdefault(key, value)
        for key in ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings", "eos_token_id",
                    "bos_token_id"):
            if c.get(key) is not None:  # the outer config's say for the whole model
                text[key] = c[key]
        kinds = vl.encoders
        vision = (c.get("vision_config") or c.get("audio_config") or {}).get("model_type", kinds[0])
        if vision not in kinds:
            raise ValueError(f"unsupported vision encoder {vision!r} for {arch}; supported: {', '.join(kinds)}")
        cfg = cls.from_dict(text)
        cfg.multimodal = c
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        if rope.get("mrope_section"):
            cfg.mrope_section = [int(x) for x in rope["mrope_section"]]
        elif vl.mrope_section is not None:  # (Qwen3VLTextRotaryEmbedding's default, Qwen3_5TextRotaryEmbedding's)
            cfg.mrope_section = list(vl.mrope_section)
        cfg.mrope_interleaved = vl.mrope_interleaved
        return cfg


def _first_served(archs: list[str], want: Callable[[registry.ModelEntry, registry.Served], bool],
                  ) -> Optional[tuple[registry.ModelEntry, registry.Served]]:
    """The first of config.json's architectures that a registry model serves as `want` asks."""
    for name in archs:
        hit = registry.served(name)
        if hit is not None and want(*hit):
            return hit
    return None

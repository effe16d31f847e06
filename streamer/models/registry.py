"""The model registry: every architecture name the engine accepts, the model class that serves it, and what that
model supports. The one place a family is added (with its model file, and its config translation in
models/family_configs.py if it needs one); docs/models.md lists the same names (tests/test_docs_models.py).

A `ModelEntry` names its class by module and class name and imports it on first use (`ModelEntry.model_class`), as
vLLM's lazy registry does: loading one model imports that model's file and no other family's. This module imports
neither torch nor any model file, so `ModelConfig` (models/config.py, which dispatches on it) does not either.

Three kinds of names:
- `MODELS`: a model class the loader builds, by `ModelConfig.architecture` (config.json's name for most). Each
  entry also lists the other config.json names its class serves (`Served`: a decoder's bare backbone for
  embeddings, its sequence classifier, a vision-language checkpoint served as its text model; an encoder's
  classifier and masked-LM spellings, RoBERTa's names).
- `VISION_LANGUAGE`: a vision (or audio) encoder and projector in front of a text model (models/vlm.py): the
  architecture -> its mixin class, and the text families it wraps are those whose `vlm_text` lists the checkpoint's
  text_config.model_type.
- GGUF architectures (llama.cpp's names) are not here: models/gguf.py converts them to one of these.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from streamer.models.family_configs import (
    bert_config,
    bloom_config,
    falcon_config,
    gemma4_config,
    gpt2_config,
    gpt_bigcode_config,
    gptj_config,
    lfm2_config,
    mamba1_config,
    mamba2_config,
    modernbert_config,
    mpnet_config,
    mpt_config,
    nemotron_h_config,
    opt_config,
    qwen3_5_config,
    roberta_config,
    t5_config,
    whisper_config,
)

if TYPE_CHECKING:
    from streamer.models.config import ModelConfig

ConfigFn = Callable[[dict[str, Any]], dict[str, Any]]
_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _no_map() -> Any:
    return field(default_factory=lambda: _EMPTY)


# What a served name does (`Served.task`)
GENERATE, EMBED, CLASSIFY, DRAFT = "generate", "embed", "classify", "draft"
# A model's kind (`ModelEntry.kind`)
DECODER = "decoder"
ENCODER = "encoder"  # every token attends to its whole prompt; it only pools (BERT-style)
ENCODER_DECODER = "encoder-decoder"  # an encoder run once per request, its output held in the request's state slot
DRAFT_HEAD = "draft"  # a speculative head: loaded only as another model's draft (streamer/spec_decode/eagle.py)
# How a model splits over tensor-parallel ranks (`ModelEntry.tensor_parallel`)
HEADS = "heads"  # the attention heads split evenly; kv heads split, or are replicated when fewer than the ranks
OWN_CHECK = "own"  # its class's `check_tensor_parallel(cfg, tp)`: the heads, and its recurrent layers' heads too

_ENCODER_NO_TP = "not implemented for encoders (small models: one device serves them)"
_WHOLE_QK_NORM = "its q/k norms span all heads, which tensor parallelism splits over ranks"


@dataclass(frozen=True)
class Served:
    """A config.json architecture name a model class serves, and as what."""

    name: str
    task: str  # GENERATE, EMBED (pools: embeddings), CLASSIFY (a score head over the pooled state), DRAFT
    # its own config translation, in place of the model's (RoBERTa's position offset); None: the model's
    config: Optional[ConfigFn] = None


@dataclass(frozen=True)
class ModelEntry:
    """A model class, what it supports, and how its config.json is read."""

    architecture: str  # ModelConfig.architecture, and a config.json name it serves
    module: str  # its file, under streamer/models/
    cls: str = ""  # the class in it ("": named as the architecture)
    kind: str = DECODER
    served: tuple[Served, ...] = ()  # the other config.json names it serves
    # --- what it supports
    inputs: tuple[str, ...] = ("text",)  # what a prompt holds (Whisper: audio)
    # per-request recurrent state beside (hybrid) or instead of (pure recurrent) the KV cache: state slots, prefix
    # caching from checkpoints of that state (kv_cache.StateCheckpoints), no hybrid draft model
    recurrent_state: bool = False
    mla: bool = False  # multi-head latent attention (models/deepseek.py): K and V come out of a low-rank latent
    # multi-token prediction: the tensor only a checkpoint with the MTP layer has ({n}: the number of decoder
    # layers); `--speculative-method mtp` drafts with it (models/mtp.py). None: no MTP head
    mtp: Optional[str] = None
    # the text_config.model_type values for which it is a vision-language checkpoint's text model (models/vlm.py)
    vlm_text: tuple[str, ...] = ()
    tensor_parallel: str = HEADS  # how its layers split over ranks (HEADS or OWN_CHECK)
    no_tensor_parallel: Optional[str] = None  # why tensor parallelism is refused (before any worker starts)
    # a mixture of experts: the config.json keys that may give its routed experts' count, the family's own first
    # (transformers 5 writes some under another). Expert parallelism spreads these experts over the ranks.
    experts: tuple[str, ...] = ()
    # --- reading its config.json (ModelConfig.from_dict)
    config: Optional[ConfigFn] = None  # its translation into the common names (models/family_configs.py)
    defaults: Mapping[str, Any] = _no_map()  # transformers' config defaults that differ from Llama's
    aliases: Mapping[str, str] = _no_map()  # older spellings of common keys: old -> new
    # biases on q/k/v: None as config.attention_bias says; True always (Qwen2); False never
    attention_bias: Optional[bool] = None
    o_proj_bias: bool = True  # and on o_proj too, where q/k/v have them
    qk_norm: bool | str = False  # per-head RMSNorm on q and k; a str: the config flag that turns it on
    # the config flag without which its sliding_window is not applied (Qwen's use_sliding_window); None: none
    sliding_window_flag: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.cls:
            object.__setattr__(self, "cls", self.architecture)

    @property
    def task(self) -> str:
        """What its own architecture name does."""
        return {ENCODER: EMBED, DRAFT_HEAD: DRAFT}.get(self.kind, GENERATE)

    @property
    def bidirectional(self) -> bool:
        return self.kind == ENCODER

    def model_class(self) -> type:
        """The class, its module imported now if it was not yet."""
        return getattr(importlib.import_module(f"streamer.models.{self.module}"), self.cls)

    def routed_experts(self, cfg: "ModelConfig") -> Optional[tuple[str, Optional[int]]]:
        """(the config key, its routed experts' count) of a mixture-of-experts config; None for a dense model (not
        a mixture, or a config that sets its experts to 0 / null: Granite 4's dense hybrids). The count is None
        where the config leaves it to the family's default."""
        if not self.experts:
            return None
        given = [k for k in self.experts if k in cfg.raw]
        for key in given:
            n = cfg.raw[key]
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return key, n
        return None if given else (self.experts[0], None)

    def check_expert_parallel(self, cfg: "ModelConfig", tp: int) -> bool:
        """Expert parallelism over `tp` ranks (vLLM's --enable-expert-parallel): True if the model's sparse layers
        split by experts; False for a dense model (the flag has nothing to act on: the caller warns and ignores
        it, as vLLM does). ValueError, naming the field, where there are fewer experts than ranks."""
        experts = self.routed_experts(cfg)
        if experts is None:
            return False
        key, n = experts
        if n is not None and n < tp:
            raise ValueError(f"enable_expert_parallel: {key} {n} (the routed experts) is less than "
                             f"tensor_parallel_size {tp}: every rank must hold at least one expert")
        return True

    def check_tensor_parallel(self, cfg: "ModelConfig", tp: int) -> None:
        """ValueError unless a model of this config splits over `tp` ranks (the refusal, `no_tensor_parallel`,
        first)."""
        if self.no_tensor_parallel:
            raise ValueError(f"{self.architecture} does not support tensor parallelism: {self.no_tensor_parallel}")
        if self.tensor_parallel == OWN_CHECK:
            self.model_class().check_tensor_parallel(cfg, tp)
        elif cfg.num_heads % tp or (cfg.num_kv_heads % tp and tp % cfg.num_kv_heads):
            raise ValueError(f"tensor_parallel_size {tp} does not split the model's {cfg.num_heads} attention "
                             f"heads / {cfg.num_kv_heads} kv heads evenly")

    def check_pipeline_parallel(self, cfg: "ModelConfig", pp: int) -> None:
        """ValueError unless a model of this config splits into `pp` pipeline stages: a decoder whose forward is the
        Llama family's (embeddings, then `run_layers`, which runs a stage's layers: models/llama.py), text only,
        with at least one decoder layer a stage."""
        cls = self.model_class()
        llama_forward = all(getattr(getattr(cls, name, None), "__qualname__", "") == f"LlamaForCausalLM.{name}"
                            for name in ("forward", "run_layers"))  # (by name: the registry imports no model file)
        why = ("its prompts attend both ways (an encoder)" if self.kind == ENCODER else
               "an encoder-decoder model" if self.kind == ENCODER_DECODER else
               "images and audio do not pass between stages yet" if cfg.multimodal_architecture is not None else
               "its forward is its own, not split into stages yet" if not llama_forward else
               f"{pp} stages for its {cfg.num_layers} decoder layers" if pp > cfg.num_layers else None)
        if why is not None:
            raise ValueError(f"pipeline_parallel_size {pp}: {self.architecture} does not split into pipeline "
                             f"stages: {why}")


@dataclass(frozen=True)
class VisionLanguage:
    """A vision-language (or audio-language) checkpoint: an encoder and projector in front of a text model."""

    architecture: str
    mixin: str  # its class in models/vlm.py, mixed in before the text model's class (vlm.vlm_class)
    encoders: tuple[str, ...]  # the vision_config (audio_config) model_types it takes; the first when none is given
    image_token: int  # the placeholder token's id when config.json gives none
    inputs: tuple[str, ...] = ("text", "images")
    # the text config when config.json has none (with its model_type); else the text model's class defaults
    default_text_config: Mapping[str, Any] = _no_map()
    text_config_defaults: Mapping[str, Any] = _no_map()  # what its config class sets in a text config leaving it out
    flat_config: bool = False  # older configs keep the text model's keys at the top level, with no text_config
    mrope_section: Optional[tuple[int, ...]] = None  # M-RoPE's split when the config gives none
    mrope_interleaved: bool = False  # M-RoPE's frequencies cycle t, h, w (layers.RotaryEmbedding.use_mrope)
    module: str = "vlm"

    def mixin_class(self) -> type:
        return getattr(importlib.import_module(f"streamer.models.{self.module}"), self.mixin)


def _d(**defaults: Any) -> Mapping[str, Any]:
    return MappingProxyType(defaults)


_HYBRID = dict(recurrent_state=True, tensor_parallel=OWN_CHECK)
_QWEN3_NEXT_MTP = "mtp.fc.weight"
_DEEPSEEK_MTP = "model.layers.{n}.eh_proj.weight"

_MODEL_LIST: tuple[ModelEntry, ...] = (
    # ------------------------------------------------------------------ dense text (most: models/llama.py's options)
    # (a bare backbone, `*Model`, serves embeddings; a `*ForSequenceClassification`, a score head over the last token)
    ModelEntry("LlamaForCausalLM", "llama", vlm_text=("llama",),
               served=(Served("LlamaModel", EMBED), Served("LlamaForSequenceClassification", CLASSIFY))),
    ModelEntry("MistralForCausalLM", "llama", "LlamaForCausalLM", vlm_text=("mistral",), attention_bias=False,
               served=(Served("MistralModel", EMBED), Served("MistralForSequenceClassification", CLASSIFY))),
    ModelEntry("Qwen2ForCausalLM", "llama", "LlamaForCausalLM",
               served=(Served("Qwen2Model", EMBED), Served("Qwen2ForSequenceClassification", CLASSIFY)),
               # (Qwen2-VL's text model is Qwen2's with M-RoPE; older configs keep its fields at the top level)
               vlm_text=("qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen2_vl", "qwen2_5_vl"),
               attention_bias=True, o_proj_bias=False, sliding_window_flag="use_sliding_window"),
    ModelEntry("Qwen3ForCausalLM", "llama", "LlamaForCausalLM",
               served=(Served("Qwen3Model", EMBED), Served("Qwen3ForSequenceClassification", CLASSIFY)),
               vlm_text=("qwen3", "qwen3_vl_text"),  # (Qwen3-VL's: interleaved M-RoPE and DeepStack, models/vlm.py)
               qk_norm=True, sliding_window_flag="use_sliding_window"),
    ModelEntry("Phi3ForCausalLM", "llama", "LlamaForCausalLM", attention_bias=False),
    ModelEntry("GemmaForCausalLM", "gemma", defaults=_d(tie_word_embeddings=True, head_dim=256)),
    ModelEntry("Gemma2ForCausalLM", "gemma3", defaults=_d(tie_word_embeddings=True)),
    ModelEntry("Gemma3ForCausalLM", "gemma3", served=(Served("Gemma3TextModel", EMBED),), vlm_text=("gemma3_text",),
               defaults=_d(tie_word_embeddings=True)),
    # (Gemma 4's vision-language checkpoints without a vision_config are served as their text model)
    ModelEntry("Gemma4ForCausalLM", "gemma4", served=(Served("Gemma4ForConditionalGeneration", GENERATE),),
               vlm_text=("gemma4_text",), config=gemma4_config),
    ModelEntry("GraniteForCausalLM", "granite"),
    ModelEntry("Olmo2ForCausalLM", "olmo2", no_tensor_parallel=_WHOLE_QK_NORM),
    ModelEntry("Olmo3ForCausalLM", "olmo3", no_tensor_parallel=_WHOLE_QK_NORM,
               defaults=_d(rope_theta=500_000.0, rms_norm_eps=1e-5)),
    ModelEntry("Glm4ForCausalLM", "glm4", defaults=_d(partial_rotary_factor=0.5, attention_bias=True),
               o_proj_bias=False),
    ModelEntry("SmolLM3ForCausalLM", "smollm3", defaults=_d(rope_theta=2_000_000.0, tie_word_embeddings=True),
               # (on its layer_types' sliding layers only, models/smollm3.py)
               sliding_window_flag="use_sliding_window"),
    ModelEntry("Exaone4ForCausalLM", "exaone4", defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("Ernie4_5ForCausalLM", "ernie4_5", defaults=_d(rope_theta=500_000.0, tie_word_embeddings=True,
                                                              head_dim=128, rms_norm_eps=1e-5)),
    ModelEntry("SeedOssForCausalLM", "seed_oss", defaults=_d(attention_bias=True, head_dim=128)),
    ModelEntry("ArceeForCausalLM", "arcee", defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("ApertusForCausalLM", "apertus", defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("HunYuanDenseV1ForCausalLM", "hunyuan_dense", defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("MinistralForCausalLM", "ministral"),
    ModelEntry("Ministral3ForCausalLM", "ministral", vlm_text=("ministral3",), attention_bias=False),
    ModelEntry("CohereForCausalLM", "cohere", defaults=_d(rope_theta=500_000.0, tie_word_embeddings=True)),
    ModelEntry("Cohere2ForCausalLM", "cohere", defaults=_d(tie_word_embeddings=True)),
    ModelEntry("Starcoder2ForCausalLM", "starcoder2", defaults=_d(tie_word_embeddings=True)),
    # ------------------------------------------------------------------ classic families
    ModelEntry("GPTNeoXForCausalLM", "gpt_neox", defaults=_d(partial_rotary_factor=0.25, attention_bias=True),
               aliases=_d(rotary_pct="partial_rotary_factor", rotary_emb_base="rope_theta")),
    ModelEntry("PhiForCausalLM", "phi", defaults=_d(partial_rotary_factor=0.5)),
    ModelEntry("StableLmForCausalLM", "stablelm", defaults=_d(partial_rotary_factor=0.25)),
    ModelEntry("GPTBigCodeForCausalLM", "gpt_bigcode", config=gpt_bigcode_config),
    ModelEntry("GPT2LMHeadModel", "gpt2", config=gpt2_config),
    ModelEntry("FalconForCausalLM", "falcon", config=falcon_config),
    ModelEntry("GPTJForCausalLM", "gptj", config=gptj_config),
    ModelEntry("OPTForCausalLM", "opt", config=opt_config),
    ModelEntry("OlmoForCausalLM", "olmo"),
    ModelEntry("NemotronForCausalLM", "nemotron", defaults=_d(partial_rotary_factor=0.5, rms_norm_eps=1e-5),
               aliases=_d(norm_eps="rms_norm_eps")),  # (rms_norm_eps: its LayerNorms')
    ModelEntry("BloomForCausalLM", "bloom", config=bloom_config),
    ModelEntry("MPTForCausalLM", "mpt", "MptForCausalLM", config=mpt_config),  # (MosaicML's own checkpoints' spelling)
    ModelEntry("MptForCausalLM", "mpt", config=mpt_config),  # (transformers')
    # ------------------------------------------------------------------ mixture of experts
    ModelEntry("MixtralForCausalLM", "llama", "LlamaForCausalLM", attention_bias=False),
    ModelEntry("Qwen3MoeForCausalLM", "llama", "LlamaForCausalLM", vlm_text=("qwen3_vl_moe_text", "qwen3_moe"),
               qk_norm=True, sliding_window_flag="use_sliding_window"),  # (qwen3_moe: InternVL3.5's MoE models)
    ModelEntry("GptOssForCausalLM", "gpt_oss", defaults=_d(attention_bias=True)),
    # (Llama 4 is released as Llama4ForConditionalGeneration: served as its text model, vision weights skipped)
    ModelEntry("Llama4ForCausalLM", "llama4", served=(Served("Llama4ForConditionalGeneration", GENERATE),)),
    ModelEntry("DeepseekV2ForCausalLM", "deepseek", "DeepseekForCausalLM", mla=True),
    ModelEntry("DeepseekV3ForCausalLM", "deepseek", "DeepseekForCausalLM", mla=True, mtp=_DEEPSEEK_MTP),
    ModelEntry("Glm4MoeForCausalLM", "glm4", mtp=_DEEPSEEK_MTP, defaults=_d(partial_rotary_factor=0.5),
               o_proj_bias=False, qk_norm="use_qk_norm"),
    ModelEntry("Qwen2MoeForCausalLM", "qwen2_moe"),
    ModelEntry("OlmoeForCausalLM", "olmoe", no_tensor_parallel=_WHOLE_QK_NORM, defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("GraniteMoeForCausalLM", "granite_moe"),
    ModelEntry("GraniteMoeSharedForCausalLM", "granite_moe", "GraniteMoeForCausalLM"),
    ModelEntry("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", defaults=_d(rope_theta=500_000.0, tie_word_embeddings=True,
                                                                      rms_norm_eps=1e-5)),
    ModelEntry("HunYuanMoEV1ForCausalLM", "hunyuan_moe", defaults=_d(rms_norm_eps=1e-5)),
    ModelEntry("PhimoeForCausalLM", "phimoe", defaults=_d(rope_theta=1_000_000.0, rms_norm_eps=1e-5)),
    # ------------------------------------------------------------------ hybrid and pure recurrent (models/mamba.py)
    ModelEntry("GraniteMoeHybridForCausalLM", "granite_hybrid", **_HYBRID),
    ModelEntry("BambaForCausalLM", "granite_hybrid", **_HYBRID,
               defaults=_d(partial_rotary_factor=0.5)),  # (hard-coded by transformers' BambaConfig)
    ModelEntry("NemotronHForCausalLM", "nemotron_h", **_HYBRID, mtp="mtp.layers.0.eh_proj.weight",
               config=nemotron_h_config),
    ModelEntry("Qwen3NextForCausalLM", "qwen3_next", **_HYBRID, mtp=_QWEN3_NEXT_MTP,
               defaults=_d(partial_rotary_factor=0.25)),
    # (Qwen3.5's: Qwen3-Next's hybrid (models/qwen3_5.py); as a vision-language text model with interleaved M-RoPE)
    ModelEntry("Qwen3_5ForCausalLM", "qwen3_5", "Qwen35ForCausalLM", **_HYBRID, mtp=_QWEN3_NEXT_MTP,
               vlm_text=("qwen3_5_text",), config=qwen3_5_config, defaults=_d(partial_rotary_factor=0.25)),
    ModelEntry("Qwen3_5MoeForCausalLM", "qwen3_5", "Qwen35ForCausalLM", **_HYBRID, mtp=_QWEN3_NEXT_MTP,
               vlm_text=("qwen3_5_moe_text",), config=qwen3_5_config, defaults=_d(partial_rotary_factor=0.25)),
    ModelEntry("FalconH1ForCausalLM", "falcon_h1", **_HYBRID),
    ModelEntry("Lfm2ForCausalLM", "lfm2", **_HYBRID, config=lfm2_config),
    ModelEntry("Lfm2MoeForCausalLM", "lfm2", "Lfm2ForCausalLM", **_HYBRID,
               config=lfm2_config),  # (its sparse layers by cfg.architecture)
    ModelEntry("Mamba2ForCausalLM", "mamba2", **_HYBRID, config=mamba2_config),
    ModelEntry("MambaForCausalLM", "mamba1", **_HYBRID, config=mamba1_config),
    ModelEntry("FalconMambaForCausalLM", "mamba1", "MambaForCausalLM", **_HYBRID,
               config=mamba1_config),  # (its B / C / dt norms by cfg.architecture)
    # ------------------------------------------------------------------ speech to text
    # (held in a state slot as the hybrids' state: eager, no speculative decoding; no prefix caching)
    ModelEntry("WhisperForConditionalGeneration", "whisper", kind=ENCODER_DECODER, inputs=("audio",),
               no_tensor_parallel="not implemented for Whisper (its largest model fits one device)",
               config=whisper_config),
    # ------------------------------------------------------------------ encoders (embeddings, classifiers)
    # BERT and (XLM-)RoBERTa: one class; a masked-LM checkpoint serves as an embedding model (its LM head skipped)
    ModelEntry("BertModel", "bert", kind=ENCODER, no_tensor_parallel=_ENCODER_NO_TP, config=bert_config, served=(
        Served("BertForSequenceClassification", CLASSIFY),
        Served("BertForMaskedLM", EMBED),
        Served("RobertaModel", EMBED, roberta_config),
        Served("RobertaForSequenceClassification", CLASSIFY, roberta_config),
        Served("RobertaForMaskedLM", EMBED, roberta_config),
        Served("XLMRobertaModel", EMBED, roberta_config),
        Served("XLMRobertaForSequenceClassification", CLASSIFY, roberta_config),
        Served("XLMRobertaForMaskedLM", EMBED, roberta_config))),
    ModelEntry("ModernBertModel", "modernbert", kind=ENCODER, no_tensor_parallel=_ENCODER_NO_TP,
               config=modernbert_config, served=(Served("ModernBertForSequenceClassification", CLASSIFY),)),
    ModelEntry("MPNetModel", "mpnet", kind=ENCODER, no_tensor_parallel=_ENCODER_NO_TP, config=mpnet_config,
               served=(Served("MPNetForMaskedLM", EMBED), Served("MPNetForSequenceClassification", CLASSIFY))),
    ModelEntry("T5EncoderModel", "t5", kind=ENCODER, no_tensor_parallel=_ENCODER_NO_TP, config=t5_config),
    # ------------------------------------------------------------------ speculative heads (models/eagle.py)
    ModelEntry("EagleLlamaForCausalLM", "eagle", "EagleDraftModel", kind=DRAFT_HEAD),
    ModelEntry("Eagle3LlamaForCausalLM", "eagle", "EagleDraftModel", kind=DRAFT_HEAD,
               served=(Served("LlamaForCausalLMEagle3", DRAFT),)),
)

_QWEN2_VL = ("text", "images", "video")
_VISION_LIST: tuple[VisionLanguage, ...] = (
    VisionLanguage("LlavaForConditionalGeneration", "LlavaMixin", ("clip_vision_model", "siglip_vision_model"), 32000),
    VisionLanguage("LlavaNextForConditionalGeneration", "LlavaNextMixin", ("clip_vision_model", "siglip_vision_model"),
                   32000),
    VisionLanguage("Gemma3ForConditionalGeneration", "Gemma3VisionMixin", ("siglip_vision_model",), 262144),
    # (with no vision_config, Gemma 4's are served as their text model: Gemma4ForCausalLM's `served`)
    VisionLanguage("Gemma4ForConditionalGeneration", "Gemma4VisionMixin", ("gemma4_vision",), 258_880),
    VisionLanguage("Qwen2VLForConditionalGeneration", "QwenVLMixin", ("qwen2_vl", "qwen2_vl_vision"), 151655,
                   _QWEN2_VL, flat_config=True),
    VisionLanguage("Qwen2_5_VLForConditionalGeneration", "QwenVLMixin", ("qwen2_5_vl", "qwen2_5_vl_vision"), 151655,
                   _QWEN2_VL, flat_config=True),
    # (transformers' Qwen3-VL and Qwen3.5 rotary embeddings interleave whatever mrope_interleaved says)
    VisionLanguage("Qwen3VLForConditionalGeneration", "Qwen3VLMixin", ("qwen3_vl", "qwen3_vl_vision"), 151655,
                   _QWEN2_VL, mrope_section=(24, 20, 20), mrope_interleaved=True),
    VisionLanguage("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMixin",
                   ("qwen3_vl_moe", "qwen3_vl_moe_vision", "qwen3_vl", "qwen3_vl_vision"), 151655, _QWEN2_VL,
                   mrope_section=(24, 20, 20), mrope_interleaved=True),
    VisionLanguage("Qwen3_5ForConditionalGeneration", "Qwen3VLMixin", ("qwen3_5_vision", "qwen3_5"), 248056,
                   _QWEN2_VL, mrope_section=(11, 11, 10), mrope_interleaved=True),
    VisionLanguage("Qwen3_5MoeForConditionalGeneration", "Qwen3VLMixin",
                   ("qwen3_5_moe_vision", "qwen3_5_moe", "qwen3_5_vision"), 248056, _QWEN2_VL,
                   mrope_section=(11, 11, 10), mrope_interleaved=True),
    VisionLanguage("Mistral3ForConditionalGeneration", "Mistral3Mixin", ("pixtral",), 10, default_text_config=_d(
        model_type="mistral", head_dim=128, hidden_size=5120, intermediate_size=32768, max_position_embeddings=131072,
        num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8, rms_norm_eps=1e-05,
        rope_theta=1000000000.0, sliding_window=None, vocab_size=131072)),
    VisionLanguage("InternVLForConditionalGeneration", "InternVLMixin", ("internvl_vision",), 151667,
                   default_text_config=_d(model_type="qwen2"),  # (Qwen2Config's defaults)
                   text_config_defaults=_d(tie_word_embeddings=True)),  # (InternVLConfig ties the head)
    # (audio, not images: its clips ride the images' path, streamer/multimodal/audio_prompts.py; <|AUDIO|>'s id)
    VisionLanguage("Qwen2AudioForConditionalGeneration", "Qwen2AudioMixin", ("qwen2_audio_encoder",), 151646,
                   ("text", "audio"), default_text_config=_d(model_type="qwen2")),
)

# The mixtures of experts (`ModelEntry.experts`): each one's config key for its routed experts' count, then the
# other spellings (transformers 5 writes Qwen3-MoE's as num_local_experts, say).
_ALSO = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_EXPERTS: Mapping[str, tuple[str, ...]] = _d(**{arch: (key, *(k for k in _ALSO if k != key)) for arch, key in dict(
    MixtralForCausalLM="num_local_experts", Qwen3MoeForCausalLM="num_experts", GptOssForCausalLM="num_local_experts",
    Llama4ForCausalLM="num_local_experts", DeepseekV2ForCausalLM="n_routed_experts",
    DeepseekV3ForCausalLM="n_routed_experts", Glm4MoeForCausalLM="n_routed_experts", Qwen2MoeForCausalLM="num_experts",
    OlmoeForCausalLM="num_experts", GraniteMoeForCausalLM="num_local_experts",
    GraniteMoeSharedForCausalLM="num_local_experts", Ernie4_5_MoeForCausalLM="moe_num_experts",
    HunYuanMoEV1ForCausalLM="num_experts", PhimoeForCausalLM="num_local_experts",
    GraniteMoeHybridForCausalLM="num_local_experts", NemotronHForCausalLM="n_routed_experts",
    Qwen3NextForCausalLM="num_experts", Qwen3_5MoeForCausalLM="num_experts", Lfm2MoeForCausalLM="num_experts",
    Gemma4ForCausalLM="num_experts").items()})
_MODEL_LIST = tuple(replace(e, experts=_MOE_EXPERTS[e.architecture]) if e.architecture in _MOE_EXPERTS else e
                    for e in _MODEL_LIST)
MODELS: Mapping[str, ModelEntry] = MappingProxyType({e.architecture: e for e in _MODEL_LIST})
VISION_LANGUAGE: Mapping[str, VisionLanguage] = MappingProxyType({v.architecture: v for v in _VISION_LIST})
# config.json name -> (the model serving it, as what); a model's own name included
_NAMES: dict[str, tuple[ModelEntry, Served]] = {}
for _e in _MODEL_LIST:
    for _s in (Served(_e.architecture, _e.task), *_e.served):
        if _s.name in _NAMES:
            raise AssertionError(f"registry: {_s.name} is served by {_NAMES[_s.name][0].architecture} and "
                                 f"{_e.architecture}")
        _NAMES[_s.name] = (_e, _s)
# a vision-language text_config.model_type -> the architecture of its text model
TEXT_MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {t: e.architecture for e in _MODEL_LIST for t in e.vlm_text})
if len(MODELS) != len(_MODEL_LIST) or len(VISION_LANGUAGE) != len(_VISION_LIST) or \
        len(TEXT_MODEL_TYPES) != sum(len(e.vlm_text) for e in _MODEL_LIST):
    raise AssertionError("registry: a name is listed twice")


def entry(architecture: str) -> ModelEntry:
    """The model of a `ModelConfig.architecture`; ValueError for a name that is none."""
    e = MODELS.get(architecture)
    if e is None:
        raise ValueError(f"no model class for architecture {architecture!r} (streamer/models/registry.py)")
    return e


def served(name: str) -> Optional[tuple[ModelEntry, Served]]:
    """The model that serves a config.json architecture name, and as what; None if none does (a vision-language
    name: `VISION_LANGUAGE`)."""
    return _NAMES.get(name)


def model_class(architecture: str) -> type:
    """The class of a `ModelConfig.architecture`, imported on first use."""
    return entry(architecture).model_class()


def names() -> Iterator[tuple[str, Optional[ModelEntry], Served | VisionLanguage]]:
    """Every config.json architecture name the engine accepts: (name, the model serving it or None for a
    vision-language one, how). Gemma 4's vision-language name comes twice (served as its text model too)."""
    for name, (e, s) in _NAMES.items():
        yield name, e, s
    for name, v in VISION_LANGUAGE.items():
        yield name, None, v


def tasks(task: str) -> list[str]:
    """The config.json names served with `task` (GENERATE, EMBED, CLASSIFY, DRAFT)."""
    return [name for name, (_, s) in _NAMES.items() if s.task == task]


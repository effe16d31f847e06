"""The engine core: requests in, incremental outputs out, one `step()` at a time.

`step()` = `scheduler.schedule()` -> `prepare()` -> `runner.execute()` -> `process()`. The async engine calls
the parts separately (`runner.launch()` on the device thread, `PendingStep.result()` when its tokens are needed)
so that the device works while the event loop does everything else.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager, cdiv
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import Scheduler, SchedulerOutput
from streamer.core.step_time import shape_of
from streamer.engine import prompt_embeds
from streamer.engine.detokenizer import IncrementalDetokenizer
from streamer.engine.generation_config import sampling_defaults
from streamer.engine.lora import LoRAAdapter, LoRARegistry, LoRARequest
from streamer.engine.pooling import (
    Classifier,
    DenseProjection,
    PoolingParams,
    default_pooling,
    embedding_width,
    finish_pooled,
    st_max_seq_length,
)
from streamer.engine.structured_output import Grammar, GrammarCompiler
from streamer.engine.thinking import ThinkTags
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.multimodal.audio_prompts import AudioPrompts, as_clips
from streamer.multimodal.inputs import ImageInput, as_media
from streamer.multimodal.prompts import image_prompts_for
from streamer.multimodal.speech import SpeechPrompts
from streamer.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, SampleLogprobs
from streamer.sampling_params import SamplingParams
from streamer.spec_decode.draft_model import DraftPlan, plan_drafts
from streamer.spec_decode.eagle import EagleDrafter, plan_fill, plan_passes
from streamer.spec_decode.ngram import SuffixIndex, ngram_match, propose_ngram, propose_predicted
from streamer.tokenizer.tokenizer import Tokenizer
from streamer.worker.input_batch import InputBatch, StepInputs
from streamer.worker.model_runner import ModelRunner, PromptLogprobsOut, RunnerOutput
from streamer.worker.sampler import bad_words_token_ids

logger = logging.getLogger("streamer")
_MAX_DRAFT_BACKOFF = 16  # steps (LLMEngine._settle_backoff)
# stop_reason of an output whose rules left no token to sample (`_reject`)
NO_TOKEN_LEFT = "no_token_allowed"
_TRUNCATE_MARGIN_CHARS = 4096  # (fit_prompt_text) tokenizing a tail: where its first kept token starts is settled by then

PromptType = Union[str, Sequence[int], dict]
# A request's adapter: a registered adapter's name, or a LoRARequest (registered on first use).
LoRAType = Union[str, LoRARequest, LoRAAdapter, None]


def resolve_model_dir(model: Optional[str]) -> Path:
    if model is None:
        from streamer.demo_model import default_model_path
        return Path(default_model_path())
    from streamer.models.gguf import hf_folder  # a GGUF (file, folder or first shard): its converted HF folder
    path = hf_folder(Path(model).expanduser())
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {model} (streamer loads local Hugging Face checkpoint "
                                "folders and GGUF files; nothing is downloaded)")
    return path


# New weights (`update_weights`): a checkpoint folder, or tensors by checkpoint name (a state dict, or pairs)
WeightsArg = Union[str, Path, Mapping[str, Any], Iterable[tuple[str, Any]]]


def new_weights(weights: WeightsArg) -> Path | list[tuple[str, Any]]:
    """`update_weights`' argument as the runner takes it: a checkpoint folder's path, or a list of (name, tensor)
    (a state dict's items; an iterable is gathered, holding references to the tensors, not copies)."""
    if isinstance(weights, (str, Path)):
        return resolve_model_dir(str(weights))
    try:
        pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
    except TypeError:
        pairs = [weights]  # (not iterable: refused below)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
        raise ValueError("update_weights: weights must be a checkpoint folder, a mapping of tensor names to tensors, "
                         "or (name, tensor) pairs")
    return pairs


@dataclass
class SeqState:
    """Per-sequence output state kept beside the scheduler's Request."""

    req: Request
    detok: IncrementalDetokenizer
    prompt: Optional[str]
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: Optional[PromptLogprobs] = None  # [None] + one entry per scored prompt token, if asked
    # A pooling request's summed hidden states so far (float64 [hidden]; a classifier's logits of them, [labels])
    pool_sum: Optional[Any] = None
    pool_count: int = 0
    embedding: Optional[list[float]] = None  # the result, once the prompt is done (a classifier's: its outputs)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    # Nobody reads its outputs as they come (offline generate, a non-streamed HTTP response): `process` returns
    # one update for it, when it finishes, holding everything.
    final_only: bool = False
    held: Optional["SeqUpdate"] = None  # (stream_interval > 1) tokens not yet handed out

    @property
    def text(self) -> str:
        """Everything emitted so far (kept by the detokenizer as pieces: no quadratic string growth)."""
        return self.detok.text

    @property
    def summed_logprob(self) -> Optional[float]:
        """The sampled tokens' logprobs summed (CompletionOutput.cumulative_logprob), when logprobs were asked for."""
        return self.cumulative_logprob if self.logprobs is not None else None


@dataclass
class SeqUpdate:
    """What one step produced for one sequence."""

    state: SeqState
    new_token_ids: list[int]
    text: str
    logprobs: Optional[SampleLogprobs]
    finished: bool
    prompt_logprobs: Optional[PromptLogprobs] = None  # with a sequence's first token
    embedding: Optional[list[float]] = None  # an embedding request's result (it finishes with it)

    @property
    def req(self) -> Request:
        return self.state.req

    def merge(self, more: "SeqUpdate") -> None:
        """Append a later update of the same sequence."""
        self.new_token_ids += more.new_token_ids
        self.text += more.text
        if self.logprobs is not None and more.logprobs is not None:
            self.logprobs += more.logprobs
        self.finished = more.finished
        if self.prompt_logprobs is None:
            self.prompt_logprobs = more.prompt_logprobs


@dataclass
class TokenTimings:
    """Latencies measured as sequences get their tokens, until the metrics take them: each sequence's time to first
    token, inter-token gaps as {gap: count} (the sequences of one step share its time), and the prompt tokens of
    the requests whose first sequence got its first token."""

    ttft: list[float] = field(default_factory=list)
    itl: dict[float, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    step_tokens: list[int] = field(default_factory=list)  # tokens of each step scheduled
    steps: list[tuple[float, float]] = field(default_factory=list)  # (predicted, measured) period of each step

    def first_token(self, req: Request, ttft: float) -> None:
        self.ttft.append(ttft)
        if req.seq_index == 0:
            self.prompt_tokens += req.num_prompt_tokens

    def gap(self, seconds: float) -> None:
        self.itl[seconds] = self.itl.get(seconds, 0) + 1

    def clear(self) -> None:
        self.ttft.clear()
        self.itl.clear()
        self.prompt_tokens = 0
        self.step_tokens.clear()
        self.steps.clear()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        if config.hf_overrides:
            logger.info("config.json overridden: %s", ", ".join(sorted(config.hf_overrides)))
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.tokenizer.token_bytes  # noqa: B018 (the detokenizer's byte table: built at start-up, not at a request)
        if config.chat_template is not None:
            from streamer.server.chat_template import load_chat_template
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        limit = self.model_config.max_position_embeddings
        st_limit = st_max_seq_length(self.model_dir)
        if st_limit is not None and st_limit < limit:  # (as vLLM caps it: longer inputs are refused, or truncated)
            logger.info("max_model_len capped at %d, sentence_bert_config.json's max_seq_length (sentence-"
                        "transformers truncates there)", st_limit)
            limit = st_limit
        self.max_model_len = min(config.max_model_len or limit, limit)
        if config.max_model_len and config.max_model_len > limit:
            logger.warning("max_model_len %d exceeds the model's limit (max_position_embeddings, or a "
                           "sentence-transformers max_seq_length); using %d", config.max_model_len, limit)
        self._check_multimodal()
        self._fit_budget_to_encoder()
        config = self.config
        self.runner = ModelRunner(config, self.model_dir, self.model_config, self.max_model_len)
        # How the model takes images (None: it takes none)
        self.image_prompts = image_prompts_for(self.model_config, self.runner.model, self.tokenizer, self.model_dir,
                                               config)
        long_rope = self.runner.model.long_rope
        self.long_rope_threshold = long_rope[0] if long_rope else None
        hybrid = registry.entry(self.model_config.architecture).recurrent_state
        # An encoder-decoder model (Whisper): each prompt's audio, encoded once (streamer/multimodal/speech.py)
        self.encoder_decoder = self.runner.cross
        self.speech = SpeechPrompts(self.model_dir, self.runner.model) if self.encoder_decoder else None
        # An encoder's prompts attend both ways: a prefix's KV depends on what follows it, so none is reused.
        self.encoder = self.model_config.bidirectional
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching and not self.encoder,
                                 state_slots=self.runner.num_state_slots,
                                 checkpoint_slots=self.runner.num_checkpoint_slots,
                                 snapshot_slots=self.runner.num_snapshot_slots)
        self.prefix_caching = self.kv.enable_prefix_caching  # (off for a hybrid model without checkpoint slots)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len,
                                   long_rope_threshold=long_rope[0] if long_rope else None)
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, self.runner.max_blocks_per_req,
                                config.block_size, self.model_config.vocab_size,
                                mrope=self.model_config.mrope_section is not None, state_slots=hybrid,
                                encoder_decoder=self.encoder_decoder)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_id)
        self.vocab_size = self.model_config.vocab_size
        if self.speech is not None:  # (its timestamps are no text: dropped from outputs like special tokens)
            self.tokenizer.mark_special(self.speech.timestamp_ids(self.tokenizer))
        self.grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, sorted(self.eos_token_ids))
        self.think_tags = ThinkTags.of(config.reasoning_parser, self._encode_text) \
            if config.reasoning_parser is not None else None
        self.seqs: dict[str, SeqState] = {}
        # Token latencies for whoever keeps metrics (the async engine sets it and takes them): measured here, as
        # sequences get their tokens, since updates do not come token by token (final-only, stream_interval).
        self.timings: Optional[TokenTimings] = None
        self.groups: dict[str, list[str]] = {}  # user request id -> its sequences' ids
        self._ids = itertools.count()
        self.num_steps = 0
        # The step-time model's clock (perf_counter): the last step's end, and since when the engine has had work
        # waiting for the next step's scheduling (None: idle); the last step's (predicted, measured, budget)
        self._last_step_end = 0.0
        self._busy_since: Optional[float] = None
        self.last_step: tuple[float, float, Optional[float]] = (0.0, 0.0, None)
        self.num_overlapped_steps = 0  # steps queued while the previous one still ran (async scheduling)
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and how many were accepted
        self.num_accepted_tokens = 0
        # speculative_method="suffix": finished requests' outputs to draft from (streamer/spec_decode/ngram.py)
        self.suffix = SuffixIndex(config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_tree_depth) \
            if config.speculative_method == "suffix" else None
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.loras = LoRARegistry(config.enable_lora, config.max_lora_rank, self.runner.place_lora,
                                  self.scheduler.lora_slots)
        # for embedding requests that name none (an encoder's own default: its first token, [CLS])
        self.default_pooling = default_pooling(self.model_dir, "cls" if self.encoder else "last")
        # sentence-transformers' Dense modules after the pooling, if the checkpoint has them (EmbeddingGemma's)
        self.projection = DenseProjection.load(self.model_dir)
        # A sequence-classification model's labels and activations (None for other models): it only pools.
        self.classifier = Classifier.from_config(self.model_config.raw, self.model_config.num_labels,
                                                 self.runner.model.classifier_pooling)
        # What unset request fields default to: the checkpoint's recommended sampling (generation_config.json).
        self.sampling_defaults = sampling_defaults(config.generation_config, self.model_dir,
                                                   config.override_generation_config)

    def _fit_budget_to_encoder(self) -> None:
        """An encoder computes each prompt in one step: the step's token budget is raised to hold the longest (as
        vLLM does; a smaller max_model_len keeps it smaller)."""
        budget = self.config.max_num_batched_tokens
        if self.model_config.bidirectional and budget < self.max_model_len:
            logger.warning("max_num_batched_tokens raised from %d to max_model_len %d: an encoder computes each "
                           "prompt whole, in one step", budget, self.max_model_len)
            self.config = dataclasses.replace(self.config, max_num_batched_tokens=self.max_model_len)

    def enable_stall_free(self) -> None:
        """Plan each step against the inter-token budget (streamer/core/step_time.py) from now on, with the step-time
        model's first fit from a warm-up profile (for a model that streams tokens). The async engine turns it on;
        offline generation keeps the token budget alone (nobody sees its gaps, and its steps stay reproducible).
        On the device thread: the profile runs the model."""
        if self.config.max_itl_ms == 0:
            return
        if not self.encoder and not self.encoder_decoder:
            self.scheduler.step_model.set_profile(self.runner.profile_steps(self.config.max_num_batched_tokens))
        self.scheduler.use_itl_budget()

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets no sampling field gets: SamplingParams' defaults, with the checkpoint's
        generation_config.json values in their place (see `sampling_defaults`)."""
        return SamplingParams(**self.sampling_defaults)

    # ------------------------------------------------------------------ LoRA adapters (streamer/engine/lora.py)
    def load_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        return self.loras.load(name, path)

    def register_lora(self, adapter: LoRAAdapter) -> None:
        self.loras.register(adapter)

    def add_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.loras.remove(name)

    def update_weights(self, weights: WeightsArg, partial: bool = False) -> None:
        """New weights for the running model (`ModelRunner.update_weights`): a checkpoint folder of it, or all of
        its tensors by checkpoint name (`new_weights`; `partial`: some of them); then a reset prefix cache (its KV
        came from the old weights). Requests already running go on with the new weights over their old KV, as in
        SGLang and vLLM; abort or finish them first for outputs from the new weights alone."""
        self.runner.update_weights(new_weights(weights), partial)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (`KVCacheManager.reset_prefix_cache`); returns the blocks forgotten."""
        n = self.kv.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", n)
        return n

    def resolve_lora(self, lora: LoRAType) -> Optional[LoRAAdapter]:
        return self.loras.resolve(lora)

    # ------------------------------------------------------------------ images (streamer/multimodal/inputs.py)
    def _check_multimodal(self) -> None:
        if registry.entry(self.model_config.architecture).kind == registry.ENCODER_DECODER and \
                self.config.num_speculative_tokens:
            raise ValueError("speculative decoding does not run with an encoder-decoder model (Whisper)")
        if self.model_config.multimodal is None:
            return
        # (the checkpoint's own MTP layer drafts for text and image prompts alike: it reads the placeholder tokens'
        # embeddings and 1-D positions where the target reads image features at M-RoPE ones, which costs some
        # acceptance at images, never correctness; other draft models are not wired for images yet)
        if self.config.drafts_with_model and self.config.speculative_method != "mtp":
            raise ValueError("speculative decoding with a draft model does not run with a vision-language model yet "
                             "(a checkpoint's own MTP layer does: speculative_method='mtp')")

    def place_images(self, token_ids: list[int], data: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with its images' placeholders expanded, and the images (from a prompt's multi_modal_data;
        None: no images, which a prompt with placeholders must then not have). ValueError for a mismatch."""
        if self.speech is not None:  # a speech model: the prompt's audio, for its encoder
            return token_ids, (self.speech.encoder_input(data),)
        mm = self.image_prompts
        if mm is None:
            if data is not None:
                of = self.model_config.text_only_of
                given = [k for k in ("image", "video", "audio") if isinstance(data, dict) and data.get(k) is not None]
                what = {"image": "images", "video": "video", "audio": "audio"}[given[0]] if len(given) == 1 \
                    else "images"
                raise ValueError(f"multi_modal_data: this model takes no {what}" + (
                    f" ({of} is served as its text model alone: its vision encoder is not supported)" if of else ""))
            return token_ids, ()
        if isinstance(mm, AudioPrompts):
            return self._place_audio(mm, token_ids, data)
        if isinstance(data, dict) and data.get("audio") is not None:
            raise ValueError("multi_modal_data['audio']: this model takes no audio")
        if isinstance(data, dict) and "video" in data and not mm.takes_video:
            raise ValueError(f"multi_modal_data must be {{'image': image or list of images}} for this model: "
                             f"multi_modal_data['video']: {mm.no_video}")
        images, videos = as_media(data) if data is not None else ([], [])
        if not images and not videos and not mm.has_placeholders(token_ids):
            return token_ids, ()
        ids, inputs = mm.expand(token_ids, images, videos)
        return ids, tuple(inputs)

    @staticmethod
    def _place_audio(mm: AudioPrompts, token_ids: list[int], data: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
        """An audio-language model's prompt with its clips' placeholders expanded (streamer/multimodal/audio_prompts.py)."""
        if data is not None and (not isinstance(data, dict) or set(data) - {"audio"}):
            raise ValueError("multi_modal_data must be {'audio': clip or list of clips} for this model (it takes no "
                             f"images or video), got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
        clips = as_clips(data["audio"]) if data is not None and data.get("audio") is not None else []
        if not clips and not mm.has_placeholders(token_ids):
            return token_ids, ()
        ids, inputs = mm.expand(token_ids, clips)
        return ids, tuple(inputs)

    def process_prompt(self, prompt: PromptType, keep_last: Optional[int] = None,
                       ) -> tuple[Optional[str], list[int], tuple[ImageInput, ...]]:
        """(text, token ids, images) of a prompt, images included (see `place_images`). A text prompt with images
        has its placeholders expanded before it is tokenized (Gemma 3's: `ImagePrompts.expand_text`). A prompt of
        embeddings ({"prompt_embeds": tensor}) is placeholder ids and one input holding its rows."""
        if prompt_embeds.is_embeds_prompt(prompt):
            return (None, *self.embeds_prompt(prompt))  # type: ignore[arg-type]
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else None
        if data is not None and self.image_prompts is not None and isinstance(text, str):
            ids = self.tokenizer.encode(self.fit_prompt_text(self.image_prompts.expand_text(text)))
        else:
            text, ids = self._tokenize(prompt, keep_last)
        ids, images = self.place_images(ids, data)
        return text, ids, images

    def embeds_prompt(self, prompt: dict) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A {"prompt_embeds": tensor} prompt's placeholder ids and input (streamer/engine/prompt_embeds.py)."""
        if not self.config.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs the engine started with enable_prompt_embeds "
                             "(--enable-prompt-embeds)")
        if set(prompt) - {"prompt_embeds"}:
            raise ValueError(f"a prompt_embeds prompt takes no other keys, got {sorted(set(prompt) - {'prompt_embeds'})}")
        if self.model_config.multimodal is not None:
            raise ValueError("prompt_embeds is not supported for vision-language models")
        model = self.runner.model
        if not getattr(model, "takes_prompt_embeds", True):
            raise ValueError(f"prompt_embeds is not supported for {self.model_config.architecture} with per-layer "
                             "embeddings (they are looked up by token id)")
        rows = prompt_embeds.check_embeds(prompt["prompt_embeds"], model.input_width, self.runner.dtype,
                                           self.max_model_len)
        return prompt_embeds.embeds_input(rows)

    def truncate(self, text: Optional[str], ids: list[int], images: tuple[ImageInput, ...], options: Any,
                 ) -> tuple[Optional[str], list[int], tuple[ImageInput, ...]]:
        """The prompt cut to its last `truncate_prompt_tokens` tokens if its SamplingParams / PoolingParams ask
        (the text no longer matches the tokens then: None). An encoder's keeps its start and its last token instead:
        [CLS] text... [SEP] cut as its tokenizer (and sentence-transformers) would cut it, framing kept."""
        keep = getattr(options, "truncate_prompt_tokens", None)
        if keep is None or len(ids) <= keep:
            return text, ids, images
        if self.encoder and not images:
            return None, ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:1], ()
        return (None, *prompt_embeds.truncate_inputs(ids, images, keep))  # type: ignore[return-value]

    # ------------------------------------------------------------------ intake
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(text, token ids) of a prompt without images (beam search's; `process_prompt` takes images)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data (images) is not supported by beam search")
        if prompt_embeds.is_embeds_prompt(prompt):
            raise ValueError("prompt_embeds is not supported by beam search")
        return self._tokenize(prompt)

    def fit_prompt_text(self, text: str, keep_last: Optional[int] = None) -> str:
        """The part of a prompt text worth tokenizing: all of it, unless it is longer than max_model_len tokens could
        spell (`Tokenizer.max_token_chars` each), which is refused (ValueError) before paying to tokenize it: an
        8 MB prompt is seconds of tokenizer CPU and a gigabyte of encodings. A prompt cut to its last `keep_last`
        tokens (truncate_prompt_tokens) keeps the tail those tokens lie in, with a margin for where they start."""
        per_token = self.tokenizer.max_token_chars
        limit = self.max_model_len * per_token
        if len(text) <= limit:
            return text
        if keep_last is not None:  # (an encoder keeps its text's start: `truncate`)
            span = keep_last * per_token + _TRUNCATE_MARGIN_CHARS
            return text[:span] if self.encoder else text[-span:]
        raise ValueError(f"prompt is {len(text)} characters long, more than its tokens could fit in: max_model_len "
                         f"is {self.max_model_len}, and a token of this tokenizer spells at most {per_token} "
                         f"characters ({limit} in all); shorten it or set truncate_prompt_tokens")

    def _tokenize(self, prompt: PromptType, keep_last: Optional[int] = None) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):  # (a speech model's decoder prompt spells its special tokens itself)
            return prompt, self.tokenizer.encode(self.fit_prompt_text(prompt, keep_last),
                                         add_special_tokens=not self.encoder_decoder)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams, pooling: bool = False) -> int:
        """Check one prompt against the model and the pool; returns the resolved max_tokens (0 for an embedding
        request, `pooling`, which may fill the whole context)."""
        if not pooling and self.classifier is not None:
            raise ValueError(f"{self.classifier.architecture} is a sequence-classification model: it has no LM head "
                             "and cannot generate; classify prompts (or score pairs, with one label) instead")
        if not pooling and self.encoder:
            arch = self.model_config.raw["architectures"][0]
            raise ValueError(f"{arch} is an encoder (embedding) model: it cannot generate; embed prompts (or score "
                             "pairs) instead")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        n, limit = len(token_ids), self.max_model_len
        if pooling:
            if n > limit:
                raise ValueError(f"prompt is {n} tokens long, but max_model_len is {limit}")
            if cdiv(n, self.config.block_size) > self.kv.num_blocks:
                raise ValueError(f"prompt needs {cdiv(n, self.config.block_size)} KV blocks but the cache holds "
                                 f"{self.kv.num_blocks}")
            return 0
        if n >= limit:
            raise ValueError(f"prompt is {n} tokens long, but max_model_len is {limit}: it must be shorter "
                             f"than {limit} tokens to leave room for at least one generated token")
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} names token id {bad[0]}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size})")
        if params.allowed_token_ids and params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= stops:
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens bans: nothing could be "
                                 "generated")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                             f"max_model_len {limit}; max_tokens may be at most {limit - n}")
        need = cdiv(n + max_tokens, self.config.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} KV blocks but the cache holds "
                             f"{self.kv.num_blocks}; lower max_tokens or enlarge the cache")
        return max_tokens

    def add_request(self, request_id: Optional[str], prompt: PromptType, params: SamplingParams,
                    priority: int = 0, cache_salt: Optional[str] = None,
                    arrival_time: Optional[float] = None, prompt_token_ids: Optional[list[int]] = None,
                    grammar: Optional[Grammar] = None, lora_request: LoRAType = None,
                    pooling: Optional[PoolingParams] = None,
                    images: Optional[tuple[ImageInput, ...]] = None, stream: bool = True) -> list[SeqState]:
        """`grammar`: `params.structured_outputs` compiled already (the async engine compiles off its loop).
        `lora_request`: the LoRA adapter the request runs with (see `resolve_lora`). `pooling`: a pooling request, an
        embedding or a classification (streamer/engine/pooling.py): `params` are ignored, nothing is generated. `images`:
        the prompt's images, placed in `prompt_token_ids` already (`process_prompt`); None: taken from the prompt
        here. `stream=False`: each sequence's outputs come in one update, when it finishes (see SeqState)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if prompt_token_ids is None:
            keep = getattr(pooling if pooling is not None else params, "truncate_prompt_tokens", None)
            text, prompt_token_ids, images = self.process_prompt(prompt, keep)
        else:
            text = prompt if isinstance(prompt, str) else None
            if images is None:
                prompt_token_ids, images = self.place_images(prompt_token_ids, None)
        encoder_input = None
        if self.speech is not None:  # (its "images" are its audio: see place_images)
            encoder_input, images = self.speech.take(images), ()
        text, prompt_token_ids, images = self.truncate(text, prompt_token_ids, images,
                                                       pooling if pooling is not None else params)
        if pooling is not None:
            params, pooling = SamplingParams(temperature=0.0), self.resolve_pooling(pooling)
        max_tokens = self.validate(prompt_token_ids, params, pooling=pooling is not None)
        embedded = any(im.features is not None for im in images)
        if embedded and params.prompt_logprobs is not None and pooling is None:
            raise ValueError("prompt_logprobs is not supported with prompt_embeds (the prompt has no tokens)")
        adapter = self.resolve_lora(lora_request)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        bad_words = self._bad_words_ids(params.bad_words) if params.bad_words else None
        if bad_words and params.allowed_token_ids:
            banned = {seq[0] for seq in bad_words if len(seq) == 1}
            if set(params.allowed_token_ids) <= banned:
                raise ValueError("allowed_token_ids: every token it allows is one of bad_words: nothing could be "
                                 "generated")
        speech_rules = self.speech.rules(self.tokenizer, prompt_token_ids) if self.speech is not None else None
        think = self._think_tags(params)
        predicted = self._prediction(params)
        states = []
        for i in range(params.n):
            seq_params = params
            if params.n > 1 and params.seed is not None:
                seq_params = params.clone(seed=params.seed + i)  # distinct but reproducible samples
            req = Request(request_id if params.n == 1 else f"{request_id}-{i}", prompt_token_ids, seq_params,
                          max_tokens, self.eos_token_ids, arrival, priority, cache_salt,
                          block_size=self.config.block_size, hash_blocks=self.prefix_caching,
                          seq_index=i, parent_id=request_id, lora=adapter, pooling=pooling,
                          long_rope_threshold=self.long_rope_threshold, images=images,
                          whole_images=bool(images) and self.runner.model.bidirectional_images,
                          whole_prompt=self.encoder, encoder_input=encoder_input,
                          streamed=stream and pooling is None)
            if grammar is not None:
                req.matcher = grammar.matcher()
            req.bad_words_ids = bad_words
            req.speech_rules = speech_rules
            if think is not None:
                req.think = think.budget(prompt_token_ids, params.thinking_token_budget)  # type: ignore[arg-type]
            req.prediction = predicted
            # (a prompt of embeddings gives the detokenizer no context: its placeholders are no text)
            state = SeqState(req, IncrementalDetokenizer(self.tokenizer, () if embedded else prompt_token_ids,
                                                         seq_params), text,
                             logprobs=[] if params.logprobs is not None else None,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                             metrics=RequestMetrics(arrival_time=arrival), final_only=not stream)
            self.seqs[req.request_id] = state
            self.scheduler.add(req)
            states.append(state)
        self.groups[request_id] = [s.req.request_id for s in states]
        return states

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _bad_words_ids(self, words: list[str]) -> Optional[list[list[int]]]:
        seqs = bad_words_token_ids(words, self._encode_text)
        return [s for s in seqs if s[-1] < self.vocab_size] or None

    def _prediction(self, params: SamplingParams) -> Optional[np.ndarray]:
        """A predicted output's tokens, where n-gram drafting will use them (else the prediction is a hint
        nothing reads, as OpenAI allows)."""
        if not params.prediction or not self.config.num_speculative_tokens or self.runner.drafter is not None:
            return None
        ids = self._encode_text(params.prediction)
        return np.asarray(ids, dtype=np.int32) if ids else None

    def _think_tags(self, params: SamplingParams) -> Optional[ThinkTags]:
        """The tags a request's thinking_token_budget counts between (None: it has none). An output held to a
        grammar starts outside the reasoning (as the server reads it), so the grammar alone decides it; a
        structural tag leaves the text free, so it counts."""
        so = params.structured_outputs
        if params.thinking_token_budget is None or (so is not None and so.structural_tag is None):
            return None
        if self.think_tags is None:
            why = "one with think tags (gpt-oss's channels have none)" if self.config.reasoning_parser else \
                "reasoning_parser (--reasoning-parser) naming the model's"
            raise ValueError(f"thinking_token_budget needs the engine's {why}")
        return self.think_tags

    def resolve_pooling(self, pooling: PoolingParams) -> PoolingParams:
        """The request's pooling with the model's defaults (task, pooling method) filled in, checked against the
        model: a sequence classifier classifies (or scores), any other model embeds."""
        if self.classifier is not None:
            return self.classifier.resolve(pooling)
        if pooling.task not in (None, "embed"):
            raise ValueError(f"task {pooling.task!r} needs a sequence-classification model "
                             "(*ForSequenceClassification); this one makes embeddings")
        hidden = self.projection.out_features if self.projection is not None else embedding_width(self.runner.model)
        if pooling.dimensions is not None and pooling.dimensions > hidden:
            raise ValueError(f"dimensions ({pooling.dimensions}) exceeds the model's embedding size {hidden}")
        return dataclasses.replace(pooling, task="embed", pooling=pooling.pooling or self.default_pooling)

    def abort(self, request_id: str) -> list[SeqState]:
        """Abort a user request (all of its sequences); returns the states that were still live."""
        aborted = []
        for seq_id in self.groups.pop(request_id, []):
            state = self.seqs.pop(seq_id, None)
            if state is None:
                continue
            self.scheduler.finish(state.req, RequestStatus.FINISHED_ABORTED)
            aborted.append(state)
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Bring the persistent batch up to date and gather this step's inputs (fresh arrays: the device thread
        may read them while the loop goes on)."""
        self.batch.sync(self.kv)
        inputs = self.batch.prepare(sched)
        inputs.state_copies = self.kv.take_state_copies()
        if self.scheduler.lora_slots is not None:
            inputs.lora_loads = self.scheduler.lora_slots.take_loads()
        return inputs

    def schedule(self) -> Optional[tuple[SchedulerOutput, StepInputs]]:
        """Schedule and prepare the next step; None when nothing can run now."""
        t0 = time.perf_counter()
        if self.config.num_speculative_tokens:
            self._propose_drafts()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        self._time_step(sched, t0)
        inputs = self.prepare(sched)
        if self.timings is not None:
            self.timings.step_tokens.append(len(inputs.input_ids))
        drafter = self.runner.drafter
        if isinstance(drafter, EagleDrafter):  # the head fills its KV after every step; proposes before some
            inputs.eagle = plan_fill(inputs, self.batch.tokens, self.batch.num_tokens, drafter.keep)
            if sched.has_drafts:
                counts = np.array([s.num_drafts for s in sched.scheduled], dtype=np.int64)
                inputs.draft = plan_passes(inputs, counts, self.batch.tokens, self.config.block_size)
        elif sched.has_drafts and drafter is not None:
            inputs.draft = self._plan_drafts(sched, inputs)
        return sched, inputs

    def can_overlap(self, running: StepInputs) -> bool:
        """May the next step be scheduled while `running` still runs? Not when a row of it applies penalties,
        bad_words or Whisper's rules, follows a grammar or may have to close its reasoning: the next step's
        penalties, bans, token mask or forced token need the token it samples, on the host."""
        return (self.async_scheduling and not running.sampling.penalized and running.sampling.grammar is None
                and not running.sampling.worded and not running.sampling.speech and not any(r.think.pins_next  # type: ignore[union-attr]
                                                            for _, r in running.sampling.thinking)
                and not self.config.num_speculative_tokens)  # drafts are proposed from the tokens known

    def schedule_next(self, running: Optional[StepInputs]) -> Optional[tuple[SchedulerOutput, StepInputs]]:
        """The step pipeline's one decision (AsyncEngine and LLM share it): the next step to queue, given the one
        still running (None: nothing runs), or None when none may or can be scheduled now."""
        if not self.has_unfinished() or (running is not None and not self.can_overlap(running)):
            return None
        if running is not None:
            self._busy_since = None  # (overlapped: the time between steps is inside the running step's period)
        step = self.schedule()
        if step is not None and running is not None:
            self.num_overlapped_steps += 1
        return step

    def step(self) -> list[SeqUpdate]:
        step = self.schedule()
        if step is None:
            return []
        sched, inputs = step
        return self.process(sched, self.runner.execute(inputs))

    def _time_step(self, sched: SchedulerOutput, t0: float) -> None:
        """Stamp a scheduled step for the step-time model: its shape, its predicted period, its start. The loop's
        time between the last step's end and this one's start (while busy: delivering the last step's tokens) is
        smoothed into the scheduler's `step_gap`."""
        sched.scheduled_at = t0
        sched.shape = shape_of([(s.start, s.num_tokens) for s in sched.scheduled])
        model = self.scheduler.step_model
        if model.ready:
            sched.predicted = model.predict(sched.shape)
        gap = t0 - self._busy_since if self._busy_since is not None else -1.0
        if 0 <= gap < self.last_step[1]:  # (longer: the loop waited, e.g. for KV blocks, rather than delivered)
            self.scheduler.step_gap += 0.1 * (gap - self.scheduler.step_gap)
        self._busy_since = None

    def _observe_step(self, sched: SchedulerOutput) -> None:
        """The step's period (from its scheduling, or from the previous step's end when they overlapped, to the end
        of its processing) goes to the step-time model and the metrics."""
        now = time.perf_counter()
        period = now - max(sched.scheduled_at, self._last_step_end)
        self._last_step_end = now
        self._busy_since = now if self.has_unfinished() else None
        if sched.shape is None:
            return
        self.scheduler.step_model.observe(sched.shape, period)
        self.last_step = (sched.predicted, period, sched.budget)
        if self.timings is not None:
            self.timings.steps.append((sched.predicted, period))

    def process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[SeqUpdate]:
        updates = self._process(sched, result)
        self._observe_step(sched)
        return updates

    def _process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[SeqUpdate]:
        self.num_steps += 1
        if result.rows is not None:
            self.batch.record(result.rows, result.epochs, result.positions, result.token_array)
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(result.prompt_logprobs)
        now = time.monotonic()
        updates = [] if result.pooled is None else self._record_pooled(*result.pooled, now)
        if not result.has_drafts:  # one token per request (this loop runs for every request every step)
            every_token = self.config.stream_interval == 1
            for i, (seq_id, token) in enumerate(zip(result.req_ids, result.token_ids)):
                state = self.seqs.get(seq_id)
                if state is None or state.req.is_finished:
                    continue  # aborted while the step ran, or (async scheduling) finished by the step before
                update = self._append_token(state, token, result, i, now)
                if every_token and not state.final_only:
                    updates.append(update)  # (_deliver's common case, without the call)
                else:
                    self._deliver(updates, update)
            return updates
        ids, tokens = result.req_ids, result.token_ids
        for rid, proposed in (result.drafts or {}).items():  # a draft model's, in place of its placeholders
            state = self.seqs.get(rid)
            if state is not None:
                state.req.draft_token_ids = proposed
        i = 0
        while i < len(ids):  # a request's entries are consecutive: its last known token's, then one per draft
            end = i + 1
            while end < len(ids) and ids[end] == ids[i]:
                end += 1
            state = self.seqs.get(ids[i])
            if state is None or state.req.is_finished:
                pass  # aborted while the step ran
            else:
                self._deliver(updates, self._verify(state, tokens[i:end], result, i, now) if end - i > 1
                              else self._append_token(state, tokens[i], result, i, now))
            i = end
        return updates

    def _deliver(self, updates: list[SeqUpdate], update: SeqUpdate) -> None:
        """Hand a sequence's update out now, or hold it: a final-only sequence's until it finishes (then one update
        with everything), a streamed one's (with stream_interval > 1) until that many tokens are held. A sequence's
        first token always goes out at once (time to first token)."""
        state = update.state
        if state.final_only:
            if update.finished:
                updates.append(self.undelivered(state))
            return
        interval = self.config.stream_interval
        if interval > 1:
            held = state.held
            if held is not None:
                held.merge(update)
                update = held
            if not (update.finished or len(update.new_token_ids) >= interval
                    or len(update.new_token_ids) == state.req.num_output_tokens):
                state.held = update
                return
            state.held = None
        updates.append(update)

    @staticmethod
    def undelivered(state: SeqState) -> Optional[SeqUpdate]:
        """What `process` has not handed out of a sequence yet: a final-only one's everything, a streamed one's
        held tokens (None if nothing). An abort hands it out with the abort."""
        if not state.final_only:
            return state.held
        return SeqUpdate(state, list(state.req.output_token_ids), state.text,
                         list(state.logprobs) if state.logprobs is not None else None, state.req.is_finished,
                         state.prompt_logprobs)

    # ------------------------------------------------------------------ speculative decoding
    def _propose_drafts(self) -> None:
        """N-gram drafts for the requests about to decode (streamer/spec_decode/ngram.py), while the batch is small."""
        cfg = self.config
        running = self.scheduler.running
        if len(running) > cfg.speculative_max_batch:
            return
        for req in running:
            if (req.num_pending or req.matcher is not None or req.params.needs_penalties or req.pooling is not None
                    or req.bad_words_ids is not None or (req.think is not None and req.think.active)):
                continue  # its next token depends on host state the drafts would skip
            room = min(req.max_tokens - len(req.output_token_ids), self.max_model_len - len(req.all_token_ids)) - 1
            k = min(self.scheduler.draft_limit(req), room)  # (0: not decoding, or at a block boundary)
            row = self.batch.row_of.get(req.request_id)
            if k <= 0 or row is None:
                continue
            if req.draft_backoff:
                req.draft_backoff -= 1
                continue
            if self.runner.drafter is not None:  # placeholders: the draft model fills them on the device
                req.draft_token_ids = [0] * k
                continue
            tokens = self.batch.tokens[row, :self.batch.num_tokens[row]]
            if req.prediction is not None:  # (the output: the persistent row past the prompt, no copy)
                req.draft_token_ids, req.prediction_cursor = propose_predicted(
                    req.prediction, tokens[self.batch.num_prompt[row]:], k, cfg.prompt_lookup_min,
                    cfg.prompt_lookup_max, req.prediction_cursor)
                req.drafts_predicted = bool(req.draft_token_ids)
                if req.drafts_predicted:
                    continue
            if self.suffix is not None:
                req.draft_token_ids = self._suffix_drafts(tokens, k)
            else:
                req.draft_token_ids = propose_ngram(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def _suffix_drafts(self, tokens: np.ndarray, k: int) -> list[int]:
        """SuffixDecoding: the drafts that follow the longer match, in earlier requests' outputs or in the request's
        own tokens (which its per-request tree holds there)."""
        cfg = self.config
        assert self.suffix is not None
        cached, n_cached = self.suffix.propose(tokens, k, cfg.suffix_decoding_max_spec_factor,
                                               cfg.suffix_decoding_min_token_prob)
        own, n_own = ngram_match(tokens, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        return cached if cached and n_cached > n_own else own

    def _plan_drafts(self, sched: SchedulerOutput, inputs: StepInputs) -> DraftPlan:
        """The draft model's work before this step (streamer/spec_decode/draft_model.py); afterwards it holds the KV of
        every position up to its last proposal's input."""
        sch = sched.scheduled
        counts = np.array([s.num_drafts for s in sch], dtype=np.int64)
        computed = np.array([s.req.num_draft_computed for s in sch], dtype=np.int64)
        plan = plan_drafts(inputs, counts, self.batch.tokens, computed, self.config.block_size,
                           self.config.max_num_batched_tokens)
        for s in sch:
            if s.num_drafts:
                s.req.num_draft_computed = s.req.num_tokens + s.num_drafts - 1
        return plan

    def _verify(self, state: SeqState, sampled: list[int], result: RunnerOutput, row: int, now: float,
                ) -> SeqUpdate:
        """A request's speculative step: `sampled` holds the token drawn after its last known token and after
        each draft. Drafts are accepted while they equal what was drawn at their position; the first draw that
        differs (or the one after the last draft) comes with them. One update for all of them."""
        req = state.req
        drafts, req.draft_token_ids = req.draft_token_ids[:len(sampled) - 1], []
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        # A draft model's KV stays valid up to the first rejected proposal it was fed.
        req.num_draft_computed = min(req.num_draft_computed, req.num_tokens + accepted)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        if req.drafts_predicted:  # the prediction's tokens the output took: the drafts accepted, and the token
            # drawn after them when it is the prediction's next one too
            ahead = req.prediction_cursor + len(drafts)
            bonus = accepted == len(drafts) and ahead < len(req.prediction) \
                and sampled[accepted] == req.prediction[ahead]  # type: ignore[index, arg-type]
            req.prediction_accepted += accepted + int(bonus)
            req.drafts_predicted = False
        if accepted < len(drafts):
            self.kv.reject_drafts(req)  # (a hybrid model: its recurrent state goes back to before the step)
        self._settle_backoff(req, accepted, len(drafts))
        update = self._append_token(state, sampled[0], result, row, now)
        for j in range(1, accepted + 1):
            if update.finished:
                break
            update.merge(self._append_token(state, sampled[j], result, row + j, now))
        if not update.finished:
            # The drafts past the accepted ones were computed but are not the sequence: recompute from the
            # last token on (their KV slots are simply overwritten), or from before the step (a hybrid model).
            req.num_computed_tokens = min(req.num_computed_tokens, len(req.all_token_ids) - 1)
            req.num_pending = 0
            self.batch.truncate(req.request_id, len(req.all_token_ids))
        return update

    def _settle_backoff(self, req: Request, accepted: int, num_drafts: int) -> None:
        """Hybrid models: a verify step that accepts nothing costs more than the plain step it replaces (the next
        one recomputes through the recurrent layers' chunk path, and the state is copied out and back), so a request
        whose drafts keep missing decodes without them for a while: from the third miss in a row on, 1, 2, 4, ...
        up to 16 steps after each; an accepted draft ends the backoff (bench/RESULTS.md, session 15)."""
        if self.kv.snapshots is None or not num_drafts:
            return
        if accepted:
            req.draft_misses = 0
        else:
            req.draft_misses += 1
            if req.draft_misses >= 3:
                req.draft_backoff = min(1 << (req.draft_misses - 3), _MAX_DRAFT_BACKOFF)

    def _append_token(self, state: SeqState, token: int, result: RunnerOutput, row: int, now: float) -> SeqUpdate:
        req = state.req
        if token < 0 or (req.matcher is not None and not req.matcher.consume_token(token)):  # type: ignore
            return self._reject(state, now)
        m = state.metrics
        timings = self.timings
        if m.first_token_time is None:
            m.first_token_time = now
            if timings is not None:
                timings.first_token(req, now - m.arrival_time)
        elif timings is not None and now > m.last_token_time:  # type: ignore[operator]
            timings.gap(now - m.last_token_time)  # type: ignore[operator]
        m.last_token_time = now
        new_logprobs = None
        if state.logprobs is not None and result.logprobs is not None:
            new_logprobs = [self._logprob_entry(result, row, req.params.logprobs or 0)]
            state.logprobs.extend(new_logprobs)
            state.cumulative_logprob += result.logprobs[row][0]
        new_tokens = [token]
        text, status, stop_reason = self._emit(state, token)
        if status is None and req.matcher is not None and self._may_jump(state):
            text, status, stop_reason = self._jump_forward(state, new_tokens, text)
        if status is not None:
            req.stop_reason = stop_reason
            self._finish(state, status)
            m.finished_time = now
        first = state.prompt_logprobs if len(req.output_token_ids) == len(new_tokens) else None
        return SeqUpdate(state, new_tokens, text, new_logprobs, status is not None, first)

    def _emit(self, state: SeqState, token: int) -> tuple[str, Optional[RequestStatus], int | str | None]:
        """Append one token: (its text, the finish status if it ends the sequence, the stop reason)."""
        req = state.req
        req.append_token(token)
        if req.think is not None:
            req.think.feed(req.output_token_ids)
        status, stop_reason = self._check_stop(req, token)
        stopped_by_token = status == RequestStatus.FINISHED_STOPPED
        # A complete grammar admits only EOS next: stop now rather than spend a step on it.
        if status is None and req.matcher is not None and req.matcher.is_stopped():  # type: ignore[attr-defined]
            status = RequestStatus.FINISHED_STOPPED
        detok = state.detok
        # As vLLM: the eos / stop token's own text is left out unless asked for.
        text, stop_str = ("", None) if stopped_by_token and not req.params.include_stop_str_in_output \
            else detok.add_token(token)
        if stop_str is not None:
            return text, RequestStatus.FINISHED_STOPPED, stop_str
        if status is not None:
            text += detok.flush()
            if detok.stop_reason is not None:  # the held-back tail completed a stop string
                status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_reason
        return text, status, stop_reason

    def _may_jump(self, state: SeqState) -> bool:
        """Jump-forward appends the grammar's forced tokens unsampled, so only where nothing but the grammar
        decides the next token: not with allowed_token_ids, logit_bias or bad_words (a forced token might be
        banned), not while min_tokens bans stop tokens, and not when logprobs are asked for (forced tokens have
        none)."""
        req = state.req
        p = req.params
        return (self.config.jump_forward and state.logprobs is None and not p.adjusts_logits
                and req.bad_words_ids is None
                and len(req.output_token_ids) >= p.min_tokens)

    def _jump_forward(self, state: SeqState, new_tokens: list[int], text: str,
                      ) -> tuple[str, Optional[RequestStatus], int | str | None]:
        """Append the tokens the grammar forces next (llguidance's fast-forward tokens: its canonical tokenization
        of the only bytes that can follow), each checked like a sampled one (max_tokens ends the run). The
        scheduler then computes them with the next step, as it computes a prompt, and samples after them."""
        req = state.req
        matcher = req.matcher
        start = len(req.all_token_ids)
        status: Optional[RequestStatus] = None
        stop_reason: int | str | None = None
        for t in matcher.compute_ff_tokens():  # type: ignore[union-attr]
            if not matcher.consume_token(t):  # type: ignore[union-attr]
                break
            new_tokens.append(t)
            piece, status, stop_reason = self._emit(state, t)
            text += piece
            if status is not None:
                break
        if status is None:
            self.batch.append(req.request_id, start, req.all_token_ids[start:])
        return text, status, stop_reason

    def _check_stop(self, req: Request, token: int) -> tuple[Optional[RequestStatus], int | str | None]:
        p = req.params
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens:
            if token in req.eos_token_ids and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if p.stop_token_ids and token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _reject(self, state: SeqState, now: float) -> SeqUpdate:
        """No token fits the request's rules (its grammar, allowed_token_ids, bad_words, min_tokens' bans, logit
        masks together): the sampler gave -1. The output ends there, as a stop, with stop_reason saying why."""
        req = state.req
        logger.warning("request %s: no token fits its sampling parameters (structured output, allowed_token_ids, "
                       "bad_words, min_tokens together); stopping it", req.request_id)
        text = state.detok.flush()
        req.stop_reason = NO_TOKEN_LEFT
        self._finish(state, RequestStatus.FINISHED_STOPPED)
        state.metrics.finished_time = now
        first = state.prompt_logprobs if not req.output_token_ids else None
        return SeqUpdate(state, [], text, [] if state.logprobs is not None else None, True, first)

    def _finish(self, state: SeqState, status: RequestStatus) -> None:
        req = state.req
        if self.suffix is not None and req.output_token_ids and status != RequestStatus.FINISHED_ABORTED:
            tail = req.prompt_token_ids[-self.config.suffix_decoding_max_tree_depth:]
            self.suffix.add(np.asarray(tail + req.output_token_ids, dtype=np.int64))
        self.scheduler.finish(req, status)
        self.seqs.pop(req.request_id, None)
        group = self.groups.get(req.parent_id or req.request_id)
        if group is not None and all(sid not in self.seqs for sid in group):
            del self.groups[req.parent_id or req.request_id]

    def _record_pooled(self, owners: list, sums: Any, now: float) -> list[SeqUpdate]:
        """Add each pooling request's chunk to its sum; a request whose prompt is done finishes with its
        embedding (or a classifier's output). A chunk that starts at 0 starts the sum over (a preempted request
        recomputes its prompt)."""
        updates = []
        for j, (rid, start, count, done) in enumerate(owners):
            state = self.seqs.get(rid)
            if state is None or state.req.is_finished:
                continue
            if start == 0 or state.pool_sum is None:
                state.pool_sum, state.pool_count = np.zeros(sums.shape[1]), 0
            state.pool_sum += sums[j]
            state.pool_count += count
            if done:
                embedding = state.embedding = finish_pooled(state.pool_sum, state.pool_count, state.req.pooling,
                                                            self.classifier, self.projection)
                state.metrics.first_token_time = state.metrics.finished_time = now
                if self.timings is not None:
                    self.timings.first_token(state.req, now - state.metrics.arrival_time)
                self._finish(state, RequestStatus.FINISHED_STOPPED)
                updates.append(SeqUpdate(state, [], "", None, True, embedding=embedding))
        return updates

    def _record_prompt_logprobs(self, out: PromptLogprobsOut) -> None:
        start = 0
        for rid, first, count in out.owners:
            state = self.seqs.get(rid)
            entries = state.prompt_logprobs if state is not None else None
            if entries is not None:
                top_n = state.req.params.prompt_logprobs or 0  # type: ignore[union-attr]
                # Positions scored before a preemption made the request recompute its prompt are kept as they were.
                for j in range(start + max(len(entries) - first, 0), start + count):
                    entries.append(self._entry(int(out.target_ids[j]), float(out.logprobs[j]), int(out.ranks[j]),
                                               out.top_ids[j, :top_n].tolist(), out.top_logprobs[j, :top_n].tolist()))
            start += count

    def _logprob_entry(self, result: RunnerOutput, row: int, top_n: int) -> dict[int, Logprob]:
        lps, ids = result.logprobs[row], result.logprob_token_ids[row]  # type: ignore[index]
        return self._entry(ids[0], lps[0], result.ranks[row], ids[1:1 + top_n], lps[1:1 + top_n])  # type: ignore[index]

    def _entry(self, token: int, logprob: float, rank: int, top_ids: list[int], top_lps: list[float],
               ) -> dict[int, Logprob]:
        """{token: its Logprob, then the top-N best first} (the token keeps its own entry if also among them)."""
        decode = self.tokenizer.decode_token
        entry = {token: Logprob(logprob, rank, decode(token))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_lps), start=1):
            entry.setdefault(tid, Logprob(lp, r, decode(tid)))
        return entry

    # ------------------------------------------------------------------ results
    def completion(self, state: SeqState) -> CompletionOutput:
        req = state.req
        return CompletionOutput(
            index=req.seq_index, text=state.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=state.summed_logprob,
            logprobs=state.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)

    def close(self) -> None:
        """Release what outlives the engine object's references: tensor-parallel worker processes."""
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        return {
            "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage, "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.prefix_queries, "prefix_cache_hits": self.kv.prefix_hits,
            "num_overlapped_steps": self.num_overlapped_steps,
            **self._step_time_stats(),
            "spec_num_draft_tokens": self.num_draft_tokens, "spec_num_accepted_tokens": self.num_accepted_tokens,
            **self._lora_stats(),
        }

    def _step_time_stats(self) -> dict[str, Any]:
        sched = self.scheduler
        predicted, measured, budget = self.last_step
        return {"step_time_predicted": predicted, "step_time_measured": measured,
                "step_time_budget": budget if budget is not None else 0.0,
                "step_time_prediction_error": sched.step_model.error,
                "itl_target_unmet_steps": sched.itl.unmet_steps if sched.itl is not None else 0}

    def _lora_stats(self) -> dict[str, Any]:
        slots = self.scheduler.lora_slots
        if slots is None:
            return {}
        waiting = {r.lora.name for r in self.scheduler.waiting if r.lora is not None}
        return {"max_lora": slots.n, "running_lora_adapters": sorted({a.name for a in slots.active}),
                "waiting_lora_adapters": sorted(waiting)}

"""Input processing: a user request -> its validated `Request`s (one per sequence), ready for the scheduler.

A prompt (text, token ids, a dict with images / audio, or embeddings) becomes token ids and the inputs that go
with them (`process_prompt`: images' placeholders expanded, `place_images`; a text longer than the model could
take refused untokenized, `fit_prompt_text`), is cut to `truncate_prompt_tokens` (`truncate`), and checked with
its sampling parameters against the model and the KV pool (`validate`, which resolves max_tokens). What the
sampler needs beside the parameters is resolved here once: the LoRA adapter, the compiled grammar, bad_words' token
ids, a thinking budget's tags, a prediction's tokens, Whisper's decoding rules, a pooling request's defaults.

Nothing here touches the scheduler or the device: it reads the model's shape and the pool's size only, so it may
run off the event loop (the async engine tokenizes long prompts and decodes images on worker threads).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from streamer.config import EngineConfig
from streamer.core.kv_cache import cdiv
from streamer.core.request import Request
from streamer.engine import prompt_embeds
from streamer.engine.generation_config import sampling_defaults
from streamer.engine.lora import LoRAAdapter, LoRARegistry, LoRARequest
from streamer.engine.pooling import Classifier, DenseProjection, PoolingParams, default_pooling, embedding_width
from streamer.engine.structured_output import Grammar, GrammarCompiler
from streamer.engine.thinking import ThinkTags
from streamer.models.config import ModelConfig
from streamer.multimodal.audio_prompts import AudioPrompts, as_clips
from streamer.multimodal.inputs import ImageInput, ImagePrompts, as_media
from streamer.multimodal.prompts import image_prompts_for
from streamer.multimodal.speech import SpeechPrompts
from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer
from streamer.worker.sampler import bad_words_token_ids

if TYPE_CHECKING:
    from streamer.worker.model_runner import ModelRunner

_TRUNCATE_MARGIN_CHARS = 4096  # (fit_prompt_text) tokenizing a tail: where its first kept token starts is settled by then

PromptType = Union[str, Sequence[int], dict]
# A request's adapter: a registered adapter's name, or a LoRARequest (registered on first use).
LoRAType = Union[str, LoRARequest, LoRAAdapter, None]
Inputs = tuple[Optional[str], list[int], tuple[ImageInput, ...]]  # a prompt's (text, token ids, images)


@dataclasses.dataclass
class _Extras:
    """What each sequence of a request gets beside its Request's fields (one per request, shared)."""

    grammar: Optional[Grammar]
    bad_words: Optional[list[list[int]]]
    speech_rules: Any
    think: Optional[ThinkTags]
    prediction: Optional[np.ndarray]


class InputProcessor:
    def __init__(self, config: EngineConfig, model_dir: Path, model_config: ModelConfig, tokenizer: Tokenizer,
                 max_model_len: int, runner: "ModelRunner", num_kv_blocks: int, prefix_caching: bool,
                 loras: LoRARegistry) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.runner = runner  # (read only: the model's input width and dtype, whether a draft model drafts)
        self.num_kv_blocks = num_kv_blocks
        self.prefix_caching = prefix_caching
        self.loras = loras
        long_rope = runner.model.long_rope
        self.long_rope_threshold = long_rope[0] if long_rope else None
        self.encoder = model_config.bidirectional  # (an encoder's prompt: whole, in one step, never generates)
        self.encoder_decoder = runner.cross
        # How the model takes images (None: it takes none); an encoder-decoder model's audio prompts
        self.image_prompts = image_prompts_for(model_config, runner.model, tokenizer, model_dir, config)
        self.speech = SpeechPrompts(model_dir, runner.model) if self.encoder_decoder else None
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model_config.eos_token_id)
        self.vocab_size = model_config.vocab_size
        if self.speech is not None:  # (its timestamps are no text: dropped from outputs like special tokens)
            tokenizer.mark_special(self.speech.timestamp_ids(tokenizer))
        self.grammars = GrammarCompiler(tokenizer.to_json(), self.vocab_size, sorted(self.eos_token_ids))
        self.think_tags = ThinkTags.of(config.reasoning_parser, self._encode_text) \
            if config.reasoning_parser is not None else None
        # for embedding requests that name none (an encoder's own default: its first token, [CLS])
        self.default_pooling = default_pooling(model_dir, "cls" if self.encoder else "last")
        # sentence-transformers' Dense modules after the pooling, if the checkpoint has them (EmbeddingGemma's)
        self.projection = DenseProjection.load(model_dir)
        # A sequence-classification model's labels and activations (None for other models): it only pools.
        self.classifier = Classifier.from_config(model_config.raw, model_config.num_labels,
                                                 runner.model.classifier_pooling)
        # What unset request fields default to: the checkpoint's recommended sampling (generation_config.json).
        self.sampling_defaults = sampling_defaults(config.generation_config, model_dir,
                                                   config.override_generation_config)

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets no sampling field gets: SamplingParams' defaults, with the checkpoint's
        generation_config.json values in their place (see `sampling_defaults`)."""
        return SamplingParams(**self.sampling_defaults)

    # ------------------------------------------------------------------ a request
    def make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                      cache_salt: Optional[str] = None, arrival_time: Optional[float] = None,
                      prompt_token_ids: Optional[list[int]] = None, grammar: Optional[Grammar] = None,
                      lora_request: LoRAType = None, pooling: Optional[PoolingParams] = None,
                      images: Optional[tuple[ImageInput, ...]] = None, stream: bool = True,
                      ) -> tuple[Optional[str], list[Request]]:
        """(the prompt's text, or None where it no longer matches the tokens; one `Request` per sequence: `n > 1`
        fans out). ValueError, before anything is made, for a request the model or the pool cannot take. See
        `LLMEngine.add_request` for the arguments."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, ids, images, encoder_input = self._inputs(prompt, params, pooling, prompt_token_ids, images)
        if pooling is not None:
            params, pooling = SamplingParams(temperature=0.0), self.resolve_pooling(pooling)
        max_tokens = self.validate(ids, params, pooling=pooling is not None)
        if params.prompt_logprobs is not None and pooling is None and any(im.features is not None for im in images):
            raise ValueError("prompt_logprobs is not supported with prompt_embeds (the prompt has no tokens)")
        adapter = self.resolve_lora(lora_request)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        extras = self._extras(params, ids, grammar)
        shared = dict(max_tokens=max_tokens, eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                      priority=priority, cache_salt=cache_salt, block_size=self.config.block_size,
                      hash_blocks=self.prefix_caching, parent_id=request_id, lora=adapter, pooling=pooling,
                      long_rope_threshold=self.long_rope_threshold, images=images,
                      whole_images=bool(images) and self.runner.model.bidirectional_images,
                      whole_prompt=self.encoder, encoder_input=encoder_input, streamed=stream and pooling is None)
        return text, [self._sequence(request_id, i, ids, params, shared, extras) for i in range(params.n)]

    def _inputs(self, prompt: PromptType, params: SamplingParams, pooling: Optional[PoolingParams],
                ids: Optional[list[int]], images: Optional[tuple[ImageInput, ...]],
                ) -> tuple[Optional[str], list[int], tuple[ImageInput, ...], Any]:
        """(text, token ids, images, an encoder-decoder model's encoder input) of a request's prompt, truncated.
        `ids` (and `images`, placed in them already): the prompt processed by the caller (`process_prompt`)."""
        options = pooling if pooling is not None else params
        if ids is None:
            text, ids, images = self.process_prompt(prompt, getattr(options, "truncate_prompt_tokens", None))
        else:
            text = prompt if isinstance(prompt, str) else None
            if images is None:
                ids, images = self.place_images(ids, None)
        encoder_input = None
        if self.speech is not None:  # (its "images" are its audio: see place_images)
            encoder_input, images = self.speech.take(images), ()
        return (*self.truncate(text, ids, images, options), encoder_input)

    def _extras(self, params: SamplingParams, ids: list[int], grammar: Optional[Grammar]) -> _Extras:
        bad_words = self._bad_words_ids(params.bad_words) if params.bad_words else None
        if bad_words and params.allowed_token_ids:
            banned = {seq[0] for seq in bad_words if len(seq) == 1}
            if set(params.allowed_token_ids) <= banned:
                raise ValueError("allowed_token_ids: every token it allows is one of bad_words: nothing could be "
                                 "generated")
        speech_rules = self.speech.rules(self.tokenizer, ids) if self.speech is not None else None
        return _Extras(grammar, bad_words, speech_rules, self._think_tags(params), self._prediction(params))

    @staticmethod
    def _sequence(request_id: str, i: int, ids: list[int], params: SamplingParams, shared: dict[str, Any],
                  extras: _Extras) -> Request:
        """The request's i-th sequence."""
        seq_params = params
        if params.n > 1 and params.seed is not None:
            seq_params = params.clone(seed=params.seed + i)  # distinct but reproducible samples
        req = Request(request_id if params.n == 1 else f"{request_id}-{i}", ids, seq_params, seq_index=i, **shared)
        if extras.grammar is not None:
            req.matcher = extras.grammar.matcher()
        req.bad_words_ids = extras.bad_words
        req.speech_rules = extras.speech_rules
        if extras.think is not None:
            req.think = extras.think.budget(ids, params.thinking_token_budget)  # type: ignore[arg-type]
        req.prediction = extras.prediction
        return req

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

    def resolve_lora(self, lora: LoRAType) -> Optional[LoRAAdapter]:
        return self.loras.resolve(lora)

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

    # ------------------------------------------------------------------ validation
    def validate(self, token_ids: list[int], params: SamplingParams, pooling: bool = False) -> int:
        """Check one prompt against the model and the pool; returns the resolved max_tokens (0 for an embedding
        request, `pooling`, which may fill the whole context)."""
        self._check_task(pooling)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        n, limit = len(token_ids), self.max_model_len
        if pooling:
            if n > limit:
                raise ValueError(f"prompt is {n} tokens long, but max_model_len is {limit}")
            self._check_blocks(n, "prompt")
            return 0
        if n >= limit:
            raise ValueError(f"prompt is {n} tokens long, but max_model_len is {limit}: it must be shorter "
                             f"than {limit} tokens to leave room for at least one generated token")
        self._check_token_ids(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                             f"max_model_len {limit}; max_tokens may be at most {limit - n}")
        self._check_blocks(n + max_tokens, "prompt + max_tokens", "; lower max_tokens or enlarge the cache")
        return max_tokens

    def _check_task(self, pooling: bool) -> None:
        """Only a model with an LM head generates."""
        if not pooling and self.classifier is not None:
            raise ValueError(f"{self.classifier.architecture} is a sequence-classification model: it has no LM head "
                             "and cannot generate; classify prompts (or score pairs, with one label) instead")
        if not pooling and self.encoder:
            arch = self.model_config.raw["architectures"][0]
            raise ValueError(f"{arch} is an encoder (embedding) model: it cannot generate; embed prompts (or score "
                             "pairs) instead")

    def _check_blocks(self, tokens: int, what: str, advice: str = "") -> None:
        """`tokens` fit in the KV pool (were it empty)."""
        need = cdiv(tokens, self.config.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(f"{what} needs {need} KV blocks but the cache holds {self.num_kv_blocks}{advice}")

    def _check_token_ids(self, params: SamplingParams) -> None:
        """logit_bias and allowed_token_ids name tokens of the vocabulary, and leave something to generate."""
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

    # ------------------------------------------------------------------ prompts
    def process_prompt(self, prompt: PromptType, keep_last: Optional[int] = None) -> Inputs:
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

    def truncate(self, text: Optional[str], ids: list[int], images: tuple[ImageInput, ...], options: Any) -> Inputs:
        """The prompt cut to its last `truncate_prompt_tokens` tokens if its SamplingParams / PoolingParams ask
        (the text no longer matches the tokens then: None). An encoder's keeps its start and its last token instead:
        [CLS] text... [SEP] cut as its tokenizer (and sentence-transformers) would cut it, framing kept."""
        keep = getattr(options, "truncate_prompt_tokens", None)
        if keep is None or len(ids) <= keep:
            return text, ids, images
        if self.encoder and not images:
            return None, ids[:keep - 1] + ids[-1:] if keep > 1 else ids[:1], ()
        return (None, *prompt_embeds.truncate_inputs(ids, images, keep))  # type: ignore[return-value]

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

    # ------------------------------------------------------------------ images, audio (streamer/multimodal/)
    def place_images(self, token_ids: list[int], data: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The prompt with its images' placeholders expanded, and the images (from a prompt's multi_modal_data;
        None: no images, which a prompt with placeholders must then not have). ValueError for a mismatch."""
        if self.speech is not None:  # a speech model: the prompt's audio, for its encoder
            return token_ids, (self.speech.encoder_input(data),)
        if self.image_prompts is None:
            if data is not None:
                self._refuse_media(data)
            return token_ids, ()
        return place_media(self.image_prompts, token_ids, data)

    def _refuse_media(self, data: Any) -> None:
        """A text model's prompt came with media: ValueError naming them."""
        of = self.model_config.text_only_of
        given = [k for k in ("image", "video", "audio") if isinstance(data, dict) and data.get(k) is not None]
        what = {"image": "images", "video": "video", "audio": "audio"}[given[0]] if len(given) == 1 else "images"
        raise ValueError(f"multi_modal_data: this model takes no {what}" + (
            f" ({of} is served as its text model alone: its vision encoder is not supported)" if of else ""))


def place_media(mm: Union[ImagePrompts, AudioPrompts], token_ids: list[int],
                data: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A multimodal model's prompt with its media's placeholders expanded, and the media's inputs
    (`InputProcessor.place_images`; data parallelism's front calls it with the prompts object a replica sent).
    ValueError for media the model does not take or a mismatch."""
    if isinstance(mm, AudioPrompts):
        return _place_audio(mm, token_ids, data)
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

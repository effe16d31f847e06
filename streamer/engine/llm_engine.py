"""The engine: requests in, incremental outputs out, one `step()` at a time.

`LLMEngine` is the API (the offline `LLM`, `AsyncEngine`, the server and the tests call it) over three owners,
in the order a request meets them (docs/architecture.md):
- `InputProcessor` (input_processor.py): a prompt and its parameters -> validated `Request`s, one per sequence;
- `EngineCore` (engine_core.py): the scheduler, the KV cache, the persistent batch and the model runner;
  scheduling and running steps, and speculative decoding's drafts;
- `OutputProcessor` (output_processor.py): a step's runner outputs -> `SeqUpdate`s (tokens appended, stop checks,
  text, logprobs, pooled results), and the live sequences' output state.

`step()` = `core.schedule()` -> `runner.execute()` -> `process()`. The async engine calls the parts separately
(`runner.launch()` on the device thread, `PendingStep.result()` when its tokens are needed) so that the device
works while the event loop does everything else.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

from streamer.config import EngineConfig
from streamer.core.scheduler import SchedulerOutput
from streamer.engine.engine_core import EngineCore
from streamer.engine.input_processor import InputProcessor, Inputs, LoRAType, PromptType
from streamer.engine.lora import LoRAAdapter, LoRARegistry
from streamer.engine.output_processor import OutputProcessor, SeqState, SeqUpdate, TokenTimings
from streamer.engine.pooling import PoolingParams, st_max_seq_length
from streamer.engine.structured_output import Grammar
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.multimodal.inputs import ImageInput
from streamer.outputs import CompletionOutput
from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer
from streamer.worker.input_batch import StepInputs
from streamer.worker.model_runner import RunnerOutput

logger = logging.getLogger("streamer")


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


def _load_tokenizer(config: EngineConfig, model_dir: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir)
    tokenizer.token_bytes  # noqa: B018 (the detokenizer's byte table: built at start-up, not at a request)
    if config.chat_template is not None:
        from streamer.server.chat_template import load_chat_template
        tokenizer.chat_template = load_chat_template(config.chat_template)
    return tokenizer


def _max_model_len(config: EngineConfig, model_config: ModelConfig, model_dir: Path) -> int:
    """The context length served: the configured one, within the model's limit."""
    limit = model_config.max_position_embeddings
    st_limit = st_max_seq_length(model_dir)
    if st_limit is not None and st_limit < limit:  # (as vLLM caps it: longer inputs are refused, or truncated)
        logger.info("max_model_len capped at %d, sentence_bert_config.json's max_seq_length (sentence-"
                    "transformers truncates there)", st_limit)
        limit = st_limit
    if config.max_model_len and config.max_model_len > limit:
        logger.warning("max_model_len %d exceeds the model's limit (max_position_embeddings, or a "
                       "sentence-transformers max_seq_length); using %d", config.max_model_len, limit)
    return min(config.max_model_len or limit, limit)


def _check_multimodal(config: EngineConfig, model_config: ModelConfig) -> None:
    if registry.entry(model_config.architecture).kind == registry.ENCODER_DECODER and config.num_speculative_tokens:
        raise ValueError("speculative decoding does not run with an encoder-decoder model (Whisper)")
    if model_config.multimodal is None:
        return
    # (the checkpoint's own MTP layer drafts for text and image prompts alike: it reads the placeholder tokens'
    # embeddings and 1-D positions where the target reads image features at M-RoPE ones, which costs some
    # acceptance at images, never correctness; other draft models are not wired for images yet)
    if config.drafts_with_model and config.speculative_method != "mtp":
        raise ValueError("speculative decoding with a draft model does not run with a vision-language model yet "
                         "(a checkpoint's own MTP layer does: speculative_method='mtp')")


def _fit_budget_to_encoder(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> EngineConfig:
    """An encoder computes each prompt in one step: the step's token budget is raised to hold the longest (as
    vLLM does; a smaller max_model_len keeps it smaller)."""
    budget = config.max_num_batched_tokens
    if model_config.bidirectional and budget < max_model_len:
        logger.warning("max_num_batched_tokens raised from %d to max_model_len %d: an encoder computes each "
                       "prompt whole, in one step", budget, max_model_len)
        return dataclasses.replace(config, max_num_batched_tokens=max_model_len)
    return config


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        if config.hf_overrides:
            logger.info("config.json overridden: %s", ", ".join(sorted(config.hf_overrides)))
        tokenizer = _load_tokenizer(config, self.model_dir)
        self.max_model_len = _max_model_len(config, self.model_config, self.model_dir)
        _check_multimodal(config, self.model_config)
        self.config = config = _fit_budget_to_encoder(config, self.model_config, self.max_model_len)
        self.core = core = EngineCore(config, self.model_dir, self.model_config, self.max_model_len)
        self.loras = LoRARegistry(config.enable_lora, config.max_lora_rank, core.runner.place_lora,
                                  core.scheduler.lora_slots)
        self.input = InputProcessor(config, self.model_dir, self.model_config, tokenizer, self.max_model_len,
                                    core.runner, core.kv.num_blocks, core.prefix_caching, self.loras)
        self.output = OutputProcessor(core, tokenizer, self.max_model_len, config.stream_interval,
                                      config.jump_forward, self.input.classifier, self.input.projection)
        self._ids = itertools.count()
        self._expose_parts()

    def _expose_parts(self) -> None:
        """The three owners' parts that callers (the async engine, the server, tests, benches) reach through the
        engine. The same objects, none reassigned after start-up; what changes as steps run (counters) and what
        callers may set are properties below."""
        core, inp = self.core, self.input
        self.runner, self.kv, self.scheduler, self.batch = core.runner, core.kv, core.scheduler, core.batch
        self.prefix_caching, self.suffix = core.prefix_caching, core.suffix
        self.encoder, self.encoder_decoder, self.long_rope_threshold = core.encoder, core.encoder_decoder, \
            core.long_rope_threshold
        self.image_prompts, self.speech, self.grammars, self.think_tags = inp.image_prompts, inp.speech, \
            inp.grammars, inp.think_tags
        self.eos_token_ids, self.vocab_size = inp.eos_token_ids, inp.vocab_size
        self.classifier, self.projection, self.default_pooling = inp.classifier, inp.projection, inp.default_pooling
        self.sampling_defaults = inp.sampling_defaults
        self.seqs, self.groups = self.output.seqs, self.output.groups  # (live sequences; user request -> their ids)

    # ------------------------------------------------------------------ state kept by the owners
    @property
    def tokenizer(self) -> Tokenizer:
        return self.input.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer) -> None:
        """(Tests wrap it to count its work: prompts are encoded, and outputs decoded, with the new one.)"""
        self.input.tokenizer = self.output.tokenizer = tokenizer

    @property
    def timings(self) -> Optional[TokenTimings]:
        """Token latencies for whoever keeps metrics (the async engine sets it and takes them): measured as sequences
        get their tokens (the output processor) and as steps run (the core), since updates do not come token by
        token (final-only, stream_interval)."""
        return self.output.timings

    @timings.setter
    def timings(self, timings: Optional[TokenTimings]) -> None:
        self.output.timings = self.core.timings = timings

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.core.async_scheduling = on

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_overlapped_steps(self) -> int:
        return self.core.num_overlapped_steps

    @property
    def num_draft_tokens(self) -> int:
        return self.core.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.core.num_accepted_tokens

    @property
    def last_step(self) -> tuple[float, float, Optional[float]]:
        """The last step's (predicted, measured, budget) period."""
        return self.core.last_step

    # ------------------------------------------------------------------ requests
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
        if request_id in self.output.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, reqs = self.input.make_requests(request_id, prompt, params, priority, cache_salt, arrival_time,
                                              prompt_token_ids, grammar, lora_request, pooling, images, stream)
        states = self.output.add(request_id, reqs, text, stream)
        for req in reqs:
            self.core.add(req)
        return states

    def abort(self, request_id: str) -> list[SeqState]:
        """Abort a user request (all of its sequences); returns the states that were still live."""
        return self.output.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step (EngineCore, OutputProcessor)
    def step(self) -> list[SeqUpdate]:
        step = self.core.schedule()
        if step is None:
            return []
        sched, inputs = step
        return self.process(sched, self.runner.execute(inputs))

    def schedule(self) -> Optional[tuple[SchedulerOutput, StepInputs]]:
        """Schedule and prepare the next step; None when nothing can run now."""
        return self.core.schedule()

    def schedule_next(self, running: Optional[StepInputs]) -> Optional[tuple[SchedulerOutput, StepInputs]]:
        """The next step to queue, given the one still running (see `EngineCore.schedule_next`)."""
        return self.core.schedule_next(running)

    def can_overlap(self, running: StepInputs) -> bool:
        return self.core.can_overlap(running)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        return self.core.prepare(sched)

    def process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[SeqUpdate]:
        """A step's outputs: the batch records its tokens, the output processor makes the updates, and the step's
        period goes to the step-time model."""
        self.core.record(result)
        updates = self.output.process(result)
        self.core.observe_step(sched)
        if self.pipeline_depth > 1:
            self.scheduler.landed(sched)
        return updates

    @property
    def pipeline_depth(self) -> int:
        """Steps that may be in flight at once: the pipeline stages (1: none, or async scheduling's overlap)."""
        return self.config.steps_in_flight

    @staticmethod
    def undelivered(state: SeqState) -> Optional[SeqUpdate]:
        """What `process` has not handed out of a sequence yet (see `OutputProcessor.undelivered`)."""
        return OutputProcessor.undelivered(state)

    @staticmethod
    def completion(state: SeqState) -> CompletionOutput:
        return OutputProcessor.completion(state)

    def enable_stall_free(self) -> None:
        """Plan steps against the inter-token budget (see `EngineCore.enable_stall_free`; on the device thread)."""
        self.core.enable_stall_free()

    # ------------------------------------------------------------------ prompts (InputProcessor)
    def process_prompt(self, prompt: PromptType, keep_last: Optional[int] = None) -> Inputs:
        return self.input.process_prompt(prompt, keep_last)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        return self.input.tokenize_prompt(prompt)

    def fit_prompt_text(self, text: str, keep_last: Optional[int] = None) -> str:
        return self.input.fit_prompt_text(text, keep_last)

    def place_images(self, token_ids: list[int], data: Any) -> tuple[list[int], tuple[ImageInput, ...]]:
        return self.input.place_images(token_ids, data)

    def embeds_prompt(self, prompt: dict) -> tuple[list[int], tuple[ImageInput, ...]]:
        return self.input.embeds_prompt(prompt)

    def truncate(self, text: Optional[str], ids: list[int], images: tuple[ImageInput, ...], options: Any) -> Inputs:
        return self.input.truncate(text, ids, images, options)

    def validate(self, token_ids: list[int], params: SamplingParams, pooling: bool = False) -> int:
        return self.input.validate(token_ids, params, pooling)

    def resolve_pooling(self, pooling: PoolingParams) -> PoolingParams:
        return self.input.resolve_pooling(pooling)

    def resolve_lora(self, lora: LoRAType) -> Optional[LoRAAdapter]:
        return self.input.resolve_lora(lora)

    def default_sampling_params(self) -> SamplingParams:
        return self.input.default_sampling_params()

    # ------------------------------------------------------------------ LoRA adapters (streamer/engine/lora.py)
    def load_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        return self.loras.load(name, path)

    def register_lora(self, adapter: LoRAAdapter) -> None:
        self.loras.register(adapter)

    def add_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        return self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        self.loras.remove(name)

    # ------------------------------------------------------------------ weights, the prefix cache, stats
    def update_weights(self, weights: WeightsArg, partial: bool = False) -> None:
        """New weights for the running model (`ModelRunner.update_weights`): a checkpoint folder of it, or all of
        its tensors by checkpoint name (`new_weights`; `partial`: some of them); then a reset prefix cache (its KV
        came from the old weights). Requests already running go on with the new weights over their old KV, as in
        SGLang and vLLM; abort or finish them first for outputs from the new weights alone."""
        self.runner.update_weights(new_weights(weights), partial)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns the blocks forgotten."""
        return self.core.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def close(self) -> None:
        """Release what outlives the engine object's references: tensor-parallel worker processes."""
        self.core.close()

"""AsyncEngine: the engine on an asyncio event loop, with the model step on a dedicated device thread.

The loop owns every piece of mutable engine state (scheduler, KV bookkeeping, detokenizers): it
schedules step N+1 and queues it on the device thread while step N computes (async scheduling), then
processes, detokenizes and streams step N's tokens while step N+1 computes, and meanwhile accepts requests and
serves HTTP. Only `ModelRunner.launch` runs on the device thread, and it reads nothing the loop changes while
it runs (its inputs are fresh arrays; tokens not yet known on the host are read on the device).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from streamer.config import EngineConfig
from streamer.core.kv_events import KVEvent
from streamer.core.scheduler import SchedulerOutput
from streamer.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from streamer.engine.input_processor import LoRAType, PromptType
from streamer.engine.llm_engine import LLMEngine, WeightsArg, new_weights
from streamer.engine.lora import LoRARequest
from streamer.engine.metrics import EngineMetrics, StatsLogger
from streamer.engine.output_processor import SeqUpdate, TokenTimings
from streamer.engine.pooling import Classifier, PoolingParams, encode_pair
from streamer.multimodal.inputs import ImagePrompts
from streamer.outputs import ClassificationOutput, CompletionOutput, EmbeddingOutput, RequestOutput, StreamOutput
from streamer.sampling_params import SamplingParams
from streamer.threads import to_own_thread
from streamer.worker.input_batch import StepInputs

T = TypeVar("T")
logger = logging.getLogger("streamer")

_TOKENIZE_OFF_LOOP_CHARS = 4096  # longer prompts are tokenized on a worker thread


def _text_of(prompt: dict) -> str:
    text = prompt.get("prompt")
    return text if isinstance(text, str) and "prompt_token_ids" not in prompt else ""


class RankLostError(RuntimeError):
    """A tensor-parallel rank's process, node or link is gone (the message says which rank)."""


class EngineDeadError(RuntimeError):
    """The device thread failed: no request can make progress any more."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (`max_waiting`): try again later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestStream:
    """Async iterator over one request's incremental outputs. Leaving it early aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, num_seqs: int, prompt_token_ids: list[int],
                 queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.prompt_token_ids = prompt_token_ids
        self.prompt_tokens = len(prompt_token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        # Predicted Outputs, where drafting used the prediction: per sequence, (its tokens, how many were accepted)
        self.predictions: dict[int, tuple[int, int]] = {}
        self._queue = queue
        self._finished_seqs = 0
        self._next: Optional[StreamOutput | BaseException] = None  # taken off the queue, not merged

    @property
    def finished(self) -> bool:
        return self._finished_seqs >= self.num_seqs

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamOutput:
        if self.finished:
            raise StopAsyncIteration
        item, self._next = self._next, None
        if item is None:
            try:
                item = await self._queue.get()
            except BaseException:
                self.close()
                raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        item = self._merge_waiting(item)
        self.completion_tokens += len(item.token_ids)
        if item.finished:
            self._finished_seqs += 1
            if self.finished:
                item.usage = self.usage()
        return item

    def _merge_waiting(self, item: StreamOutput) -> StreamOutput:
        """Outputs of the same sequence that piled up while the consumer was busy (a slow client, a loaded loop)
        go out as one: fewer, larger chunks exactly when the consumer is behind, as vLLM's output collector
        does. A consumer that keeps up gets every step's output on its own."""
        while not item.finished and not self._queue.empty():  # (a pooling result comes finished)
            later = self._queue.get_nowait()
            if isinstance(later, BaseException) or later.index != item.index:
                self._next = later
                break
            item.merge(later)
        return item

    def usage(self) -> dict:
        u = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
             "total_tokens": self.prompt_tokens + self.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.predictions:
            u["completion_tokens_details"] = self.prediction_details()
        return u

    def prediction_details(self) -> dict[str, int]:
        """OpenAI's: the prediction's tokens that the output took (drafts accepted) and those it did not."""
        accepted = sum(a for _, a in self.predictions.values())
        total = sum(n for n, _ in self.predictions.values())
        return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": max(total - accepted, 0)}

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self._finished_seqs = self.num_seqs
            self.engine.abort_now(self.request_id)

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine: Optional[LLMEngine] = None
        self.metrics: Optional[EngineMetrics] = None
        self._streams: dict[str, tuple[RequestStream, asyncio.Queue]] = {}
        self._dead: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None
        self._stats_task: Optional[asyncio.Task] = None
        self._device: Optional[ThreadPoolExecutor] = None
        self._waiter: Optional[ThreadPoolExecutor] = None  # waits for a launched step's tokens (CUDA)
        self._wakeup: Optional[asyncio.Event] = None
        self._idle: Optional[asyncio.Event] = None
        # pause_generation: no step is scheduled while paused; the loop sets `_quiet` once none is in flight
        self._paused = False
        self._quiet: Optional[asyncio.Event] = None
        self._resumed: Optional[asyncio.Event] = None
        # Tensor parallelism: which rank was lost (the engine then fails), set from the ranks' monitor
        self.rank_lost: Optional[str] = None
        self._rank_lost: Optional[asyncio.Event] = None
        # With config.kv_events: called on the loop after each step with what the prefix cache stored and evicted
        # in it (core/kv_events.py), for the data-parallel router's reports and the --kv-events-config publisher
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = []

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> "AsyncEngine":
        loop = asyncio.get_running_loop()
        self._device = ThreadPoolExecutor(1, thread_name_prefix="streamer-device")
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="streamer-wait")
        # Load on the device thread: it owns the device from now on, and the loop stays responsive.
        self.engine = await loop.run_in_executor(self._device, LLMEngine, self.config)
        await loop.run_in_executor(self._device, self.engine.enable_stall_free)  # (it streams: see step_time.py)
        self.metrics = EngineMetrics(self.stats, self.model_name)
        self.engine.timings = TokenTimings()  # (the engine measures token latencies; _dispatch takes them)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._quiet, self._resumed = asyncio.Event(), asyncio.Event()
        self._task = asyncio.create_task(self._run() if self.engine.pipeline_depth == 1 else self._run_pipelined(),
                                         name="streamer-engine-loop")
        self._rank_lost = asyncio.Event()
        workers = self.engine.runner.tp_workers
        if workers is not None:  # a lost rank fails the engine at once, even while a step waits in a collective
            workers.watch(lambda why: loop.call_soon_threadsafe(self._on_rank_lost, why))
        if self.config.log_stats_interval > 0:
            self._stats_task = asyncio.create_task(self._log_stats(self.config.log_stats_interval),
                                                   name="streamer-stats-log")
        return self

    async def _log_stats(self, interval: float) -> None:
        stats = StatsLogger(self.metrics, self.stats)  # type: ignore[arg-type]
        while True:
            await asyncio.sleep(interval)
            line = stats.line()
            if line is not None:
                logger.info("%s", line)

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop the engine. With a drain timeout, in-flight requests may finish first (a paused engine resumes
        for that); the rest are aborted."""
        if drain_timeout > 0 and self._paused:
            await self.resume_generation()
        if drain_timeout > 0 and self.is_alive and self._idle is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout)
            except asyncio.TimeoutError:
                logger.warning("drain timeout: aborting %d request(s)", len(self._streams))
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for rid in list(self._streams):
            self.abort_now(rid)
        if self._device is not None:
            # (after a lost rank the device thread may wait in a collective until its timeout: not for it)
            self._device.shutdown(wait=self.rank_lost is None, cancel_futures=True)
            self._device = None
        if self.engine is not None:
            self.engine.close()
        if self._waiter is not None:
            self._waiter.shutdown(wait=True, cancel_futures=True)
            self._waiter = None

    async def __aenter__(self) -> "AsyncEngine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ properties
    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._task is not None and not self._task.done()

    @property
    def model_name(self) -> str:
        return str(self.config.model) if self.config.model else "streamer-demo"

    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    def place_images(self, token_ids: list[int], data: Any) -> tuple[list[int], tuple]:
        """See `LLMEngine.place_images` (thread-safe: it reads the model's image settings only)."""
        return self._core.place_images(token_ids, data)

    @property
    def image_prompts(self) -> Optional[ImagePrompts]:
        """How the model takes images (None: it takes none)."""
        return self._core.image_prompts

    @property
    def takes_media(self) -> bool:
        """Whether prompts may carry images, video or audio (which make large request bodies)."""
        return self._core.image_prompts is not None or self._core.speech is not None

    @property
    def classifier(self) -> Optional[Classifier]:
        """A sequence-classification model's labels and activations (None: the model is no classifier)."""
        return self._core.classifier

    @property
    def num_overlapped_steps(self) -> int:
        return self._core.num_overlapped_steps

    @property
    def _core(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("the engine is not started: use `async with AsyncEngine(...)` or `await start()`")
        return self.engine

    def stats(self) -> dict:
        e = self._core
        s = e.stats()
        s["running_by_priority"] = _count_by_priority(e.scheduler.running)
        s["waiting_by_priority"] = _count_by_priority(e.scheduler.waiting)
        s["num_requests"] = len(self._streams)
        return s

    async def embed(self, prompt: PromptType, pooling: Optional[PoolingParams] = None,
                    request_id: Optional[str] = None, priority: int = 0, lora_request: LoRAType = None,
                    ) -> EmbeddingOutput:
        """The prompt's embedding: the model's final hidden states pooled (streamer/engine/pooling.py)."""
        rid, vec, ids, cached = await self._pool(prompt, (pooling or PoolingParams()).for_task("embed"), request_id,
                                                 priority, lora_request)
        return EmbeddingOutput(rid, vec, ids, cached)

    async def classify(self, prompt: PromptType, pooling: Optional[PoolingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0, lora_request: LoRAType = None,
                       ) -> ClassificationOutput:
        """The prompt's label probabilities from a sequence-classification model (see `LLM.classify`)."""
        rid, probs, ids, cached = await self._pool(prompt, (pooling or PoolingParams()).for_task("classify"),
                                                   request_id, priority, lora_request)
        return ClassificationOutput(rid, probs, self.classifier.label(probs), ids, cached)  # type: ignore[union-attr]

    async def encode_pair(self, text_1: str, text_2: str) -> list[int]:
        """A cross-encoder's prompt for the pair (streamer/engine/pooling.py's `encode_pair`), long texts off the loop."""
        if len(text_1) + len(text_2) > _TOKENIZE_OFF_LOOP_CHARS:
            return await asyncio.to_thread(encode_pair, self.tokenizer, text_1, text_2)
        return encode_pair(self.tokenizer, text_1, text_2)

    async def _pool(self, prompt: PromptType, pooling: PoolingParams, request_id: Optional[str], priority: int,
                    lora_request: LoRAType) -> tuple[str, list[float], list[int], int]:
        """Run one pooling request: (its id, its result, its prompt's token ids, how many of them were cached)."""
        stream = await self.add_request(prompt, None, request_id, priority, lora_request=lora_request,
                                        pooling=pooling)
        try:
            async for item in stream:
                if item.finished:
                    if item.embedding is None:  # aborted (shutdown)
                        raise EngineDeadError(f"the {pooling.task} request was {item.finish_reason}ed")
                    return stream.request_id, item.embedding, list(stream.prompt_token_ids), stream.cached_tokens
        finally:
            stream.close()
        raise EngineDeadError(f"the {pooling.task} request ended without a result")

    async def beam_search(self, prompt: PromptType, params: BeamSearchParams,
                          lora_request: LoRAType = None) -> BeamSearchOutput:
        """The `beam_width` best continuations of one prompt (streamer/engine/beam_search.py); each step's beams run as
        concurrent requests, which the engine batches."""
        core = self._core
        ids = await self.encode(prompt) if isinstance(prompt, str) else core.tokenize_prompt(prompt)[1]
        core.validate(ids, SamplingParams(max_tokens=1))
        search = BeamSearch(core, [ids], params)
        while requests := search.step_requests():
            search.advance(await asyncio.gather(*(self.generate(r, search.sampling, lora_request=lora_request)
                                                  for r in requests)))
        return search.results()[0]

    # ------------------------------------------------------------------ weights, pausing, the prefix cache
    async def update_weights(self, weights: WeightsArg, partial: bool = False) -> None:
        """New weights (a checkpoint folder of the same model, or all of its tensors by name, or with `partial` some
        of them: `LLM.update_weights`), loaded on the device thread between two steps (steps queued before it run
        with the old weights, those after with the new). The prefix cache is reset first, here, on the loop: the steps already queued registered
        their blocks before it (so they are dropped), and every step scheduled after it computes after the update
        (the device thread takes work in order), so nothing cached from then on comes from the old weights.
        ValueError (nothing changed) for another model's weights; RuntimeError for a failure part-way (a corrupt
        file): the weights are then mixed until a complete set is loaded again."""
        self._check_alive()
        core = self._core
        source = new_weights(weights)
        core.reset_prefix_cache()
        await asyncio.get_running_loop().run_in_executor(self._device, core.runner.update_weights, source, partial)

    async def on_device(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the device thread, between two steps (work on the model outside the step loop: Whisper's
        word alignment)."""
        self._check_alive()
        return await asyncio.get_running_loop().run_in_executor(self._device, fn, *args)

    async def pause_generation(self, mode: str = "keep") -> int:
        """Stop computing (RL weight syncs: pause, `update_weights`, resume): no step is scheduled until
        `resume_generation`, and this returns once the step in flight, if any, has been processed. "keep": the
        requests stay where they are, their KV cache too, and go on when resumed; "abort": every request in flight
        ends now with finish_reason "abort"; "retract": the running requests give their KV cache back (memory for
        the update) and wait, to be recomputed when resumed (their outputs go on where they were). Requests that
        arrive meanwhile wait. Returns the requests kept, aborted or retracted."""
        if mode not in ("keep", "abort", "retract"):
            raise ValueError(f"mode must be 'keep', 'abort' or 'retract', got {mode!r}")
        self._check_alive()
        assert self._quiet is not None and self._resumed is not None and self._wakeup is not None
        if not self._paused:
            self._paused = True
            self._resumed.clear()
            self._quiet.clear()
            self._wakeup.set()  # (an idle loop wakes to notice)
        await self._quiet.wait()
        self._check_alive()  # (the loop also sets `_quiet` when it dies)
        count = len(self._streams)
        if mode == "abort":
            for rid in list(self._streams):
                self.abort_now(rid)
        elif mode == "retract":
            count = self._core.scheduler.retract_all()
        return count

    async def resume_generation(self) -> None:
        """Schedule steps again after `pause_generation` (a no-op when not paused)."""
        if self._paused:
            assert self._resumed is not None and self._wakeup is not None and self._quiet is not None
            self._paused = False
            self._resumed.set()
            self._wakeup.set()
            self._quiet.set()  # (a pause still waiting returns: this resume overtook it)

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; running requests go on. (Called on the loop, so between two steps'
        scheduling: what a step in flight reads was settled when it was scheduled.)"""
        self._check_alive()
        n = self._core.reset_prefix_cache()
        if self.config.kv_events:  # AllBlocksCleared now, not at the next step (the server may be idle)
            self._publish_kv_events()
        return n

    # ------------------------------------------------------------------ LoRA adapters
    async def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT LoRA adapter folder under `name`; it is read and checked on a worker thread."""
        core = self._core
        if name in core.loras:  # (checked again on registering: another call may have raced this one)
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        core.register_lora(await to_own_thread(core.load_lora, name, path))

    def remove_lora(self, name: str) -> None:
        self._core.remove_lora(name)

    @property
    def loras(self) -> dict:
        return dict(self._core.loras)

    # ------------------------------------------------------------------ requests
    async def encode(self, text: str, add_special_tokens: bool = True, keep_last: Optional[int] = None) -> list[int]:
        """A prompt's token ids; a text longer than the model could take is refused untokenized, and a long one is
        tokenized on a worker thread (`LLMEngine.fit_prompt_text`; `keep_last`: its truncate_prompt_tokens)."""
        tok = self.tokenizer
        text = self._core.fit_prompt_text(text, keep_last)
        if len(text) > _TOKENIZE_OFF_LOOP_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's recommended sampling, by SamplingParams field (streamer/engine/generation_config.py)."""
        return self._core.sampling_defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request given no SamplingParams samples with (see `LLM.get_default_sampling_params`)."""
        return self._core.default_sampling_params()

    async def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                          request_id: Optional[str] = None, priority: int = 0,
                          cache_salt: Optional[str] = None, lora_request: LoRAType = None,
                          pooling: Optional[PoolingParams] = None, stream: bool = True) -> RequestStream:
        """Validate and enqueue a request; errors (ValueError, QueueFullError, EngineDeadError) raise here,
        before any output. Returns the stream of its outputs. `lora_request`: a registered adapter's name, or a
        LoRARequest (read on a worker thread and registered on first use). `pooling`: an embedding request
        (see `embed`). `stream=False`: one output per sequence, when it finishes, with everything (no wake-up
        for each token: for a caller that only wants the result)."""
        core = self._core
        self._check_alive()
        params = params if params is not None else core.default_sampling_params()
        text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        keep = getattr(pooling if pooling is not None else params, "truncate_prompt_tokens", None)
        if isinstance(prompt, str):
            ids, images = core.place_images(await self.encode(prompt, keep_last=keep), None)
        elif isinstance(prompt, dict) and (prompt.get("multi_modal_data") is not None or "prompt_embeds" in prompt
                                           or len(_text_of(prompt)) > _TOKENIZE_OFF_LOOP_CHARS):
            # (decoding and resizing images, checking and hashing embeddings, or tokenizing a long text takes a
            # while: off the loop)
            text, ids, images = await to_own_thread(core.process_prompt, prompt, keep)
        else:
            text, ids, images = core.process_prompt(prompt, keep)
        text, ids, images = core.truncate(text, ids, images, pooling if pooling is not None else params)
        self._check_alive()
        limit = self.config.max_waiting
        if limit is not None and core.scheduler.num_waiting + params.n > max(limit, params.n):
            raise QueueFullError(f"the server is overloaded: {core.scheduler.num_waiting} requests waiting "
                                 f"(max_waiting={limit})")
        if request_id is not None and request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(lora_request, LoRARequest) and lora_request.name not in core.loras:
            core.validate(ids, params, pooling=pooling is not None)
            adapter = await to_own_thread(core.load_lora, lora_request.name, lora_request.path)
            self._check_alive()
            if lora_request.name not in core.loras:  # (another request may have registered it meanwhile)
                core.register_lora(adapter)
        adapter = core.resolve_lora(lora_request)
        grammar = None
        if params.structured_outputs is not None:  # compiling can take a while for a big schema: off the loop
            core.validate(ids, params)
            grammar = await asyncio.to_thread(core.grammars.compile, params.structured_outputs)
            self._check_alive()
        states = core.add_request(request_id, text if text is not None else ids, params, priority=priority,
                                  cache_salt=cache_salt, prompt_token_ids=ids, grammar=grammar,
                                  lora_request=adapter, pooling=pooling, images=images, stream=stream)
        rid = states[0].req.parent_id or states[0].req.request_id
        queue: asyncio.Queue = asyncio.Queue()
        outputs = RequestStream(self, rid, len(states), ids, queue)
        self._streams[rid] = (outputs, queue)
        self._idle.clear()  # type: ignore[union-attr]
        self._wakeup.set()  # type: ignore[union-attr]
        return outputs

    async def stream(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                     request_id: Optional[str] = None, priority: int = 0,
                     cache_salt: Optional[str] = None, lora_request: LoRAType = None,
                     ) -> AsyncIterator[StreamOutput]:
        """`async for out in engine.stream(prompt, params)`: incremental outputs; usage on the last one."""
        stream = await self.add_request(prompt, params, request_id, priority, cache_salt, lora_request)
        try:
            async for item in stream:
                yield item
        finally:
            stream.close()

    async def generate(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0,
                       cache_salt: Optional[str] = None, lora_request: LoRAType = None) -> RequestOutput:
        stream = await self.add_request(prompt, params, request_id, priority, cache_salt, lora_request,
                                        stream=False)
        n = stream.num_seqs
        outs = [CompletionOutput(i, "", [], logprobs=[] if params and params.logprobs is not None else None)
                for i in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]  # joined at the end: `+=` on an attribute is quadratic
        prompt_logprobs = None
        try:
            async for item in stream:
                o = outs[item.index]
                texts[item.index].append(item.text)
                o.token_ids += item.token_ids
                if item.logprobs and o.logprobs is not None:
                    o.logprobs += item.logprobs
                if item.prompt_logprobs is not None and prompt_logprobs is None:
                    prompt_logprobs = item.prompt_logprobs
                if item.finished:
                    o.finish_reason, o.stop_reason = item.finish_reason, item.stop_reason
                    o.cumulative_logprob = item.cumulative_logprob
        finally:
            stream.close()
        for o, pieces in zip(outs, texts):
            o.text = "".join(pieces)
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        return RequestOutput(stream.request_id, text if isinstance(text, str) else None, list(stream.prompt_token_ids),
                             outs, True, num_cached_tokens=stream.cached_tokens, prompt_logprobs=prompt_logprobs)

    async def abort(self, request_id: str) -> None:
        self.abort_now(request_id)

    def abort_now(self, request_id: str) -> None:
        """Abort on the loop thread: blocks return to the pool before the next step is scheduled."""
        entry = self._streams.pop(request_id, None)
        held: dict[int, SeqUpdate] = {}  # what was not handed out yet (held, or final-only) goes with the abort
        sums: dict[int, Optional[float]] = {}
        if self.engine is not None:
            for state in self.engine.abort(request_id):
                pending = self.engine.undelivered(state)
                if pending is not None:
                    held[state.req.seq_index] = pending
                sums[state.req.seq_index] = state.summed_logprob
                if self.metrics is not None:
                    self.metrics.request_success.inc(finished_reason="abort", model_name=self.metrics.model_name)
        if entry is not None:
            stream, queue = entry
            if not stream.finished:
                for i in range(stream.num_seqs):
                    h = held.get(i)
                    queue.put_nowait(StreamOutput(request_id, i, h.new_token_ids, h.text, h.logprobs,
                                                  finish_reason="abort", cumulative_logprob=sums.get(i))
                                     if h is not None else
                                     StreamOutput(request_id, i, [], "", finish_reason="abort",
                                                  cumulative_logprob=sums.get(i)))
        self._maybe_idle()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has failed: {self._dead!r}")
        if self._task is None or self._task.done():
            raise EngineDeadError("the engine is not running")

    def _maybe_idle(self) -> None:
        if not self._streams and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        """The step pipeline. With async scheduling, step N+1 is scheduled, prepared and queued on the device
        thread before step N's results are processed, so the device never waits for the host's bookkeeping,
        detokenization or streaming of step N (those run while step N+1 computes)."""
        loop = asyncio.get_running_loop()
        core = self._core
        inflight: Optional[tuple[SchedulerOutput, StepInputs, asyncio.Future]] = None
        nxt = None
        try:
            while True:
                step = None if self._paused else core.schedule_next(inflight[1] if inflight is not None else None)
                nxt = None if step is None else (*step, loop.run_in_executor(self._device, core.runner.launch, step[1]))
                if inflight is not None:
                    sched, _, future = inflight
                    pending = await future
                    # CUDA: wait for its tokens off the loop, and off the device thread (queuing the next step).
                    result = (pending.result() if pending.ready
                              else await loop.run_in_executor(self._waiter, pending.result))
                    self._dispatch(core.process(sched, result))
                    if self.config.kv_events:  # (drained even with no sink: the log would grow)
                        self._publish_kv_events()
                elif nxt is None:
                    await self._wait_for_work()
                inflight = nxt
        except asyncio.CancelledError:
            if self._dead is not None:  # (failed from outside: `_on_rank_lost`)
                for pending in (inflight, nxt):
                    if pending is not None:
                        pending[2].add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        except BaseException as exc:  # the device thread (or the step) failed: fail everyone, loudly
            logger.exception("engine step failed; the engine is now dead")
            if nxt is not None:  # the step queued behind the failed one: its outcome no longer matters
                nxt[2].add_done_callback(lambda f: f.cancelled() or f.exception())
            self._fail(exc)

    def _publish_kv_events(self) -> None:
        events = self._core.kv.take_events()
        if events:
            for sink in self.kv_event_sinks:
                sink(events)

    async def _run_pipelined(self) -> None:
        """The step pipeline with P pipeline stages: up to P steps (each of other requests: the scheduler's
        `in_flight`) are launched on the device thread, which runs rank 0's stage of each and goes on to the next
        while later stages compute; the waiter thread takes each step's final hidden states back, in order, and
        samples; then the loop processes its tokens and launches the next step (worker/pipeline.py)."""
        loop = asyncio.get_running_loop()
        core = self._core
        depth = core.pipeline_depth
        inflight: collections.deque[tuple[SchedulerOutput, asyncio.Future]] = collections.deque()
        try:
            while True:
                while len(inflight) < depth and not self._paused and core.has_unfinished():
                    step = core.schedule()
                    if step is None:
                        break
                    if inflight:
                        core.core.num_overlapped_steps += 1
                    launched = loop.run_in_executor(self._device, core.runner.launch, step[1])
                    inflight.append((step[0], loop.create_task(self._pipeline_result(launched))))
                if inflight:
                    sched, result = inflight.popleft()
                    self._dispatch(core.process(sched, await result))
                    if self.config.kv_events:  # (drained even with no sink: the log would grow)
                        self._publish_kv_events()
                else:
                    await self._wait_for_work()
        except asyncio.CancelledError:
            for _, result in inflight:
                result.cancel()
            raise
        except BaseException as exc:
            logger.exception("engine step failed; the engine is now dead")
            for _, result in inflight:
                result.cancel()
            self._fail(exc)

    async def _wait_for_work(self) -> None:
        """Nothing in flight and nothing scheduled: wait to be resumed (paused: pause_generation may return now), a
        moment (requests wait for KV blocks or seats), or a new request."""
        if self._paused:
            self._quiet.set()  # type: ignore[union-attr]
            await self._resumed.wait()  # type: ignore[union-attr]
        elif self._core.has_unfinished():
            await asyncio.sleep(0.001)
        else:
            self._wakeup.clear()  # type: ignore[union-attr]
            await self._wakeup.wait()  # type: ignore[union-attr]

    async def _pipeline_result(self, launched: asyncio.Future) -> Any:
        """A launched step's result, waited for on the waiter thread (one at a time: steps come back in order)."""
        pending = await launched
        return await asyncio.get_running_loop().run_in_executor(self._waiter, pending.result)

    def _fail(self, exc: BaseException) -> None:
        """The engine is dead: every open stream ends with EngineDeadError, new requests get it (503)."""
        if self._dead is None:
            self._dead = exc
        err = EngineDeadError(f"the engine has failed: {exc}" if isinstance(exc, RankLostError)
                              else f"the engine has failed: {exc!r}")
        for _, queue in list(self._streams.values()):
            queue.put_nowait(err)
        self._streams.clear()
        if self._idle is not None:
            self._idle.set()
        if self._quiet is not None:  # (a pause_generation waiting for the loop: it reports the failure)
            self._quiet.set()

    def _on_rank_lost(self, why: str) -> None:
        """A tensor-parallel rank was lost (its process or node died, or its link dropped): the engine fails now,
        whether or not a step is stuck waiting for that rank in a collective."""
        if self.rank_lost is not None:
            return
        self.rank_lost = why
        if self._dead is None:
            self._fail(RankLostError(why))
            if self._task is not None:
                self._task.cancel()  # (it may be awaiting a step that never ends)
        if self._rank_lost is not None:
            self._rank_lost.set()

    async def wait_rank_lost(self) -> str:
        """Return once a tensor-parallel rank is lost (the engine is dead by then): which one, and how."""
        assert self._rank_lost is not None, "the engine is not started"
        await self._rank_lost.wait()
        return self.rank_lost  # type: ignore[return-value]

    def _dispatch(self, updates: list[SeqUpdate]) -> None:
        now = time.monotonic()
        m = self.metrics
        done: set[str] = set()
        timings = self._core.timings
        if m is not None and timings is not None:
            m.observe_timings(timings)
            timings.clear()
        generated = 0
        for u in updates:
            req = u.req
            rid = req.parent_id or req.request_id
            entry = self._streams.get(rid)
            generated += len(u.new_token_ids)
            if entry is not None:
                stream, queue = entry
                stream.cached_tokens = max(req.num_cached_tokens, 0)
                if req.prediction is not None:
                    stream.predictions[req.seq_index] = (len(req.prediction), req.prediction_accepted)
                queue.put_nowait(StreamOutput(rid, req.seq_index, u.new_token_ids, u.text, u.logprobs,
                                              req.finish_reason if u.finished else None,
                                              req.stop_reason if u.finished else None,
                                              prompt_logprobs=u.prompt_logprobs,
                                              prompt_token_ids=req.prompt_token_ids if u.prompt_logprobs else None,
                                              embedding=u.embedding,
                                              cumulative_logprob=u.state.summed_logprob if u.finished else None))
            if u.finished:
                met = u.state.metrics
                if m is not None:
                    m.observe_finished(req, met.first_token_time, now)
                if rid not in self._core.groups:
                    done.add(rid)
        if m is not None and generated:
            m.generation_tokens.inc(generated, model_name=m.model_name)  # (once a step: the counter takes a lock)
        for rid in done:  # after the loop: sibling sequences may finish in the same step
            self._streams.pop(rid, None)
        self._maybe_idle()


def _count_by_priority(reqs) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in reqs:
        counts[r.priority] = counts.get(r.priority, 0) + 1
    return counts

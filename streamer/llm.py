"""Offline batch generation: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import collections
import contextlib
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Sequence, Union

from streamer.config import EngineConfig
from streamer.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from streamer.engine.input_processor import LoRAType, PromptType
from streamer.engine.llm_engine import LLMEngine, WeightsArg
from streamer.engine.output_processor import SeqState
from streamer.engine.pooling import PoolingParams, encode_pair, pair_up
from streamer.multimodal.inputs import load_image, load_video
from streamer.multimodal.media_fetch import FetchPolicy
from streamer.outputs import ClassificationOutput, EmbeddingOutput, RequestOutput, ScoringOutput
from streamer.progress import GenerateProgress
from streamer.sampling_params import SamplingParams
from streamer.tokenizer.tokenizer import Tokenizer
from streamer.worker.input_batch import StepInputs


def _is_token_list(x: object) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    """One prompt (a string, a dict or a token-id list) or several, as a list."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a string, a token-id list, a dict (prompt / prompt_token_ids / "
                         f"multi_modal_data) or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _texts(texts: Union[str, Sequence[str]], name: str) -> list[str]:
    """One text or several (LLM.score's text_1 / text_2), as a non-empty list of strings."""
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items or not all(isinstance(t, str) for t in items):
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    return items


class LLM:
    """vLLM-shaped offline API. Engine arguments are `EngineConfig` fields (dtype, block_size, ...)."""

    def __init__(self, model: Optional[str] = None, **engine_args) -> None:
        self._dp = None
        if engine_args.get("data_parallel_size", 1) not in (None, 1):  # replicas in their own processes
            from streamer.engine.data_parallel import OfflineDataParallel
            EngineConfig.from_kwargs(model, **engine_args)  # (bad arguments fail here, before any process starts)
            self._dp = self.engine = OfflineDataParallel(model, engine_args)  # type: ignore[assignment]
        else:
            self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._chat_template: Any = None  # made on the first chat() call

    def close(self) -> None:
        """Stop tensor-parallel worker processes now (they also stop when this object or the process goes)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_lora(self, name: str, path: str) -> None:
        """Register a PEFT LoRA adapter folder under `name` (needs enable_lora=True)."""
        self.engine.add_lora(name, path)

    def update_weights(self, weights: WeightsArg, partial: bool = False) -> None:
        """New weights for the running model, in place: a checkpoint folder of the same model (the same config
        and tensor names: the next step of RL training, say), or every tensor of its checkpoint by name (a
        trainer's `model.state_dict()`, or (name, tensor) pairs). `partial=True`: some of the tensors (a trainer
        sending its weights in buckets); a weight the engine keeps packed or rounded must come whole (q, k and v
        together, gate and up together). The prefix cache is reset. ValueError (nothing changed) for another
        model's weights."""
        self.engine.update_weights(weights, partial)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (the next prompts are computed whole); returns the blocks forgotten."""
        return self.engine.reset_prefix_cache()

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (streamer's: encode, decode, the chat template's text; vLLM's LLM has the same)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling `generate` uses when given none: the checkpoint's generation_config.json values where it
        sets them (engine argument `generation_config`), SamplingParams' defaults elsewhere."""
        return self.engine.default_sampling_params()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRAType, Sequence[LoRAType]] = None,
                 use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """`lora_request`: one LoRA adapter for every prompt, or one per prompt (None: the base model); a
        `LoRARequest(name, path)` or the name of an adapter registered with `add_lora`. use_tqdm: a progress line on
        stderr (prompts done, input and output tokens a second; None: when stderr is a terminal)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None)
        if params is None or not all(isinstance(sp, SamplingParams) for sp in params):
            raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        prios = list(priority) if priority is not None else [0] * len(prompts)
        loras = self._loras(lora_request, len(prompts))
        if self._dp is not None:
            return self._dp.generate(prompts, params, prios, loras)
        engine = self.engine
        # Tokenize and validate everything first, so one bad prompt adds nothing.
        tokenized = [engine.truncate(*engine.process_prompt(p, sp.truncate_prompt_tokens), sp)
                     for p, sp in zip(prompts, params)]
        for (_, ids, _), sp in zip(tokenized, params):
            engine.validate(ids, sp)
        adapters = [engine.resolve_lora(x) for x in loras]
        ids: list[str] = []
        states: dict[str, list[SeqState]] = {}
        with self._aborting_on_error(ids):
            for (text, token_ids, images), sp, prio, adapter in zip(tokenized, params, prios, adapters):
                rid = f"offline-{next(engine._ids)}"
                ids.append(rid)
                states[rid] = engine.add_request(rid, text if text is not None else token_ids, sp, priority=prio,
                                                 prompt_token_ids=token_ids, lora_request=adapter, images=images,
                                                 stream=False)  # (read from the states at the end)
            show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
            progress = GenerateProgress({rid: len(states[rid]) for rid in ids}) if show and ids else None
            try:
                self._run(progress)
            finally:
                if progress is not None:
                    progress.close()
        return [self._output(rid, states[rid]) for rid in ids]

    @contextlib.contextmanager
    def _aborting_on_error(self, ids: list[str]) -> Iterator[None]:
        """A call interrupted part-way (Ctrl-C, a request the engine refuses after others were added, a failed
        step) takes its requests with it: left behind, they would wait for the tokens of a step that never
        finished, and the next call would step them forever."""
        try:
            yield
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    ) -> list[BeamSearchOutput]:
        """The `beam_width` best continuations of each prompt by cumulative log-probability (streamer/engine/beam_search.py):
        one engine step per token over all beams of all prompts, the shared prefixes served by the prefix cache."""
        if self._dp is not None:
            return self._dp.beam_search(_prompt_list(prompts), params)
        ids = [self.engine.tokenize_prompt(p)[1] for p in _prompt_list(prompts)]
        for p in ids:
            self.engine.validate(p, SamplingParams(max_tokens=1))
        search = BeamSearch(self.engine, ids, params)
        while requests := search.step_requests():
            search.advance(self.generate(requests, search.sampling, use_tqdm=False))
        return search.results()

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             tools: Optional[list[dict]] = None, chat_template_kwargs: Optional[dict] = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             lora_request: Union[LoRAType, Sequence[LoRAType]] = None,
             chat_template: Optional[str] = None, use_tqdm: Optional[bool] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to several, rendered
        with the model's chat template as the server renders them (and as transformers' apply_chat_template does).
        chat_template: a Jinja template (or a file holding one) for this call in place of the model's."""
        from streamer.multimodal.audio_prompts import load_audio
        from streamer.server.protocol import APIError, message_audios, message_images, message_videos, parse_messages
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        template = self._template(chat_template)
        prompts: list[PromptType] = []
        for conv in convs:
            try:
                parsed = parse_messages(conv)
                text = template.render(parsed, add_generation_prompt, continue_final_message, tools,
                                       chat_template_kwargs)
            except APIError as e:  # (the server's error type: here a plain ValueError naming the problem)
                raise ValueError(e.message) from None
            sources = message_images(parsed)
            images = self.engine.image_prompts
            shown = images.expand_text(text) if sources and images else text  # (Gemma 3's placeholders expand)
            prompt: dict = {"prompt": text, "prompt_token_ids": self.tokenizer.encode(shown, add_special_tokens=False)}
            policy = FetchPolicy.of(self.engine.config)
            if sources:  # image_url parts (data: or http(s) URLs) or image_pil parts (PIL images)
                prompt["multi_modal_data"] = {"image": [load_image(s, policy) if isinstance(s, str) else s
                                                        for s in sources]}
            videos = message_videos(parsed)
            if videos:  # video_url parts, decoded with PyAV at the video processor's fps
                fps = (images.video_processor.fps if images is not None and images.takes_video else None) or 2.0
                prompt.setdefault("multi_modal_data", {})["video"] = [load_video(v, policy, fps) for v in videos]
            audios = message_audios(parsed)
            if audios:  # input_audio parts (as data: URLs) or audio_url parts
                prompt.setdefault("multi_modal_data", {})["audio"] = [load_audio(a, policy) for a in audios]
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, lora_request=lora_request, use_tqdm=use_tqdm)

    def _template(self, source: Optional[str]) -> Any:
        """The engine's chat template (made once), or one made from `source` (a call's own)."""
        from streamer.server.chat_template import ChatTemplate, load_chat_template
        images = self.engine.image_prompts
        placeholders = ((images.placeholder, images.video_placeholder) if images is not None else (None, None))
        audio = images.audio_placeholder if images is not None else None
        if source is not None:
            return ChatTemplate.from_tokenizer(self.tokenizer, *placeholders, source=load_chat_template(source),
                                               audio_placeholder=audio)
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_tokenizer(self.tokenizer, *placeholders, audio_placeholder=audio)
        return self._chat_template

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], pooling: Optional[PoolingParams] = None,
              lora_request: Union[LoRAType, Sequence[LoRAType]] = None) -> list[EmbeddingOutput]:
        """Each prompt's embedding: the model's final hidden states pooled (default: the model's own pooling,
        normalised; streamer/engine/pooling.py). Batched with each other as generation is."""
        pooled = self._pool(prompts, (pooling or PoolingParams()).for_task("embed"), lora_request)
        return [EmbeddingOutput(rid, vec, ids, cached) for rid, vec, ids, cached in pooled]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], pooling: Optional[PoolingParams] = None,
                 lora_request: Union[LoRAType, Sequence[LoRAType]] = None) -> list[ClassificationOutput]:
        """Each prompt's label probabilities from a sequence-classification model (`*ForSequenceClassification`):
        its score head over the last token's hidden state, then softmax over the labels (a sigmoid for one label;
        the raw logits with `PoolingParams(activation=False)`)."""
        pooled = self._pool(prompts, (pooling or PoolingParams()).for_task("classify"), lora_request)
        label = self.engine.classifier.label  # type: ignore[union-attr]  # (only a classifier classifies)
        return [ClassificationOutput(rid, probs, label(probs), ids, cached) for rid, probs, ids, cached in pooled]

    def score(self, text_1: Union[str, Sequence[str]], text_2: Union[str, Sequence[str]],
              lora_request: LoRAType = None) -> list[ScoringOutput]:
        """vLLM's scores of text pairs: the one text_1 with each text_2, or text_1[i] with text_2[i]. A cross-encoder
        (a sequence classifier with one label) reads each pair as one prompt (the tokenizer's pair encoding) and
        scores it with the sigmoid of its logit; an embedding model scores the cosine similarity of the two texts'
        embeddings."""
        first, second = _texts(text_1, "text_1"), _texts(text_2, "text_2")
        pairs = pair_up(first, second)
        if self.engine.classifier is not None:
            prompts = [{"prompt_token_ids": encode_pair(self.tokenizer, a, b)} for a, b in pairs]
            pooled = self._pool(prompts, PoolingParams(task="score"), lora_request)
            return [ScoringOutput(rid, scores[0], ids) for rid, scores, ids, _ in pooled]
        vecs = self.embed(first + second, PoolingParams(task="embed"), lora_request)  # (normalised)
        a, b = vecs[:len(first)], vecs[len(first):]
        return [ScoringOutput(f"{x.request_id}+{y.request_id}", sum(p * q for p, q in zip(x.embedding, y.embedding)),
                              x.prompt_token_ids + y.prompt_token_ids)
                for x, y in zip(a * len(b) if len(a) == 1 else a, b)]

    def _pool(self, prompts: Union[PromptType, Sequence[PromptType]], pooling: PoolingParams,
              lora_request: Union[LoRAType, Sequence[LoRAType]]) -> list[tuple[str, Any, list[int], int]]:
        """Run pooling requests (streamer/engine/pooling.py) to the end: each one's (request id, result, prompt
        token ids, cached tokens)."""
        prompts = _prompt_list(prompts)
        loras = self._loras(lora_request, len(prompts))
        if self._dp is not None:
            return self._dp.pool(prompts, pooling, loras)
        engine = self.engine
        # (images too: a VLM embeds them)
        keep = pooling.truncate_prompt_tokens
        tokenized = [engine.truncate(*engine.process_prompt(p, keep), pooling) for p in prompts]
        checked = engine.resolve_pooling(pooling)
        for _, ids, _ in tokenized:  # everything first, so one bad prompt adds nothing
            engine.validate(ids, SamplingParams(), pooling=True)
        adapters = [engine.resolve_lora(x) for x in loras]
        states = []
        rids: list[str] = []
        with self._aborting_on_error(rids):
            for (text, ids, images), adapter in zip(tokenized, adapters):
                rid = f"{checked.task}-{next(engine._ids)}"
                rids.append(rid)
                states.append(engine.add_request(rid, text if text is not None else ids, SamplingParams(),
                                                 prompt_token_ids=ids, lora_request=adapter, pooling=checked,
                                                 images=images)[0])
            self._run()
        return [(s.req.request_id, s.embedding, list(s.req.prompt_token_ids), max(s.req.num_cached_tokens, 0))
                for s in states]

    @staticmethod
    def _loras(lora_request: Union[LoRAType, Sequence[LoRAType]], n: int) -> list[LoRAType]:
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple)) and not isinstance(lora_request, str)
                 else [lora_request] * n)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora requests for {n} prompts")
        return loras

    def _run(self, progress: Optional[GenerateProgress] = None) -> None:
        """Step until every request has finished. With async scheduling, step N+1 is scheduled before step N's
        results are processed, and the model computes while the host processes (as in `AsyncEngine`): on CUDA the
        model runs on a worker thread (`launch` queues the step and returns); on CPU it runs here, on the thread
        that loaded it, while the worker processes the step before. (Not the other way round: a second thread
        running the model would hold a second OpenMP team, and with more OpenMP threads than cores libgomp stops
        letting idle workers spin: every step ~3x slower, streamer/threads.py.) Otherwise step by step."""
        engine = self.engine
        if engine.pipeline_depth > 1:
            self._run_pipelined(progress)
            return
        if not engine.async_scheduling:
            while engine.has_unfinished():
                updates = engine.step()
                if progress is not None:
                    progress.update(updates)
            return
        here = engine.runner.device.type == "cpu"
        with ThreadPoolExecutor(1, thread_name_prefix="streamer-worker") as worker:
            def launch(step: StepInputs) -> Future:
                if not here:
                    return worker.submit(engine.runner.launch, step)
                done: Future = Future()
                done.set_result(engine.runner.launch(step))
                return done
            inflight = None  # (scheduler output, step inputs, future of its pending result)
            while True:
                step = engine.schedule_next(inflight[1] if inflight is not None else None)
                processing = (worker.submit(engine.process, inflight[0], inflight[2].result().result())
                              if here and inflight is not None else None)
                nxt = None if step is None else (*step, launch(step[1]))
                if inflight is not None:  # (the model may already be computing the next step)
                    updates = (processing.result() if processing is not None
                               else engine.process(inflight[0], inflight[2].result().result()))
                    if progress is not None:
                        progress.update(updates)
                elif nxt is None:
                    if engine.has_unfinished():
                        raise RuntimeError("requests are left that can never be scheduled")
                    return
                inflight = nxt

    def _run_pipelined(self, progress: Optional[GenerateProgress]) -> None:
        """With P pipeline stages: up to P steps of different requests in flight (AsyncEngine._run_pipelined):
        launched here (rank 0's stage), their hidden states taken back and sampled on a waiter thread, in order."""
        engine = self.engine
        inflight: collections.deque[tuple[Any, Future]] = collections.deque()
        with ThreadPoolExecutor(1, thread_name_prefix="streamer-wait") as waiter:
            while True:
                while len(inflight) < engine.pipeline_depth:
                    step = engine.schedule()
                    if step is None:
                        break
                    if inflight:
                        engine.core.num_overlapped_steps += 1
                    inflight.append((step[0], waiter.submit(engine.runner.launch(step[1]).result)))
                if not inflight:
                    if engine.has_unfinished():
                        raise RuntimeError("requests are left that can never be scheduled")
                    return
                sched, result = inflight.popleft()
                updates = engine.process(sched, result.result())
                if progress is not None:
                    progress.update(updates)

    def _output(self, rid: str, states: list[SeqState]) -> RequestOutput:
        first = states[0].req
        return RequestOutput(request_id=rid, prompt=states[0].prompt, prompt_token_ids=list(first.prompt_token_ids),
                             outputs=[self.engine.completion(s) for s in states], finished=True,
                             num_cached_tokens=max(first.num_cached_tokens, 0), metrics=states[0].metrics,
                             prompt_logprobs=states[0].prompt_logprobs)

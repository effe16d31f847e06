"""The engine core: scheduling and running steps, and speculative decoding's bookkeeping.

It owns the model runner, the KV cache manager, the scheduler and the persistent input batch. One step is
`schedule()` (drafts proposed, the scheduler's plan, the batch's inputs gathered, a draft model's work planned) ->
`runner.execute()` (the async engine: `runner.launch()` on the device thread, `PendingStep.result()` when its
tokens are needed) -> `record()` (the sampled tokens into the persistent batch), then the output processor's work,
then `observe_step()` (the step's period, for the step-time model). Drafts are proposed here before scheduling
(n-gram lookup, SuffixDecoding, a prediction; a draft model's are placeholders it fills on the device) and
settled here after the output processor verified them (`accept_drafts`, `rewind_drafts`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import Scheduler, SchedulerOutput
from streamer.core.step_time import shape_of
from streamer.models import registry
from streamer.models.config import ModelConfig
from streamer.spec_decode.draft_model import DraftPlan, plan_drafts
from streamer.spec_decode.eagle import EagleDrafter, plan_fill, plan_passes
from streamer.spec_decode.ngram import SuffixIndex, ngram_match, propose_ngram, propose_predicted
from streamer.worker.input_batch import InputBatch, StepInputs
from streamer.worker.model_runner import ModelRunner, RunnerOutput

if TYPE_CHECKING:
    from streamer.engine.output_processor import TokenTimings

logger = logging.getLogger("streamer")
_MAX_DRAFT_BACKOFF = 16  # steps (EngineCore._settle_backoff)


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.runner = ModelRunner(config, model_dir, model_config, max_model_len)
        long_rope = self.runner.model.long_rope
        self.long_rope_threshold = long_rope[0] if long_rope else None
        # An encoder-decoder model (Whisper): each prompt's audio, encoded once (streamer/multimodal/speech.py)
        self.encoder_decoder = self.runner.cross
        # An encoder's prompts attend both ways: a prefix's KV depends on what follows it, so none is reused.
        self.encoder = model_config.bidirectional
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size,
                                 config.enable_prefix_caching and not self.encoder,
                                 state_slots=self.runner.num_state_slots,
                                 checkpoint_slots=self.runner.num_checkpoint_slots,
                                 snapshot_slots=self.runner.num_snapshot_slots, kv_events=config.kv_events)
        self.prefix_caching = self.kv.enable_prefix_caching  # (off for a hybrid model without checkpoint slots)
        self.scheduler = Scheduler(config, self.kv, max_model_len, long_rope_threshold=self.long_rope_threshold)
        self.batch = InputBatch(config.max_num_seqs, max_model_len, self.runner.max_blocks_per_req,
                                config.block_size, model_config.vocab_size,
                                mrope=model_config.mrope_section is not None,
                                state_slots=registry.entry(model_config.architecture).recurrent_state,
                                encoder_decoder=self.encoder_decoder)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self.timings: Optional[TokenTimings] = None  # (each step's size and period go there too)
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

    # ------------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """A sequence is done (or aborted): its KV blocks go back to the pool; SuffixDecoding learns its output."""
        if self.suffix is not None and req.output_token_ids and status != RequestStatus.FINISHED_ABORTED:
            tail = req.prompt_token_ids[-self.config.suffix_decoding_max_tree_depth:]
            self.suffix.add(np.asarray(tail + req.output_token_ids, dtype=np.int64))
        self.scheduler.finish(req, status)

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
        return (self.async_scheduling and self.config.pipeline_parallel_size == 1 and not running.sampling.penalized and running.sampling.grammar is None
                and not running.sampling.worded and not running.sampling.speech and not any(r.think.pins_next  # type: ignore[union-attr]
                                                            for _, r in running.sampling.thinking)
                and not self.config.num_speculative_tokens)  # drafts are proposed from the tokens known

    def schedule_next(self, running: Optional[StepInputs]) -> Optional[tuple[SchedulerOutput, StepInputs]]:
        """The step pipeline's one decision (AsyncEngine and LLM share it): the next step to queue, given the one
        still running (None: nothing runs), or None when none may or can be scheduled now."""
        if not self.scheduler.has_work() or (running is not None and not self.can_overlap(running)):
            return None
        if running is not None:
            self._busy_since = None  # (overlapped: the time between steps is inside the running step's period)
        step = self.schedule()
        if step is not None and running is not None:
            self.num_overlapped_steps += 1
        return step

    def record(self, result: RunnerOutput) -> None:
        """A step's sampled tokens into the persistent batch (and a draft model's proposals onto their requests,
        in place of their placeholders), before the output processor reads them."""
        self.num_steps += 1
        if result.rows is not None:
            self.batch.record(result.rows, result.epochs, result.positions, result.token_array)
        if result.has_drafts and result.drafts:
            requests = self.scheduler.requests
            for rid, proposed in result.drafts.items():
                req = requests.get(rid)
                if req is not None:
                    req.draft_token_ids = proposed

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

    def observe_step(self, sched: SchedulerOutput) -> None:
        """The step's period (from its scheduling, or from the previous step's end when they overlapped, to the end
        of its processing) goes to the step-time model and the metrics."""
        now = time.perf_counter()
        period = now - max(sched.scheduled_at, self._last_step_end)
        self._last_step_end = now
        self._busy_since = now if self.scheduler.has_work() else None
        if sched.shape is None:
            return
        self.scheduler.step_model.observe(sched.shape, period)
        self.last_step = (sched.predicted, period, sched.budget)
        if self.timings is not None:
            self.timings.steps.append((sched.predicted, period))

    def append_forced(self, req: Request, start: int) -> None:
        """Tokens appended to a request unsampled from `start` on (a grammar's forced ones): into its batch row,
        for the next step to compute."""
        self.batch.append(req.request_id, start, req.all_token_ids[start:])

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

    def accept_drafts(self, req: Request, sampled: list[int]) -> int:
        """How many of a request's drafts its verify step accepted: `sampled` holds the token drawn after its last
        known token and after each draft, and drafts are accepted while they equal what was drawn at their
        position. The drafts are taken off the request, and the draft model's KV, a hybrid model's state, the
        prediction's progress and the backoff follow the outcome."""
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
        return accepted

    def rewind_drafts(self, req: Request) -> None:
        """After a verify step that did not finish the request (its accepted tokens appended): the drafts past the
        accepted ones were computed but are not the sequence, so it recomputes from the last token on (their KV
        slots are simply overwritten), or from before the step (a hybrid model)."""
        req.num_computed_tokens = min(req.num_computed_tokens, len(req.all_token_ids) - 1)
        req.num_pending = 0
        self.batch.truncate(req.request_id, len(req.all_token_ids))

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

    # ------------------------------------------------------------------ the cache, the weights, stats
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (`KVCacheManager.reset_prefix_cache`); returns the blocks forgotten."""
        n = self.kv.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached blocks forgotten", n)
        return n

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

    def close(self) -> None:
        """Release what outlives the engine object's references: tensor-parallel worker processes."""
        self.runner.close()

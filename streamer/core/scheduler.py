"""Continuous batching: decide, once per step, how many tokens each request computes.

There is no prefill phase. Every request has `num_computed_tokens` and a target (all of its known
tokens); each step gives requests tokens until computed catches up, under a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). Chunked prefill, prefix-cache hits and
decode all fall out of that rule. Running requests go first; when the KV pool runs dry the last
running request (the most recently admitted one, or the lowest-priority one) is preempted by recompute.

Stall-free steps (streamer/core/step_time.py): while a streamed request decodes, a step also has a time budget. The
running decodes' time and tokens are reserved first; prefill chunks (running prompts', then new admissions') get
only what the step-time model says fits in the rest, cut on block boundaries, with at least one block for the
first of them (`StepPlan`'s starvation rule).

Async scheduling: a step may be scheduled while the previous one still runs. A request's token that the running
step will sample counts as pending (`Request.num_pending`): the next step may compute it (the runner reads it on
the device), unless it is certain to be the request's last (max_tokens, max_model_len).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager
from streamer.core.request import Request, RequestStatus
from streamer.core.step_time import ItlPolicy, StepPlan, StepShape, StepTimeModel
from streamer.engine.lora import LoRASlots

# Hybrid models with prefix caching and speculative decoding: verify chunks stop at every this many blocks, where
# the recurrent state is then checkpointed (Scheduler.draft_limit)
SPEC_CHECKPOINT_BLOCKS = 4


@dataclass
class ScheduledRequest:
    req: Request
    num_tokens: int  # tokens computed this step
    start: int  # num_computed_tokens before this step

    samples: bool = False  # does this step reach the request's last token, so that a new one is sampled?
    num_drafts: int = 0  # speculative decoding: draft tokens computed (and sampled at) after the last known one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    has_drafts: bool = False  # some request computes speculative drafts this step
    budget: Optional[float] = None  # the step's time budget in seconds (None: tokens only)
    # For the step-time model: the step's shape, its predicted period (0: the model is not ready yet) and when its
    # scheduling began (time.perf_counter; the engine measures the period from there)
    shape: Optional[StepShape] = None
    predicted: float = 0.0
    scheduled_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)


def priority_key(aging: Optional[float]):
    """Sort key: lower runs first. With aging, every `aging` seconds of waiting counts as one priority level:
    priority - (now - arrival) / aging. Its `now` term is the same for everyone, so ordering by
    priority + arrival / aging is equivalent, and static (a heap stays valid)."""
    if aging:
        return lambda r: (r.priority + r.arrival_time / aging, r.arrival_time)
    return lambda r: (r.priority, r.arrival_time)


class WaitingQueue:
    """FCFS: a deque (preempted requests return to the front). Priority: a heap on the priority key."""

    def __init__(self, policy: str, aging: Optional[float] = None) -> None:
        self.policy = policy
        self.key = priority_key(aging)
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[float, float], int, Request]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else iter(r for _, _, r in sorted(self._heap))

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(req)
        else:
            heapq.heappush(self._heap, (self.key(req), next(self._tie), req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][2]

    def remove(self, req: Request) -> bool:
        if self.policy == "fcfs":
            try:
                self._fifo.remove(req)
                return True
            except ValueError:
                return False
        for i, entry in enumerate(self._heap):
            if entry[2] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        return heapq.heappop(self._heap)[2]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int,
                 long_rope_threshold: Optional[int] = None) -> None:
        self.config = config
        # LoRA: the model's adapter slots, held by running requests (a request runs only once its adapter has one)
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        # LongRoPE: a sequence longer than this rotates with the long factors, all of it (as transformers does:
        # its KV is recomputed when the sequence outgrows the pretraining length).
        self.long_rope_threshold = long_rope_threshold
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue(config.scheduling_policy, config.priority_aging)
        self.running: list[Request] = []  # schedule order; the last one is the first to be preempted
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Stall-free steps: the step-time model (fed by the engine's measured periods) and the budget policy, once
        # `use_itl_budget` turns it on
        self.step_model = StepTimeModel()
        self.itl: Optional[ItlPolicy] = None
        self.step_gap = 0.0  # the loop's own time between two steps (delivery), smoothed: part of every gap
        self.clock = time.monotonic  # (arrival times' clock)
        # Pipeline parallelism: up to this many steps in flight, each of other requests (a request's next step
        # needs the token its step in flight samples): the ids in steps not yet landed (`landed`)
        self.pipeline_depth = config.steps_in_flight
        self.in_flight: set[str] = set()

    def use_itl_budget(self) -> None:
        """Plan steps against the inter-token budget from now on (the config's max_itl_ms; 0 leaves it off)."""
        target = self.config.max_itl_ms
        if target != 0:
            self.itl = ItlPolicy(None if target is None else target / 1e3)

    # ------------------------------------------------------------------ queue management
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort a request: its blocks go back to the pool at once."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._release_lora(req)
        else:
            self.waiting.remove(req)
        self.in_flight.discard(req.request_id)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def _add_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if self.config.scheduling_policy == "priority":
            keys = [self.waiting.key(r) for r in self.running]
            self.running.insert(bisect.bisect_right(keys, self.waiting.key(req)), req)
        else:
            self.running.append(req)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot:
            self.lora_slots.release(req.lora_slot)  # type: ignore[union-attr]
            req.lora_slot = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_lora(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.reset_computed()
        req.draft_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req, front=True)

    def retract_all(self) -> int:
        """Preempt every running request (SGLang's pause mode "retract": their KV blocks go back to the pool, the
        requests wait at the front of the queue in their order and are recomputed when scheduled again). Only
        between steps, with no step in flight. Returns how many."""
        running = list(self.running)
        for req in reversed(running):  # (each goes to the front: the first ends first in line)
            self._preempt(req)
        return len(running)

    # ------------------------------------------------------------------ one step
    def landed(self, out: SchedulerOutput) -> None:
        """A pipelined step's results are processed: its requests may be scheduled again."""
        for s in out.scheduled:
            self.in_flight.discard(s.req.request_id)

    def _seats(self) -> int:
        """How many requests a step may hold: max_num_seqs, or with P pipeline stages 1/P of the requests (at
        least one), so that P steps of different requests can be in flight at once."""
        if self.pipeline_depth == 1:
            return self.config.max_num_seqs
        return max(1, -(-(len(self.running) + len(self.waiting)) // self.pipeline_depth))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.scheduling_policy == "priority":
            self._preempt_for_priority(out)
        budget = self.config.max_num_batched_tokens
        spec = self.config.num_speculative_tokens > 0
        plan, reserved = self._plan()  # (reserved: the decodes' tokens, which prefill chunks leave to them)
        planned: list[tuple[Request, int]] = []
        # Priority: running prompts outranked by the first waiting request chunk after its admission
        head = self.waiting.key(self.waiting.peek()) if self.config.scheduling_policy == "priority" and len(
            self.waiting) else None
        deferred: list[Request] = []
        pool_dry = False
        i = 0
        long_rope = self.long_rope_threshold
        busy, seats = self.in_flight, self._seats()
        while i < len(self.running) and budget > 0 and len(planned) < seats:
            req = self.running[i]
            if busy and req.request_id in busy:  # (pipelined: its step in flight)
                i += 1
                continue
            if long_rope is not None and not req.long_rope and len(req.all_token_ids) > long_rope:
                # Outgrew the short factors: recompute everything with the long ones, in fresh blocks (its blocks
                # stay cached under their short-factor hashes, and may be shared).
                self.kv.free(req)
                req.set_long_rope()
                req.reset_computed()
            # (num_scheduled_tokens, inlined: this loop runs over every running request every step)
            known = len(req.all_token_ids) + req.num_pending - req.num_computed_tokens
            want = known + len(req.draft_token_ids) if spec and req.draft_token_ids else known
            decode = known <= 1
            if decode:
                n = min(want, budget)
            elif head is not None and self.waiting.key(req) > head:
                deferred.append(req)
                i += 1
                continue
            else:  # a prompt (or a recompute) in chunks: what the decodes and the step's time leave
                n = self._chunk(plan, req, req.num_computed_tokens, min(want, budget - reserved))
            if n > 1 and self.kv.checkpoints is not None:
                n = self._fit_checkpoints(req, req.num_computed_tokens, n)
            if n <= 0 or (req.num_pending and self._pending_is_last(req)):
                i += 1  # nothing to do until its last sampled token arrives
                if decode:
                    reserved -= want
                continue
            if n < want and spec and req.draft_token_ids:  # the budget cuts into the drafts: keep what fits
                del req.draft_token_ids[max(n - (want - len(req.draft_token_ids)), 0):]
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                pool_dry = True
                if victim is req:
                    break
            else:
                planned.append((req, n))
                budget -= n
                i += 1
                if decode:
                    reserved -= want
                else:
                    plan.take(req.num_computed_tokens, n)
        if not pool_dry:  # admitting now would only preempt again next step
            budget = self._admit(planned, budget, plan, seats)
        for req in deferred[:max(seats - len(planned), 0)]:  # (no preemption for these: they rank below what
            # was admitted)
            known = len(req.all_token_ids) + req.num_pending - req.num_computed_tokens
            n = self._chunk(plan, req, req.num_computed_tokens, min(known, budget))
            if n > 1 and self.kv.checkpoints is not None:
                n = self._fit_checkpoints(req, req.num_computed_tokens, n)
            if n > 0 and req.status == RequestStatus.RUNNING and self.kv.allocate_slots(req, n):
                planned.append((req, n))
                budget -= n
                plan.take(req.num_computed_tokens, n)
        for req, n in planned:
            drafts = len(req.draft_token_ids) if spec else 0
            samples = (req.num_computed_tokens + n == len(req.all_token_ids) + drafts + req.num_pending
                       and req.pooling is None)  # (an embedding request ends with its prompt)
            if drafts and samples:
                out.has_drafts = True
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, samples, drafts if samples else 0))
            req.num_computed_tokens += n
            req.num_pending += samples
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
        if self.kv.snapshots is not None:
            self.kv.snapshot_states([(s.req, s.start) for s in out.scheduled if s.num_drafts])
        if self.pipeline_depth > 1:
            busy.update(s.req.request_id for s in out.scheduled)
        out.budget = plan.budget
        return out

    def _plan(self) -> tuple[StepPlan, int]:
        """The step's time plan with the running decodes' time reserved, and their tokens. A time budget applies
        only while a streamed request decodes and the step-time model is ready; the automatic one counts the
        decoding requests and the prompts waiting for their first token (running or queued)."""
        plan = StepPlan(self.step_model, None, self.kv.block_size)
        spec = self.config.num_speculative_tokens > 0
        tokens, decodes, prompts, streamed = 0, 0, 0, False
        oldest = self.waiting.peek().arrival_time if len(self.waiting) else math.inf
        busy = self.in_flight
        for req in self.running:
            if busy and req.request_id in busy:
                continue
            known = len(req.all_token_ids) + req.num_pending - req.num_computed_tokens
            if known <= 1:
                n = known + (len(req.draft_token_ids) if spec else 0)
                if n > 0:
                    plan.shape.add(req.num_computed_tokens, n)
                    tokens += n
                    decodes += 1
                    streamed = streamed or req.streamed
            else:
                prompts += 1
                oldest = min(oldest, req.arrival_time)
        if streamed and self.itl is not None and self.step_model.ready:
            wait = max(self.clock() - oldest, 0.0) if oldest < math.inf else 0.0
            plan.budget = self.itl.budget(self.step_model.predict(plan.shape), prompts + len(self.waiting), decodes,
                                          self.step_gap, wait)
        return plan, tokens

    @staticmethod
    def _chunk(plan: StepPlan, req: Request, start: int, want: int) -> int:
        """A prefill chunk's size: what the step's time allows, then whole images (or an encoder's whole prompt).
        What cannot be split goes whole into a step's first chunk: a budget smaller than an image must not keep
        its prompt out forever."""
        n = plan.chunk(start, want)
        if req.whole_images or req.whole_prompt:
            fitted = req.fit_chunk(start, n)
            if fitted == 0 and plan.prefill_tokens == 0 and n < want:
                fitted = req.fit_chunk(start, want)
            n = fitted
        return n

    def draft_limit(self, req: Request) -> int:
        """Speculative decoding: how many drafts the request's next chunk may carry (0: none). When it decodes: only
        its last known token is left to compute. On a hybrid model also right after drafts were rejected, when its
        state went back to before them (kv_cache.StateSnapshots) and its next chunk recomputes the accepted ones: a
        few known tokens more (never a prompt, nor a longer recompute, which runs without drafts). With prefix
        caching a hybrid's chunk ends no further than the next multiple of SPEC_CHECKPOINT_BLOCKS blocks, so that
        the request's computed tokens land there and the state gets checkpointed (a next turn resumes from the
        last; runs of verified drafts would jump over every boundary). Every 4th, not every boundary: each such
        stop costs drafts (bench/RESULTS.md, session 15), a next turn recomputes at most 3 blocks more."""
        k = self.config.num_speculative_tokens
        gap = len(req.all_token_ids) - 1 - req.num_computed_tokens
        if gap and not (self.kv.snapshots is not None and 0 < gap <= k and req.num_output_tokens > 0):
            return 0
        if self.kv.checkpoints is not None:
            every = SPEC_CHECKPOINT_BLOCKS * self.kv.block_size
            k = min(k, (req.num_computed_tokens // every + 1) * every - len(req.all_token_ids))
        return max(k, 0)

    def _fit_checkpoints(self, req: Request, start: int, n: int) -> int:
        """Hybrid models with prefix caching: a chunk of n tokens from `start` ends at the request's chunk stop or,
        cut short by the budget, on a block boundary, where the state gets checkpointed (kv_cache.py
        StateCheckpoints)."""
        end = start + n
        if start < req.chunk_stop < end:
            return req.chunk_stop - start
        if end < req.num_tokens:
            aligned = end - end % self.kv.block_size
            if aligned > start:
                return aligned - start
        return n

    def _pending_is_last(self, req: Request) -> bool:
        """Will the token in flight end the request by length? Then computing it would be wasted."""
        return (req.num_output_tokens + req.num_pending >= req.max_tokens
                or req.num_scheduled_tokens >= self.max_model_len)

    def _admit(self, planned: list[tuple[Request, int]], budget: int, plan: StepPlan, seats: int) -> int:
        no_lora_slot: list[Request] = []  # passed over: their adapter finds no free slot this step
        while (len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(planned) < seats):
            req = self.waiting.peek()
            if req.request_id in self.in_flight:  # preempted while its step is in flight (pipelined): after it
                break
            if req.lora is not None:
                slot = self.lora_slots.acquire(req.lora)  # type: ignore[union-attr]
                if slot is None:
                    no_lora_slot.append(self.waiting.pop())
                    continue
                req.lora_slot = slot
            if self.long_rope_threshold is not None and not req.long_rope and req.num_tokens > self.long_rope_threshold:
                req.set_long_rope()  # (grew past the threshold, then was preempted before its running check)
            # Prompt logprobs need a logit at every prompt position, mean and first-token pooling a hidden state
            # at every one or at the first: a cache hit would skip them.
            skip_cache = req.params.prompt_logprobs is not None or (
                req.pooling is not None and req.pooling.pooling != "last")
            hits, num_hit = ([], 0) if skip_cache else self.kv.get_computed_blocks(req)
            # Known tokens only: a preempted request's token still in flight is computed once it has arrived.
            n = self._chunk(plan, req, num_hit, min(req.num_tokens - num_hit, budget))
            if self.kv.checkpoints is not None:
                req.chunk_stop = 0 if skip_cache else self.kv.chunk_stop(req, num_hit)
                n = self._fit_checkpoints(req, num_hit, n)
            if n == 0 or not self.kv.allocate_slots(req, n, hits):  # (0: its next image does not fit this step)
                self._release_lora(req)
                break
            self.waiting.pop()
            self.kv.record_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self._add_running(req)
            planned.append((req, n))
            budget -= n
            plan.take(num_hit, n)
        for req in reversed(no_lora_slot):  # back in their places (FCFS: at the front, in order)
            self.waiting.push(req, front=True)
        return budget

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting request that outranks the worst running one takes its place when seats or blocks are short."""
        while len(self.waiting) and self.running:
            head, worst = self.waiting.peek(), self.running[-1]
            if self.waiting.key(head) >= self.waiting.key(worst):
                return
            if head.lora is not None and not self.lora_slots.available(head.lora):  # type: ignore[union-attr]
                return  # it could not run anyway: preempting for it would only churn
            hits, num_hit = self.kv.get_computed_blocks(head)
            first_chunk = min(head.num_tokens, num_hit + self.config.max_num_batched_tokens)
            seats = len(self.running) < self.config.max_num_seqs
            if seats and self.kv.can_fit(first_chunk, hits):
                return
            self._preempt(worst)
            out.preempted.append(worst)

    def check_invariants(self) -> None:
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.request_id not in self.kv.req_blocks, "a waiting request holds blocks"
        self.kv.check_consistency()

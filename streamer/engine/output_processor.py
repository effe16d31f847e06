"""Output processing: a step's runner outputs -> one `SeqUpdate` per sequence that got something.

Each sampled token is appended to its sequence and checked against the stop conditions (eos, stop token ids,
max_tokens, the context length, a grammar that is complete), the detokenizer turns it into text (and finds stop
strings), and its logprobs entry is built; a grammar's forced tokens are appended after it (jump-forward). A
pooling request's chunks are summed until its prompt is done, and prompt logprobs are appended as they are
scored. `_deliver` decides when an update goes out (final-only sequences, `stream_interval`).

The per-step loop runs once for every running sequence every step: it is the engine's hot path, kept free of
calls that do not earn their keep. The engine core (streamer/engine/engine_core.py) is called per sequence that
finishes (to free its KV blocks) and per request that verified drafts.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from streamer.core.request import Request, RequestStatus
from streamer.engine.detokenizer import IncrementalDetokenizer
from streamer.engine.pooling import Classifier, DenseProjection, finish_pooled
from streamer.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, SampleLogprobs

if TYPE_CHECKING:
    from streamer.engine.engine_core import EngineCore
    from streamer.tokenizer.tokenizer import Tokenizer
    from streamer.worker.model_runner import PromptLogprobsOut, RunnerOutput

logger = logging.getLogger("streamer")
# stop_reason of an output whose rules left no token to sample (`_reject`)
NO_TOKEN_LEFT = "no_token_allowed"


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
    the requests whose first sequence got its first token. The engine core adds each step's size and period."""

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


class OutputProcessor:
    """The live sequences' output state (`seqs`, by sequence id; `groups`, each user request's sequence ids) and
    the step-by-step work of turning runner outputs into `SeqUpdate`s."""

    def __init__(self, core: "EngineCore", tokenizer: "Tokenizer", max_model_len: int, stream_interval: int,
                 jump_forward: bool, classifier: Optional[Classifier], projection: Optional[DenseProjection]) -> None:
        self.core = core  # (frees a finished sequence's blocks; settles verified drafts)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval
        self.jump_forward = jump_forward
        self.classifier = classifier
        self.projection = projection
        self.seqs: dict[str, SeqState] = {}
        self.groups: dict[str, list[str]] = {}  # user request id -> its sequences' ids
        # Token latencies for whoever keeps metrics (the async engine sets them, via the engine, and takes them)
        self.timings: Optional[TokenTimings] = None

    # ------------------------------------------------------------------ sequences in and out
    def add(self, request_id: str, reqs: list[Request], prompt: Optional[str], stream: bool) -> list[SeqState]:
        """Start the output state of a user request's sequences (`reqs`, from the input processor). `stream=False`:
        each sequence's outputs come in one update, when it finishes (see SeqState)."""
        states = [self._state(req, prompt, stream) for req in reqs]
        for state in states:
            self.seqs[state.req.request_id] = state
        self.groups[request_id] = [s.req.request_id for s in states]
        return states

    def _state(self, req: Request, prompt: Optional[str], stream: bool) -> SeqState:
        params = req.params
        # (a prompt of embeddings gives the detokenizer no context: its placeholders are no text)
        context = () if any(im.features is not None for im in req.images) else req.prompt_token_ids
        return SeqState(req, IncrementalDetokenizer(self.tokenizer, context, params), prompt,
                        logprobs=[] if params.logprobs is not None else None,
                        prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                        metrics=RequestMetrics(arrival_time=req.arrival_time), final_only=not stream)

    def abort(self, request_id: str) -> list[SeqState]:
        """Abort a user request (all of its sequences); returns the states that were still live."""
        aborted = []
        for seq_id in self.groups.pop(request_id, []):
            state = self.seqs.pop(seq_id, None)
            if state is None:
                continue
            self.core.finish(state.req, RequestStatus.FINISHED_ABORTED)
            aborted.append(state)
        return aborted

    def _finish(self, state: SeqState, status: RequestStatus) -> None:
        req = state.req
        self.core.finish(req, status)
        self.seqs.pop(req.request_id, None)
        group = self.groups.get(req.parent_id or req.request_id)
        if group is not None and all(sid not in self.seqs for sid in group):
            del self.groups[req.parent_id or req.request_id]

    # ------------------------------------------------------------------ one step
    def process(self, result: RunnerOutput) -> list[SeqUpdate]:
        """A step's outputs as the updates to hand out now (see `_deliver`)."""
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(result.prompt_logprobs)
        now = time.monotonic()
        updates = [] if result.pooled is None else self._record_pooled(*result.pooled, now)
        if result.has_drafts:
            return self._process_verified(result, now, updates)
        # One token per request (this loop runs for every request every step)
        every_token = self.stream_interval == 1
        seqs = self.seqs
        for i, (seq_id, token) in enumerate(zip(result.req_ids, result.token_ids)):
            state = seqs.get(seq_id)
            if state is None or state.req.is_finished:
                continue  # aborted while the step ran, or (async scheduling) finished by the step before
            update = self._append_token(state, token, result, i, now)
            if every_token and not state.final_only:
                updates.append(update)  # (_deliver's common case, without the call)
            else:
                self._deliver(updates, update)
        return updates

    def _process_verified(self, result: RunnerOutput, now: float, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """A step that verified drafts: a request's entries are consecutive, its last known token's and then one
        per draft."""
        ids, tokens = result.req_ids, result.token_ids
        i = 0
        while i < len(ids):
            end = i + 1
            while end < len(ids) and ids[end] == ids[i]:
                end += 1
            state = self.seqs.get(ids[i])
            if state is not None and not state.req.is_finished:  # (else aborted while the step ran)
                self._deliver(updates, self._verify(state, tokens[i:end], result, i, now) if end - i > 1
                              else self._append_token(state, tokens[i], result, i, now))
            i = end
        return updates

    def _verify(self, state: SeqState, sampled: list[int], result: RunnerOutput, row: int, now: float,
                ) -> SeqUpdate:
        """A request's speculative step: `sampled` holds the token drawn after its last known token and after
        each draft. The drafts the core accepts (`EngineCore.accept_drafts`) come with the first draw that differs
        (or the one after the last draft). One update for all of them."""
        accepted = self.core.accept_drafts(state.req, sampled)
        update = self._append_token(state, sampled[0], result, row, now)
        for j in range(1, accepted + 1):
            if update.finished:
                break
            update.merge(self._append_token(state, sampled[j], result, row + j, now))
        if not update.finished:
            self.core.rewind_drafts(state.req)
        return update

    def _deliver(self, updates: list[SeqUpdate], update: SeqUpdate) -> None:
        """Hand a sequence's update out now, or hold it: a final-only sequence's until it finishes (then one update
        with everything), a streamed one's (with stream_interval > 1) until that many tokens are held. A sequence's
        first token always goes out at once (time to first token)."""
        state = update.state
        if state.final_only:
            if update.finished:
                updates.append(self.undelivered(state))
            return
        interval = self.stream_interval
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

    # ------------------------------------------------------------------ one token
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

    def _may_jump(self, state: SeqState) -> bool:
        """Jump-forward appends the grammar's forced tokens unsampled, so only where nothing but the grammar
        decides the next token: not with allowed_token_ids, logit_bias or bad_words (a forced token might be
        banned), not while min_tokens bans stop tokens, and not when logprobs are asked for (forced tokens have
        none)."""
        req = state.req
        p = req.params
        return (self.jump_forward and state.logprobs is None and not p.adjusts_logits
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
            self.core.append_forced(req, start)
        return text, status, stop_reason

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

    # ------------------------------------------------------------------ pooled outputs, logprobs
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
    @staticmethod
    def completion(state: SeqState) -> CompletionOutput:
        req = state.req
        return CompletionOutput(
            index=req.seq_index, text=state.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=state.summed_logprob,
            logprobs=state.logprobs, finish_reason=req.finish_reason, stop_reason=req.stop_reason)

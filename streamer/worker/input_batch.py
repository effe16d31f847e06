"""The persistent input batch: host-side per-request state that outlives a step, updated by what changed.

Each request that holds KV blocks owns a row: its block table, its tokens so far, and its sampling parameters
as plain numbers. A step touches only what changed since the last one (new requests, finished or preempted
ones, newly allocated blocks: replayed from `KVCacheManager.take_changes()`, and the tokens sampled last step),
then gathers its rows with numpy fancy indexing into a `StepInputs`: fresh arrays that the device thread may
read while the event loop goes on mutating the batch. There is no per-request Python loop over the running set
except the one pass that maps the scheduler's output to rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from streamer.core.kv_cache import KVCacheManager
from streamer.core.request import Request
from streamer.core.scheduler import SchedulerOutput
from streamer.engine.pooling import POOL_CODE
from streamer.engine.structured_output import fill_bitmasks
from streamer.multimodal.inputs import ImageStep, image_step, rope_shifts

if TYPE_CHECKING:
    from streamer.spec_decode.draft_model import DraftPlan
    from streamer.spec_decode.eagle import EagleFill


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array (or CPU tensor) on the device without waiting for the device: on CUDA through pinned memory
    and an asynchronous copy (a plain `.to("cuda")` from pageable memory waits for everything queued before it,
    which would stall async scheduling's next step behind the running one). On CPU: a view, no copy."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingRows:
    """Sampling parameters of the requests that sample this step, one entry per sampling request."""

    temperature: np.ndarray  # float32 [S]; 0 = greedy
    top_k: np.ndarray  # int64 [S]; 0 = off
    top_p: np.ndarray  # float32 [S]; 1 = off
    min_p: np.ndarray  # float32 [S]; 0 = off
    max_logprobs: int  # top-N logprobs the batch needs (0 = sampled token only, -1 = none)
    # The few rows whose sampling needs their Request (a seeded generator, penalties, min_tokens bans,
    # logit_bias / allowed_token_ids): (index among the sampling rows, request).
    seeded: list[tuple[int, Request]]
    penalized: list[tuple[int, Request]]
    banned: list[tuple[int, Request]]
    adjusted: list[tuple[int, Request]] = field(default_factory=list)
    worded: list[tuple[int, Request]] = field(default_factory=list)  # bad_words: bans that follow the output
    # Whisper's decoding rules (timestamps, begin_suppress_tokens): bans that follow the output
    speech: list[tuple[int, Request]] = field(default_factory=list)
    # thinking_token_budget rows still before or inside their reasoning: the closing tag may be forced next
    thinking: list[tuple[int, Request]] = field(default_factory=list)
    # Structured outputs: (indices among the sampling rows, their allowed-token bitmasks int32 [R, ceil(V/32)]),
    # computed here on the host from each request's grammar state; None if no row follows a grammar.
    grammar: Optional[tuple[np.ndarray, np.ndarray]] = None


@dataclass
class PromptLogprobTokens:
    """Prompt tokens of this step whose logprobs were asked for: the logit at prompt position p scores the
    prompt token at p + 1."""

    token_idx: np.ndarray  # int64 [K]: rows of the step's hidden states
    target_ids: np.ndarray  # int64 [K]: the prompt token each one scores
    owners: list[tuple[str, int, int]]  # (request id, position of its first target, how many)
    top_n: int  # top logprobs to return beside each target (the widest request's)


@dataclass
class PoolTokens:
    """Embedding requests of this step: the hidden-state rows each one pools in this chunk."""

    token_idx: np.ndarray  # int64 [K]: rows of the step's hidden states
    segment: np.ndarray  # int64 [K]: which owner each row is summed into
    owners: list[tuple[str, int, int, bool]]  # (request id, chunk start, rows pooled, prompt done)


@dataclass
class StepInputs:
    """One step's flattened varlen batch, on the host."""

    req_ids: list[str]  # scheduled order
    rows: np.ndarray  # int64 [R]: each scheduled request's row in the persistent batch
    epochs: np.ndarray  # int64 [R]: which tenancy of the row (a row freed and handed out again gets a new one)
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int64 [R + 1]
    seq_lens: np.ndarray  # int64 [R]: context length after this step
    block_table: np.ndarray  # int32 [R, W]; entries past a request's blocks are 0
    slot_mapping: np.ndarray  # int64 [T]
    sample_idx: np.ndarray  # int64 [S]: the scheduled request of each sampled token (repeats with drafts)
    sampling: SamplingRows
    # Async scheduling: tokens the previous step samples, not known on the host yet. The runner fills
    # input_ids[pending_idx] from its device-side copy of each row's last sampled token.
    pending_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # int64 [P]
    pending_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # int64 [P]
    prompt_logprobs: Optional[PromptLogprobTokens] = None
    # Which of the step's tokens are sampled, int64 [S] (default: each sampling request's last token). With
    # speculative drafts a request samples at its last known token and at every draft.
    sample_tokens: Optional[np.ndarray] = None
    has_drafts: bool = False
    # Tokens each request has (at least its context after this step): LongRoPE picks its table by this length.
    num_known: Optional[np.ndarray] = None
    # LoRA: each token's adapter slot, int64 [T] (None: no token of the step uses an adapter), and the adapters
    # to copy into their slots before the step runs: [(slot, LoRAAdapter)].
    lora_slots: Optional[np.ndarray] = None
    lora_loads: list = field(default_factory=list)
    pool: Optional[PoolTokens] = None  # embedding requests' hidden states to sum
    draft: Optional["DraftPlan"] = None  # speculative decoding with a draft model: its passes before this step
    eagle: Optional["EagleFill"] = None  # with an EAGLE head: its pass over the step's tokens after the step
    images: Optional[ImageStep] = None  # which tokens take image features instead of their embeddings
    rope_positions: Optional[np.ndarray] = None  # M-RoPE: positions shifted by the images before them (int64 [T])
    # Hybrid attention + Mamba models: each request's state slot (int64 [R]; kv_cache.StateSlotPool); None else
    state_slots: Optional[np.ndarray] = None
    # ... and the state copies to run first, batch after batch, each [(from slot, to slot)] (kv_cache.py
    # KVCacheManager.take_state_copies: prefix caching's checkpoints, speculative decoding's snapshots)
    state_copies: Optional[list[list[tuple[int, int]]]] = None
    # Encoder-decoder models: the encoder inputs (Request.encoder_input) of the requests computing their first token
    # (start 0), in their order in the step; None when none does
    encoder_inputs: Optional[list[Any]] = None

    def __post_init__(self) -> None:
        if self.sample_tokens is None:
            self.sample_tokens = self.query_start_loc[1:][self.sample_idx] - 1

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int, block_size: int,
                 vocab_size: int, mrope: bool = False, state_slots: bool = False, encoder_decoder: bool = False,
                 ) -> None:
        """mrope: the model places tokens by M-RoPE (Qwen2-VL): a prompt's images shift the positions of the tokens
        after them (`StepInputs.rope_positions`). state_slots: a hybrid model's requests hold Mamba state slots
        (`StepInputs.state_slots`); so do an encoder-decoder model's, whose first steps carry their encoder inputs
        (`StepInputs.encoder_inputs`)."""
        self.mrope = mrope
        self.has_state = state_slots or encoder_decoder
        self.encoder_decoder = encoder_decoder
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.row_of: dict[str, int] = {}
        self.reqs: list[Optional[Request]] = []
        self._free_rows: list[int] = []
        self.block_table = np.zeros((0, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        # Tokens per row (prompt + output so far); columns grow by doubling up to max_model_len, so the buffer
        # follows the longest request seen so far, not the model's limit. int32: half the memory of int64.
        self.tokens = np.zeros((0, min(max_model_len, 1024)), dtype=np.int32)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_prompt = np.zeros(0, dtype=np.int64)
        self.temperature = np.zeros(0, dtype=np.float32)
        self.top_k = np.zeros(0, dtype=np.int64)
        self.top_p = np.zeros(0, dtype=np.float32)
        self.min_p = np.zeros(0, dtype=np.float32)
        self.logprobs = np.zeros(0, dtype=np.int64)  # -1 = none
        self.min_tokens = np.zeros(0, dtype=np.int64)
        self.seeded = np.zeros(0, dtype=bool)
        self.penalized = np.zeros(0, dtype=bool)
        self.adjusted = np.zeros(0, dtype=bool)
        self.worded = np.zeros(0, dtype=bool)  # has bad_words
        self.speech_ruled = np.zeros(0, dtype=bool)  # has Whisper's decoding rules
        self.budgeted = np.zeros(0, dtype=bool)  # has a thinking_token_budget
        self.constrained = np.zeros(0, dtype=bool)  # follows a structured-output grammar
        self.prompt_logprobs = np.zeros(0, dtype=np.int64)  # -1 = none
        self.lora_slot = np.zeros(0, dtype=np.int64)  # 0 = no adapter
        self.pool_mode = np.zeros(0, dtype=np.int64)  # embedding requests: POOL_CODE of their pooling; 0 = none
        # Where the prompt's last image ends (0: no images): chunks before it may hold image tokens, whose
        # embeddings the images' features replace.
        self.images_end = np.zeros(0, dtype=np.int64)
        self.rope_delta = np.zeros(0, dtype=np.int64)  # M-RoPE: the shift of tokens after the last image
        self.epoch = np.zeros(0, dtype=np.int64)
        self.state_slot = np.zeros(0, dtype=np.int64)  # hybrid models: the row's Mamba state slot
        self._epochs = 0
        self._grow_rows(max_num_seqs)

    # ------------------------------------------------------------------ capacity
    _ROW_ARRAYS = ("block_table", "num_blocks", "tokens", "num_tokens", "num_prompt", "temperature", "top_k",
                   "top_p", "min_p", "logprobs", "min_tokens", "seeded", "penalized", "adjusted", "worded",
                   "speech_ruled", "budgeted", "constrained", "prompt_logprobs", "lora_slot", "pool_mode", "images_end", "rope_delta",
                   "epoch", "state_slot")

    def _grow_rows(self, n: int) -> None:
        old = len(self.reqs)
        for name in self._ROW_ARRAYS:
            arr = getattr(self, name)
            grown = np.zeros((old + n,) + arr.shape[1:], dtype=arr.dtype)
            grown[:old] = arr
            setattr(self, name, grown)
        self.reqs += [None] * n
        self._free_rows += range(old + n - 1, old - 1, -1)  # pop() hands out low rows first

    def _ensure_width(self, length: int) -> None:
        width = self.tokens.shape[1]
        if length <= width:
            return
        while width < length:
            width *= 2
        grown = np.zeros((self.tokens.shape[0], min(max(width, length), self.max_model_len + 1)), dtype=np.int32)
        grown[:, :self.tokens.shape[1]] = self.tokens
        self.tokens = grown

    # ------------------------------------------------------------------ membership
    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def _add(self, req: Request) -> int:
        if not self._free_rows:
            self._grow_rows(max(len(self.reqs), 1))
        row = self._free_rows.pop()
        self._epochs += 1
        self.epoch[row] = self._epochs
        self.row_of[req.request_id] = row
        self.reqs[row] = req
        n = req.num_tokens
        self._ensure_width(n + 1)
        self.tokens[row, :n] = req.all_token_ids
        self.num_tokens[row] = n
        self.num_prompt[row] = req.num_prompt_tokens
        p = req.params
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_k[row] = min(p.top_k, self.vocab_size) if p.top_k > 0 else 0
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[row] = p.min_tokens
        self.seeded[row] = p.seed is not None and not p.greedy
        self.penalized[row] = p.needs_penalties
        self.adjusted[row] = p.adjusts_logits
        self.worded[row] = req.bad_words_ids is not None
        self.speech_ruled[row] = req.speech_rules is not None
        self.budgeted[row] = req.think is not None
        self.constrained[row] = req.matcher is not None
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.pool_mode[row] = 0 if req.pooling is None else POOL_CODE[req.pooling.pooling]
        self.images_end[row] = max((im.end for im in req.images), default=0)
        self.rope_delta[row] = req.images[-1].rope_shift if req.images else 0
        return row

    def _remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id)
        self.reqs[row] = None
        self.epoch[row] = 0
        self.block_table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def sync(self, kv: KVCacheManager) -> None:
        """Replay the block-table changes since the last step: rows for new requests, none for freed ones."""
        for rid, (req, first) in kv.take_changes().items():
            blocks = kv.req_blocks.get(rid)
            row = self.row_of.get(rid)
            if blocks is None:
                if row is not None:
                    self._remove(rid)
                continue
            if row is None:
                row, first = self._add(req), 0
            self.lora_slot[row] = req.lora_slot  # (a request preempted and readmitted in one step may move)
            if self.has_state:  # (likewise its state slot)
                self.state_slot[row] = kv.state_slot(rid)
            old = int(self.num_blocks[row])
            self.block_table[row, first:len(blocks)] = blocks[first:]
            if old > len(blocks):
                self.block_table[row, len(blocks):old] = 0
            self.num_blocks[row] = len(blocks)

    def record(self, rows: np.ndarray, epochs: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """Tokens sampled by a step (vectorised): token_ids[i] sits at positions[i] of row rows[i], if the row
        is still in the tenancy `epochs[i]` (async scheduling: the request may have left since, and another
        may hold the row now)."""
        keep = self.epoch[rows] == epochs
        if not keep.all():
            rows, positions, token_ids = rows[keep], positions[keep], token_ids[keep]
        if len(rows) == 0:
            return
        self._ensure_width(int(positions.max()) + 2)
        self.tokens[rows, positions] = token_ids
        self.num_tokens[rows] = positions + 1

    def _write_drafts(self, sch: list) -> None:
        """Speculative drafts go after each request's known tokens (counted as known until `truncate`)."""
        for s in sch:
            if s.num_drafts:
                req = s.req
                self.append(req.request_id, req.num_tokens, req.draft_token_ids[:s.num_drafts])

    def truncate(self, request_id: str, length: int) -> None:
        """Keep a row's first `length` tokens (after a speculative step: the drafts that were not accepted go)."""
        row = self.row_of.get(request_id)
        if row is not None:
            self.num_tokens[row] = min(int(self.num_tokens[row]), length)

    def append(self, request_id: str, start: int, token_ids: list[int]) -> None:
        """Tokens the engine appended to a request without sampling them (structured outputs' jump-forward), at
        positions start.. of its row; a request without a row gets them with its row."""
        row = self.row_of.get(request_id)
        if row is None or not token_ids:
            return
        assert self.num_tokens[row] == start, "appended tokens must follow the row's last token"
        self._ensure_width(start + len(token_ids) + 1)
        self.tokens[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    # ------------------------------------------------------------------ one step
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        row_of = self.row_of
        sch = sched.scheduled
        n = len(sch)
        # One pass over the scheduled requests; transposed so that each column is contiguous (tensors made from
        # these must not change strides from step to step: a compiled graph would guard on them).
        flat = np.array([x for s in sch for x in (row_of[s.req.request_id], s.num_tokens, s.start, s.samples)],
                        dtype=np.int64).reshape(n, 4).T.copy()
        rows, q_lens, starts, samples = flat  # samples: tokens sampled (0 or 1; 1 + drafts with drafts)
        has_drafts = sched.has_drafts
        if has_drafts:
            samples = samples + np.array([s.num_drafts for s in sch], dtype=np.int64)
            self._write_drafts(sch)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts + q_lens
        if num_tokens == n:  # decode-only step: one token per request
            req_of_token = np.arange(n)
            positions = starts
        else:
            req_of_token = np.repeat(np.arange(n), q_lens)
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        token_rows = rows[req_of_token]
        input_ids = self.tokens[token_rows, positions].astype(np.int64)
        pending_idx = np.flatnonzero(positions >= self.num_tokens[token_rows])
        width = int(self.num_blocks[rows].max())
        table = self.block_table[rows, :width]
        bs = self.block_size
        slots = table[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        if has_drafts:  # every sampled position: the last `samples` tokens of each request
            sample_idx = np.repeat(np.arange(n), samples)
            before = np.repeat(np.cumsum(samples) - samples, samples)
            sample_tokens = qsl[1:][sample_idx] - samples[sample_idx] + np.arange(len(sample_idx)) - before
            sample_lens = positions[sample_tokens] + 1
        else:
            sample_idx = np.flatnonzero(samples)
            sample_tokens = qsl[1:][sample_idx] - 1
            sample_lens = seq_lens[sample_idx]
        wants = np.flatnonzero(self.prompt_logprobs[rows] >= 0)
        lora = self.lora_slot[rows]
        pooled = np.flatnonzero(self.pool_mode[rows])
        with_images = np.flatnonzero(self.images_end[rows] > starts)  # (decode steps skip them all)
        rope = self._rope_positions(sch, rows, token_rows, positions, with_images, qsl, starts, q_lens) \
            if self.mrope else None
        return StepInputs(
            req_ids=[s.req.request_id for s in sch], rows=rows, epochs=self.epoch[rows], input_ids=input_ids,
            positions=positions,
            query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
            sample_idx=sample_idx, sample_tokens=sample_tokens, has_drafts=has_drafts,
            num_known=np.maximum(self.num_tokens[rows], seq_lens),
            sampling=self._sampling_rows(rows[sample_idx], sample_lens),
            pending_idx=pending_idx, pending_rows=token_rows[pending_idx],
            lora_slots=lora[req_of_token] if lora.any() else None,
            pool=self._pool_tokens(pooled, sch, rows, qsl, starts) if len(pooled) else None,
            state_slots=self.state_slot[rows] if self.has_state else None,
            encoder_inputs=self._encoder_inputs(sch, starts) if self.encoder_decoder else None,
            images=image_step([sch[i].req for i in with_images], qsl[with_images], starts[with_images],
                              q_lens[with_images]) if len(with_images) else None, rope_positions=rope,
            prompt_logprobs=self._prompt_logprob_tokens(wants, sch, rows, qsl, starts, q_lens) if len(wants) else None)

    @staticmethod
    def _encoder_inputs(sch: list, starts: np.ndarray) -> Optional[list[Any]]:
        fresh = np.flatnonzero(starts == 0)
        return [sch[i].req.encoder_input for i in fresh] if len(fresh) else None

    def _rope_positions(self, sch: list, rows: np.ndarray, token_rows: np.ndarray, positions: np.ndarray,
                        with_images: np.ndarray, qsl: np.ndarray, starts: np.ndarray,
                        q_lens: np.ndarray) -> Optional[np.ndarray]:
        """M-RoPE's 1-D positions: each token's index plus the shift of the images before it (a request's last
        shift for tokens past all its images; per token within the chunks that reach back among them)."""
        delta = self.rope_delta[token_rows]
        if not delta.any() and not len(with_images):
            return None
        rope = positions + np.where(positions >= self.images_end[token_rows], delta, 0)
        for i in with_images:
            a, b = int(qsl[i]), int(qsl[i + 1])
            rope[a:b] = positions[a:b] + rope_shifts(sch[i].req, positions[a:b])
        return rope

    def _prompt_logprob_tokens(self, wants: np.ndarray, sch: list, rows: np.ndarray, qsl: np.ndarray,
                               starts: np.ndarray, q_lens: np.ndarray) -> Optional[PromptLogprobTokens]:
        """The prompt positions of this step's chunks (for the few requests that asked) that score a prompt token."""
        idx, targets, owners = [], [], []
        for i in wants:
            row, start = rows[i], int(starts[i])
            end = min(start + int(q_lens[i]), int(self.num_prompt[row]) - 1)
            if end <= start:
                continue  # a decode step, or the chunk holding only the prompt's last token
            idx.append(np.arange(qsl[i], qsl[i] + end - start))
            targets.append(self.tokens[row, start + 1:end + 1])
            owners.append((sch[i].req.request_id, start + 1, end - start))
        if not owners:
            return None
        return PromptLogprobTokens(np.concatenate(idx), np.concatenate(targets).astype(np.int64), owners,
                                   int(self.prompt_logprobs[rows[wants]].max()))

    def _pool_tokens(self, pooled: np.ndarray, sch: list, rows: np.ndarray, qsl: np.ndarray,
                     starts: np.ndarray) -> PoolTokens:
        """The hidden-state rows each embedding request of this step pools: its whole chunk (mean), the prompt's
        last token once the chunk reaches it (last), the first token in the first chunk (cls)."""
        idx, seg, owners = [], [], []
        for j, i in enumerate(pooled):
            lo, hi, start = int(qsl[i]), int(qsl[i + 1]), int(starts[i])
            mode, done = self.pool_mode[rows[i]], start + hi - lo >= self.num_prompt[rows[i]]
            if mode == POOL_CODE["mean"]:
                take = np.arange(lo, hi)
            elif mode == POOL_CODE["last"]:
                take = np.arange(hi - 1, hi) if done else np.zeros(0, dtype=np.int64)
            else:
                take = np.arange(lo, lo + 1) if start == 0 else np.zeros(0, dtype=np.int64)
            idx.append(take)
            seg.append(np.full(len(take), j, dtype=np.int64))
            owners.append((sch[i].req.request_id, start, len(take), bool(done)))
        return PoolTokens(np.concatenate(idx).astype(np.int64), np.concatenate(seg), owners)

    def _sampling_rows(self, rows: np.ndarray, seq_lens: np.ndarray) -> SamplingRows:
        logprobs = self.logprobs[rows]
        reqs = self.reqs
        seeded = np.flatnonzero(self.seeded[rows])
        penalized = np.flatnonzero(self.penalized[rows])
        adjusted = np.flatnonzero(self.adjusted[rows])
        worded = np.flatnonzero(self.worded[rows])
        speech = np.flatnonzero(self.speech_ruled[rows])
        budgeted = np.flatnonzero(self.budgeted[rows])
        banned = np.flatnonzero(seq_lens - self.num_prompt[rows] < self.min_tokens[rows])
        constrained = np.flatnonzero(self.constrained[rows])
        grammar = None
        if len(constrained):
            matchers = [reqs[rows[i]].matcher for i in constrained]  # type: ignore[union-attr]
            grammar = (constrained.astype(np.int64), fill_bitmasks(matchers, self.vocab_size))
        return SamplingRows(
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            min_p=self.min_p[rows], max_logprobs=int(logprobs.max()) if len(rows) else -1,
            seeded=[(int(i), reqs[rows[i]]) for i in seeded],  # type: ignore[misc]
            penalized=[(int(i), reqs[rows[i]]) for i in penalized],  # type: ignore[misc]
            banned=[(int(i), reqs[rows[i]]) for i in banned],  # type: ignore[misc]
            adjusted=[(int(i), reqs[rows[i]]) for i in adjusted],  # type: ignore[misc]
            worded=[(int(i), reqs[rows[i]]) for i in worded],  # type: ignore[misc]
            speech=[(int(i), reqs[rows[i]]) for i in speech],  # type: ignore[misc]
            thinking=[(int(i), r) for i in budgeted for r in [reqs[rows[i]]] if r.think.active],  # type: ignore
            grammar=grammar)

    # ------------------------------------------------------------------ tests
    def check_consistency(self, kv: KVCacheManager) -> None:
        """Invariants, for tests (call after `sync`): one row per request holding blocks, mirroring its block
        table, its tokens and its sampling parameters; free rows hold nothing."""
        if set(self.row_of) != set(kv.req_blocks):
            raise AssertionError(f"rows {sorted(self.row_of)} != requests holding blocks {sorted(kv.req_blocks)}")
        if len(set(self.row_of.values())) != len(self.row_of):
            raise AssertionError("two requests share a row")
        for rid, row in self.row_of.items():
            req, blocks = self.reqs[row], kv.req_blocks[rid]
            if req is None or req.request_id != rid:
                raise AssertionError(f"row {row} does not hold {rid}")
            table = self.block_table[row]
            if table[:self.num_blocks[row]].tolist() != blocks or table[len(blocks):].any():
                raise AssertionError(f"{rid}: block table row {self.block_table[row].tolist()} != {blocks}")
            tokens = self.tokens[row, :req.num_tokens].tolist()
            if self.num_tokens[row] != req.num_tokens or tokens != req.all_token_ids:
                raise AssertionError(f"{rid}: tokens differ from the request's")
            if self.temperature[row] != (0.0 if req.params.greedy else np.float32(req.params.temperature)):
                raise AssertionError(f"{rid}: temperature differs")
        for row in self._free_rows:
            if self.reqs[row] is not None or self.num_blocks[row] or self.block_table[row].any():
                raise AssertionError(f"free row {row} is not empty")

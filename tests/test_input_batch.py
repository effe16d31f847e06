"""The persistent input batch stays a faithful mirror of the scheduler and KV manager (hypothesis).

Random add / step / abort / preempt sequences drive the real Scheduler and KVCacheManager (small pools, so that
preemption by recompute happens on its own too); after every step the batch must hold exactly one row per
request that holds blocks, with its block table, tokens and sampling parameters, and each step's gathered
inputs must equal what a from-scratch per-request construction gives.

With `lag` the simulation runs as async scheduling does: step N+1 is scheduled and prepared before step N's
tokens reach the host, and its inputs for those tokens come from a simulated device copy of each row's last
sampled token. A simulated KV cache then checks that every step attends over exactly its request's own tokens.
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager, cdiv
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import Scheduler, SchedulerOutput
from streamer.sampling_params import SamplingParams
from streamer.worker.input_batch import InputBatch, StepInputs

VOCAB = 1000
MAX_LEN = 200

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 4)),
    st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("preempt"), st.integers(0, 1000)),
), min_size=1, max_size=60)

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, seed=3),
          SamplingParams(temperature=1.2, top_k=5, min_p=0.1, logprobs=2),
          SamplingParams(temperature=0.5, repetition_penalty=1.3, min_tokens=2),
          SamplingParams(temperature=1.0, top_k=5000)]  # top_k beyond the vocabulary: clamped


class Sim:
    def __init__(self, block_size: int, num_blocks: int, budget: int, max_seqs: int, caching: bool,
                 policy: str, lag: bool = False) -> None:
        self.cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                enable_prefix_caching=caching, scheduling_policy=policy)
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.cfg, self.kv, max_model_len=MAX_LEN)
        # Start with fewer rows than seats and a narrow token buffer: growing both is part of the test.
        self.batch = InputBatch(1, MAX_LEN, cdiv(MAX_LEN, block_size), block_size, VOCAB)
        self.batch._ensure_width(1)
        self.live: list[Request] = []
        self.rng = random.Random(0)
        self.n = 0
        self.steps = 0
        self.lag = lag
        self.inflight: Optional[tuple[SchedulerOutput, StepInputs, np.ndarray]] = None
        self.device_last: dict[int, int] = {}  # row -> last sampled token (the runner's device copy)
        self.future: dict[str, list[int]] = {}  # request -> tokens sampled but not yet on the host
        self.kv_slots: dict[int, int] = {}  # slot -> token whose K/V it holds
        self.stale = 0  # tokens whose request left its row before they reached the host
        self.pending = 0  # input tokens read from the device copy

    def add(self, prompt_len: int, max_tokens: int, prefix: int, which: int) -> None:
        if cdiv(prompt_len + max_tokens, self.cfg.block_size) > self.kv.num_blocks:
            return  # the engine rejects these up front
        shared = [prefix * 7 + i for i in range(min(prompt_len, (prefix + 1) * 5))]
        prompt = shared + [self.rng.randrange(VOCAB) for _ in range(prompt_len - len(shared))]
        req = Request(f"r{self.n}", prompt, PARAMS[which], max_tokens, block_size=self.cfg.block_size,
                      hash_blocks=self.cfg.enable_prefix_caching, priority=which % 2)
        self.n += 1
        self.sched.add(req)
        self.live.append(req)

    def abort(self, k: int) -> None:
        if self.live:
            self.sched.finish(self.live.pop(k % len(self.live)), RequestStatus.FINISHED_ABORTED)

    def preempt(self, k: int) -> None:
        if self.sched.running:
            self.sched._preempt(self.sched.running[k % len(self.sched.running)])

    def step(self) -> None:
        out = self.sched.schedule()
        self.batch.sync(self.kv)
        self.batch.check_consistency(self.kv)
        nxt = None
        if out.scheduled:
            inputs = self.batch.prepare(out)
            check_inputs(inputs, out, self.kv, self.cfg.block_size, self.inflight)
            nxt = (out, inputs, self.execute(inputs, out))
        if self.inflight is not None:
            self.process(*self.inflight)
        self.inflight = nxt
        if not self.lag and self.inflight is not None:
            self.process(*self.inflight)
            self.inflight = None

    def execute(self, inputs: StepInputs, out: SchedulerOutput) -> np.ndarray:
        """The device's part: resolve tokens not yet on the host, write K/V slots, check what attention reads,
        "sample" one token per sampling request and keep it per row (as the runner's `last_tokens`)."""
        ids = inputs.input_ids.copy()
        ids[inputs.pending_idx] = [self.device_last[r] for r in inputs.pending_rows.tolist()]
        self.pending += len(inputs.pending_idx)
        for t, slot in enumerate(inputs.slot_mapping.tolist()):
            self.kv_slots[slot] = ids[t]
        bs = self.cfg.block_size
        for i, s in enumerate(out.scheduled):
            table, n = inputs.block_table[i], int(inputs.seq_lens[i])
            context = [self.kv_slots.get(int(table[p // bs]) * bs + p % bs) for p in range(n)]
            expected = s.req.all_token_ids[:n] + self.future.get(s.req.request_id, [])[:max(0, n - s.req.num_tokens)]
            assert context == expected, f"{s.req.request_id} attends over wrong K/V"
        idx = inputs.sample_idx
        tokens = np.array([self.rng.randrange(VOCAB) for _ in idx], dtype=np.int64)
        for i, tok in zip(idx.tolist(), tokens.tolist()):
            self.device_last[int(inputs.rows[i])] = tok
            self.future.setdefault(out.scheduled[i].req.request_id, []).append(tok)
        return tokens

    def process(self, out: SchedulerOutput, inputs: StepInputs, tokens: np.ndarray) -> None:
        """The host's part, a step late under `lag`: record and append the tokens (as the engine does)."""
        idx = inputs.sample_idx
        self.stale += int((self.batch.epoch[inputs.rows[idx]] != inputs.epochs[idx]).sum())
        self.batch.record(inputs.rows[idx], inputs.epochs[idx], inputs.seq_lens[idx], tokens)
        for i, tok in zip(idx, tokens.tolist()):
            req = out.scheduled[i].req
            self.future[req.request_id].pop(0)
            if req.is_finished:  # finished by the step before: computing this one was wasted, and it is dropped
                assert req.status != RequestStatus.FINISHED_LENGTH, "scheduled past a request's known end"
                continue
            req.append_token(tok)
            stop = tok % 10 == 0  # an "eos": under `lag`, the step in flight computed for it in vain
            if stop or req.num_output_tokens >= req.max_tokens or req.num_tokens >= MAX_LEN:
                self.sched.finish(req, RequestStatus.FINISHED_STOPPED if stop else RequestStatus.FINISHED_LENGTH)
                self.live.remove(req)
        self.steps += 1


def check_inputs(inputs: StepInputs, out: SchedulerOutput, kv: KVCacheManager, bs: int, inflight) -> None:
    """Compare with the batch built from scratch, request by request. Positions past a request's known tokens
    (the step in flight samples them) must be exactly the pending ones."""
    sch = out.scheduled
    assert inputs.req_ids == [s.req.request_id for s in sch]
    ids = [t if p < s.req.num_tokens else -1 for s in sch
           for p, t in zip(range(s.start, s.start + s.num_tokens), s.req.all_token_ids[s.start:] + [-1] * s.num_tokens)]
    pending = [i for i, t in enumerate(ids) if t == -1]
    assert inputs.pending_idx.tolist() == pending
    assert pending == [] or inflight is not None
    for s in sch:
        assert s.start + s.num_tokens <= s.req.num_tokens + (1 if inflight is not None else 0)
    got = inputs.input_ids.copy()
    got[inputs.pending_idx] = -1
    positions = [p for s in sch for p in range(s.start, s.start + s.num_tokens)]
    slots = [kv.blocks_of(s.req.request_id)[p // bs] * bs + p % bs
             for s in sch for p in range(s.start, s.start + s.num_tokens)]
    assert got.tolist() == ids
    assert inputs.pending_rows.tolist() == inputs.rows[np.repeat(np.arange(len(sch)), np.diff(
        inputs.query_start_loc))][inputs.pending_idx].tolist()
    assert inputs.positions.tolist() == positions
    assert inputs.slot_mapping.tolist() == slots
    assert inputs.query_start_loc.tolist() == np.cumsum([0] + [s.num_tokens for s in sch]).tolist()
    assert inputs.seq_lens.tolist() == [s.start + s.num_tokens for s in sch]
    for i, s in enumerate(sch):
        blocks = kv.blocks_of(s.req.request_id)
        assert inputs.block_table[i, :len(blocks)].tolist() == blocks
        assert not inputs.block_table[i, len(blocks):].any()
    assert inputs.sample_idx.tolist() == [i for i, s in enumerate(sch) if s.samples]
    reqs = [sch[i].req for i in inputs.sample_idx]
    sr = inputs.sampling
    assert sr.temperature.tolist() == [0.0 if r.params.greedy else np.float32(r.params.temperature) for r in reqs]
    assert sr.top_k.tolist() == [min(r.params.top_k, VOCAB) if r.params.top_k > 0 else 0 for r in reqs]
    assert sr.top_p.tolist() == [np.float32(r.params.top_p) for r in reqs]
    assert sr.min_p.tolist() == [np.float32(r.params.min_p) for r in reqs]
    assert sr.max_logprobs == max([-1] + [r.params.logprobs for r in reqs if r.params.logprobs is not None])
    assert [(i, r) for i, r in sr.seeded] == [(i, r) for i, r in enumerate(reqs)
                                              if r.params.seed is not None and not r.params.greedy]
    assert [(i, r) for i, r in sr.penalized] == [(i, r) for i, r in enumerate(reqs) if r.params.needs_penalties]
    assert [(i, r) for i, r in sr.banned] == [(i, r) for i, r in enumerate(reqs)
                                              if r.num_output_tokens + r.num_pending - 1 < r.params.min_tokens]


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([2, 4, 16]), num_blocks=st.integers(8, 40),
       budget=st.integers(4, 64), max_seqs=st.integers(1, 6), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), lag=st.booleans())
def test_persistent_batch_mirrors_scheduler(ops, block_size, num_blocks, budget, max_seqs, caching, policy, lag):
    sim = Sim(block_size, num_blocks, budget, max_seqs, caching, policy, lag)
    for op in ops:
        getattr(sim, op[0])(*op[1:])
    for _ in range(400):  # drain: everything finishes, every row and block comes back
        if not sim.sched.has_work() and sim.inflight is None:
            break
        sim.step()
    assert not sim.sched.has_work() and sim.inflight is None
    sim.batch.sync(sim.kv)
    sim.batch.check_consistency(sim.kv)
    assert len(sim.batch) == 0 and sim.kv.pool.num_free == num_blocks


def test_rows_are_reused_and_grow():
    sim = Sim(4, 64, 64, 8, True, "fcfs")
    for i in range(6):
        sim.add(10 + i, 3, i, i % len(PARAMS))
    sim.step()
    assert len(sim.batch) == 6 and len(sim.batch.reqs) >= 6  # grew from one row
    rows_before = set(sim.batch.row_of.values())
    while sim.sched.has_work():
        sim.step()
    sim.batch.sync(sim.kv)
    assert len(sim.batch) == 0
    sim.add(150, 5, 0, 0)  # longer than the token buffer was: it widens
    sim.step()
    assert set(sim.batch.row_of.values()) <= rows_before  # a freed row is handed out again
    assert sim.batch.tokens.shape[1] >= 151


def test_async_lag_with_row_reuse():
    """Directed: many short requests through few rows under `lag`, so that requests finish (or are preempted)
    with a token in flight and their rows go to newcomers before that token arrives."""
    stale = pending = 0
    for seed in range(30):
        sim = Sim(4, 30, 16, 3, True, "fcfs", lag=True)
        sim.rng.seed(seed)
        for i in range(8):
            sim.add(5 + i, 8, i % 2, i % len(PARAMS))
        for step in range(200):
            if not sim.sched.has_work() and sim.inflight is None:
                break
            sim.step()
            if step == 4:
                sim.preempt(seed)
        assert not sim.sched.has_work() and sim.inflight is None
        sim.batch.sync(sim.kv)
        assert len(sim.batch) == 0 and sim.kv.pool.num_free == 30
        stale, pending = stale + sim.stale, pending + sim.pending
    assert stale > 0 and pending > 0  # the cases this test is about did happen

"""The persistent input batch stays a faithful mirror of the scheduler and KV manager (hypothesis).

Random add / step / abort / preempt sequences drive the real Scheduler and KVCacheManager (small pools, so that
preemption by recompute happens on its own too); after every step the batch must hold exactly one row per
request that holds blocks, with its block table, tokens and sampling parameters, and each step's gathered
inputs must equal what a from-scratch per-request construction gives.
"""
from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings, strategies as st

from streamer.config import EngineConfig
from streamer.input_batch import InputBatch, StepInputs
from streamer.kv_cache import KVCacheManager, cdiv
from streamer.request import Request, RequestStatus
from streamer.sampling_params import SamplingParams
from streamer.scheduler import Scheduler, SchedulerOutput

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
                 policy: str) -> None:
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
        if not out.scheduled:
            return
        inputs = self.batch.prepare(out)
        check_inputs(inputs, out, self.kv, self.cfg.block_size)
        # "Sample": one token per sampling request, recorded in the batch, then appended (as the engine does).
        idx = inputs.sample_idx
        tokens = np.array([self.rng.randrange(VOCAB) for _ in idx], dtype=np.int64)
        self.batch.record(inputs.rows[idx], inputs.seq_lens[idx], tokens)
        for i, tok in zip(idx, tokens.tolist()):
            req = out.scheduled[i].req
            req.append_token(tok)
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= MAX_LEN:
                self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                self.live.remove(req)
        self.steps += 1


def check_inputs(inputs: StepInputs, out: SchedulerOutput, kv: KVCacheManager, bs: int) -> None:
    """Compare with the batch built from scratch, request by request."""
    sch = out.scheduled
    assert inputs.req_ids == [s.req.request_id for s in sch]
    ids = [t for s in sch for t in s.req.all_token_ids[s.start:s.start + s.num_tokens]]
    positions = [p for s in sch for p in range(s.start, s.start + s.num_tokens)]
    slots = [kv.blocks_of(s.req.request_id)[p // bs] * bs + p % bs
             for s in sch for p in range(s.start, s.start + s.num_tokens)]
    assert inputs.input_ids.tolist() == ids
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
                                              if r.num_output_tokens < r.params.min_tokens]


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([2, 4, 16]), num_blocks=st.integers(8, 40),
       budget=st.integers(4, 64), max_seqs=st.integers(1, 6), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_persistent_batch_mirrors_scheduler(ops, block_size, num_blocks, budget, max_seqs, caching, policy):
    sim = Sim(block_size, num_blocks, budget, max_seqs, caching, policy)
    for op in ops:
        getattr(sim, op[0])(*op[1:])
    for _ in range(400):  # drain: everything finishes, every row and block comes back
        if not sim.sched.has_work():
            break
        sim.step()
    assert not sim.sched.has_work()
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

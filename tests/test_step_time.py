"""Stall-free steps: the step-time model, the budget policy and the scheduler planning against them, with a fake
cost model (no timed assertions)."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager, cdiv
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import Scheduler
from streamer.core.step_time import (
    AUTO_FACTOR,
    AUTO_MIN_SECONDS,
    AUTO_WAIT_SHARE,
    ItlPolicy,
    StepPlan,
    StepShape,
    StepTimeModel,
    chunk_pairs,
    nonneg_least_squares,
    shape_of,
)
from streamer.sampling_params import SamplingParams
from tests import test_scheduler_properties as sched_props


# ---------------------------------------------------------------------- the model
def _truth(shape: StepShape, knee: int = 0) -> float:
    return (0.02 + 0.001 * max(shape.tokens - knee, 0) + 0.0005 * shape.rows + 0.004 * shape.decode_context / 1e3
            + 0.03 * shape.prefill_pairs / 1e6)


def _random_shape(rng: random.Random) -> StepShape:
    rows = [(rng.randrange(0, 2000), 1) for _ in range(rng.randrange(0, 40))]
    rows += [(rng.randrange(0, 1000), rng.randrange(2, 600)) for _ in range(rng.randrange(0, 3))]
    return shape_of(rows or [(0, 1)])


def test_the_model_learns_a_linear_device_from_measured_steps():
    rng = random.Random(0)
    model = StepTimeModel()
    assert not model.ready
    for _ in range(200):
        s = _random_shape(rng)
        model.observe(s, _truth(s))
    assert model.ready
    for _ in range(50):
        s = _random_shape(rng)
        assert model.predict(s) == pytest.approx(_truth(s), rel=1e-3)
    assert model.error < 1e-3  # (the smoothed error of its predictions before each observation)


def test_the_model_follows_a_change_of_load():
    """The device slows down 2x (another job takes the cores): recent steps outweigh older ones."""
    rng = random.Random(1)
    model = StepTimeModel()
    for _ in range(256):
        s = _random_shape(rng)
        model.observe(s, _truth(s))
    for _ in range(300):
        s = _random_shape(rng)
        model.observe(s, 2 * _truth(s))
    s = shape_of([(100, 1)] * 16 + [(0, 256)])
    assert model.predict(s) == pytest.approx(2 * _truth(s), rel=0.05)


def test_one_step_far_over_its_prediction_barely_moves_the_model():
    """A compilation or a page fault makes one step 100x slower: the fit takes it as 4x at most."""
    rng = random.Random(2)
    model = StepTimeModel(refit_every=1)
    for _ in range(64):
        s = _random_shape(rng)
        model.observe(s, _truth(s))
    s = shape_of([(100, 1)] * 16)
    model.observe(s, 100 * _truth(s))
    assert model.predict(s) == pytest.approx(_truth(s), rel=0.2)


def test_the_profile_gives_a_first_fit_and_the_knee():
    """A GPU-like device: flat up to 256 tokens, then linear. The knee is read off the profile."""
    def gpu(s: StepShape) -> float:
        return 0.01 + 0.00002 * max(s.tokens - 256, 0) + 0.001 * s.decode_context / 1e3

    shapes = [shape_of([(255, 1)]), shape_of([(63, 1)] * 8), shape_of([(511, 1)] * 8)] + \
        [shape_of([(0, n)]) for n in (16, 64, 256, 1024, 2048)]
    model = StepTimeModel()
    model.set_profile([(s, gpu(s)) for s in shapes])
    assert model.knee == 256
    assert model.ready
    big = shape_of([(0, 2048)])
    assert model.predict(big) == pytest.approx(gpu(big), rel=0.05)


def test_nonnegative_least_squares():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(50), rng.uniform(0, 10, 50), rng.uniform(0, 10, 50)])
    y = 1.0 + 2.0 * x[:, 1] - 0.5 * x[:, 2]  # a negative truth: pinned to 0, the rest refitted
    coef = nonneg_least_squares(x, y, np.ones(50))
    assert (coef >= 0).all()
    assert coef[2] == 0.0
    y2 = 1.0 + 2.0 * x[:, 1] + 0.5 * x[:, 2]
    assert nonneg_least_squares(x, y2, np.ones(50)) == pytest.approx([1.0, 2.0, 0.5])


def test_bad_measurements_are_ignored():
    model = StepTimeModel()
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.observe(shape_of([(0, 1)]), bad)
    assert model.observed == 0 and not model.ready


# ---------------------------------------------------------------------- the policy
def test_explicit_target_is_the_budget_and_an_unmeetable_one_is_counted_and_logged_once(caplog):
    policy = ItlPolicy(0.1)
    assert policy.budget(0.05, 100, 1) == pytest.approx(0.1)  # (no widening for waiting prompts with a target)
    assert policy.budget(0.05, 0, 4, gap=0.01) == pytest.approx(0.09)
    with caplog.at_level("WARNING", logger="streamer"):
        policy.budget(0.2, 0, 4)
        policy.budget(0.3, 0, 4)
    assert policy.unmet_steps == 2
    assert sum("cannot be met" in r.message for r in caplog.records) == 1


def test_automatic_budget():
    policy = ItlPolicy(None)
    assert policy.budget(0.1, 0, 16) == pytest.approx(AUTO_FACTOR * 0.1)
    assert policy.budget(0.1, 1, 16) == pytest.approx(AUTO_FACTOR * 0.1)  # (a trickle of prompts)
    assert policy.budget(0.001, 0, 1) == pytest.approx(AUTO_MIN_SECONDS)
    # A burst: 15 prompts beside one stream get a share each, as the stream's row does
    assert policy.budget(0.03, 15, 1) == pytest.approx(16 * 0.03)
    assert policy.budget(0.03, 15, 1, gap=0.002) == pytest.approx(16 * 0.032 - 0.002)  # (the gap is in every step)
    assert policy.budget(0.1, 1, 16, wait=30.0) == pytest.approx(AUTO_WAIT_SHARE * 30.0)  # a long wait widens it


def test_plan_cuts_chunks_on_block_boundaries_and_keeps_the_one_block_floor():
    model = StepTimeModel()
    model.coef = np.array([0.02, 0.001, 0.0, 0.0, 0.0])
    model.ready = True
    plan = StepPlan(model, 0.1, block_size=16)
    plan.shape = shape_of([(100, 1)] * 4)  # decodes reserved: 24 ms
    n = plan.chunk(0, 1000)
    assert n == 64  # 76 tokens fit (100 - 24 ms at 1 ms each), cut down to the block boundary
    plan.take(0, n)
    assert plan.chunk(64, 1000) == 0  # 12 ms left: a sliver of a block is not worth a row
    assert plan.chunk(64, 10) == 10  # (unless it finishes the prompt)
    plan.take(64, 10)
    assert plan.chunk(0, 1000) == 0  # (nothing left; only the step's first chunk gets the floor)
    full = StepPlan(model, 0.03, block_size=16)
    full.shape = shape_of([(100, 1)] * 20)  # the decodes alone: 40 ms > 30 ms
    assert full.chunk(32, 1000) == 16  # the floor: one block
    assert full.chunk(32, 5) == 5  # (or what is left of the prompt)
    assert StepPlan(model, None, 16).chunk(0, 1000) == 1000  # no budget: tokens only


def test_chunk_pairs():
    assert chunk_pairs(0, 1) == 1
    assert chunk_pairs(0, 4) == 10
    assert chunk_pairs(10, 2) == 23
    assert sum(chunk_pairs(s, 1) for s in range(7)) == chunk_pairs(0, 7)


# ---------------------------------------------------------------------- the scheduler with a fake model
def fake_model(c0: float, per_token: float, per_row: float = 0.0, per_kctx: float = 0.0,
               per_mpairs: float = 0.0) -> StepTimeModel:
    model = StepTimeModel()
    model.coef = np.array([c0, per_token, per_row, per_kctx, per_mpairs])
    model.ready = True
    return model


class TimedSim:
    """A scheduler with a fake step-time model and a fake clock (`now`, which only tests move); every request's
    tokens are appended as a model would."""

    def __init__(self, model: StepTimeModel, target_ms, block_size: int = 16, budget_tokens: int = 4096,
                 policy: str = "fcfs", num_blocks: int = 100_000, max_seqs: int = 256) -> None:
        self.cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget_tokens, max_num_seqs=max_seqs,
                                max_itl_ms=target_ms, scheduling_policy=policy)
        self.kv = KVCacheManager(num_blocks, block_size, True)
        self.sched = Scheduler(self.cfg, self.kv, max_model_len=100_000)
        self.sched.step_model = model
        self.sched.use_itl_budget()
        self.now = 0.0
        self.sched.clock = lambda: self.now
        self.rng = random.Random(0)
        self.n = 0
        self.steps: list = []

    def add(self, prompt_len: int, max_tokens: int, priority: int = 0, streamed: bool = True) -> Request:
        req = Request(f"r{self.n}", [self.rng.randrange(50_000) for _ in range(prompt_len)],
                      SamplingParams(max_tokens=max_tokens), max_tokens, block_size=self.cfg.block_size,
                      arrival_time=self.now, priority=priority, streamed=streamed)
        self.n += 1
        self.sched.add(req)
        return req

    def step(self):
        out = self.sched.schedule()
        self.steps.append(out)
        for s in out.scheduled:
            if s.samples:
                s.req.append_token(self.rng.randrange(50_000))
                if s.req.num_output_tokens >= s.req.max_tokens:
                    self.sched.finish(s.req, RequestStatus.FINISHED_LENGTH)
        self.sched.check_invariants()
        return out


def _shape(out) -> StepShape:
    return shape_of([(s.start, s.num_tokens) for s in out.scheduled])


def test_decodes_first_then_a_chunk_that_fits_the_target():
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=100)
    streams = [sim.add(32, 200) for _ in range(4)]
    sim.step()  # (no stream decodes yet: the prompts go in whole)
    assert all(r.num_output_tokens == 1 for r in streams)
    big = sim.add(2000, 4)
    out = sim.step()
    assert {s.req.request_id for s in out.scheduled if s.num_tokens == 1} == {r.request_id for r in streams}
    chunk = next(s for s in out.scheduled if s.req is big)
    assert chunk.num_tokens == 64  # 100 ms - 20 ms - 4 decodes at 1 ms = 76 tokens, cut to the block boundary
    assert out.budget == pytest.approx(0.1)
    assert sim.sched.step_model.predict(_shape(out)) <= 0.1


def test_without_a_stream_the_token_budget_alone_applies():
    """Offline and non-streamed requests: nobody sees the gap between tokens, so chunks are as big as tokens allow."""
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=100, budget_tokens=1024)
    [sim.add(32, 200, streamed=False) for _ in range(4)]
    sim.step()
    big = sim.add(2000, 4, streamed=False)
    out = sim.step()
    assert out.budget is None
    assert next(s for s in out.scheduled if s.req is big).num_tokens == 1024 - 4


def test_off_means_tokens_only():
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=0, budget_tokens=1024)
    [sim.add(32, 200) for _ in range(4)]
    sim.step()
    sim.add(2000, 4)
    assert sim.step().budget is None


def test_decodes_are_never_crowded_out_by_a_prompt_running_ahead_of_them():
    """Priority: a high-priority prompt is admitted ahead of running low-priority streams; its chunks leave the
    token budget's room for their decodes (the time budget off: tokens only)."""
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=0, budget_tokens=256, policy="priority")
    streams = [sim.add(8, 100, priority=1) for _ in range(8)]
    sim.step()
    big = sim.add(5000, 4, priority=0)
    for _ in range(4):
        out = sim.step()
        assert {s.req for s in out.scheduled} >= set(streams)
        assert out.num_tokens == 256
    assert sim.sched.running[0] is big and big.num_computed_tokens == 4 * (256 - 8)


def test_an_unmeetable_target_still_moves_prefill_one_block_a_step():
    sim = TimedSim(fake_model(0.05, 0.001), target_ms=30)  # decode-only steps take > 50 ms
    [sim.add(16, 400) for _ in range(3)]
    sim.step()
    big = sim.add(160, 2)
    for _ in range(10):
        out = sim.step()
        assert next(s for s in out.scheduled if s.req is big).num_tokens == 16
    assert big.num_computed_tokens == 160
    assert sim.sched.itl.unmet_steps >= 10


def test_automatic_budget_widens_with_the_prompts_waiting_and_their_wait():
    model = fake_model(0.05, 0.001)
    sim = TimedSim(model, target_ms=None)
    [sim.add(16, 1000) for _ in range(4)]
    sim.step()
    big = sim.add(100_000, 2)
    out = sim.step()
    decodes = model.predict(shape_of([(16, 1)] * 4))
    assert out.budget == pytest.approx(AUTO_FACTOR * decodes)  # one prompt, four streams: half the step for it
    first = next(s for s in out.scheduled if s.req is big).num_tokens
    assert first == 48  # (54 ms of room at 1 ms a token, cut to the block boundary)
    [sim.add(64, 2) for _ in range(11)]  # a burst: 12 prompts beside 4 streams
    out = sim.step()
    assert out.budget == pytest.approx((1 + 12 / 4) * model.predict(shape_of([(17, 1)] * 4)))
    assert sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1) >= 3 * first
    sim.now += 20.0  # the oldest prompt has waited 20 s: steps may now take 2 s
    out = sim.step()
    assert out.budget == pytest.approx(AUTO_WAIT_SHARE * 20.0)
    assert sum(s.num_tokens for s in out.scheduled if s.num_tokens > 1) > 1000


def test_priority_prompts_chunk_before_lower_ranked_running_prompts():
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=100, policy="priority")
    [sim.add(16, 400, priority=0) for _ in range(2)]
    sim.step()
    low = sim.add(4000, 2, priority=5)
    sim.step()
    assert low.status == RequestStatus.RUNNING and 0 < low.num_computed_tokens < 4000
    high = sim.add(500, 2, priority=-1)
    out = sim.step()
    got = {s.req.request_id: s.num_tokens for s in out.scheduled}
    assert got[high.request_id] >= 64  # the room goes to the higher priority first
    assert got.get(low.request_id, 0) < got[high.request_id]


def test_a_whole_image_larger_than_the_budget_still_gets_in():
    """An image that attends both ways cannot be split; with a budget smaller than it, it goes whole into a step's
    first chunk instead of waiting forever."""
    import torch

    from streamer.multimodal.inputs import ImageInput
    sim = TimedSim(fake_model(0.02, 0.001), target_ms=40)
    [sim.add(16, 400) for _ in range(2)]
    sim.step()
    prompt = [5] * 8 + [7] * 300 + [5] * 8
    req = Request("img", prompt, SamplingParams(max_tokens=2), 2, block_size=16,
                  images=(ImageInput(8, 300, torch.zeros(1), b"i" * 16),), whole_images=True, streamed=True)
    sim.sched.add(req)
    seen = []
    for _ in range(10):
        out = sim.step()
        seen += [(s.start, s.num_tokens) for s in out.scheduled if s.req is req]
        if req.num_output_tokens:
            break
    assert req.num_output_tokens == 1
    assert all(not (8 < start + n < 308) for start, n in seen)  # never cut inside the image


# ---------------------------------------------------------------------- properties over random arrivals
arrivals = st.lists(st.tuples(st.integers(0, 6),  # steps before it arrives
                              st.integers(1, 700),  # prompt length
                              st.integers(1, 30),  # max tokens
                              st.booleans()),  # streamed
                    min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(arrivals=arrivals, c0=st.floats(0.001, 0.08), per_token=st.floats(1e-5, 3e-3),
       per_row=st.floats(0, 2e-3), per_kctx=st.floats(0, 0.02), per_mpairs=st.floats(0, 0.5),
       target_ms=st.sampled_from([None, 20.0, 50.0, 150.0]), block_size=st.sampled_from([4, 16]),
       policy=st.sampled_from(["fcfs", "priority"]), small_pool=st.booleans())
def test_planned_steps_fit_and_no_prompt_starves(arrivals, c0, per_token, per_row, per_kctx, per_mpairs, target_ms,
                                                 block_size, policy, small_pool):
    """Over random arrivals and random devices:
    - a step whose decodes alone fit the budget is predicted within it, unless its only prefill is the floor chunk
      (one block, or what the first prompt in line has left);
    - a prompt's first chunk comes within (the blocks of prefill ahead of it in line when it arrived) + 1 steps
      (FCFS, blocks aplenty), and every request finishes, also in a small KV pool (waits for blocks, preemption);
    - every block comes back."""
    model = fake_model(c0, per_token, per_row, per_kctx, per_mpairs)
    sim = TimedSim(model, target_ms, block_size=block_size, policy=policy,
                   num_blocks=cdiv(800, block_size) if small_pool else 100_000)
    rng = random.Random(len(arrivals))
    pending = list(arrivals)
    bound: dict[str, int] = {}  # request -> the step by which its first chunk is due (FCFS)
    first_chunk: dict[str, int] = {}
    reqs = []
    step = 0
    while pending or sim.sched.has_work():
        while pending and pending[0][0] <= 0:
            _, plen, max_tokens, streamed = pending.pop(0)
            req = sim.add(plen, max_tokens, priority=rng.randrange(3) if policy == "priority" else 0,
                          streamed=streamed)
            ahead = [r for r in reqs if r.num_output_tokens == 0 and not r.is_finished]
            bound[req.request_id] = step + sum(cdiv(r.num_tokens - r.num_computed_tokens, block_size)
                                               for r in ahead) + 1
            reqs.append(req)
        if pending:
            pending[0] = (pending[0][0] - 1, *pending[0][1:])
        out = sim.step()
        step += 1
        assert step < 20_000, "requests never finished"
        if out.budget is not None:
            decodes = shape_of([(s.start, 1) for s in out.scheduled if s.num_tokens == 1])  # (reserved first)
            chunks = [s.num_tokens for s in out.scheduled if s.num_tokens > 1]
            if chunks and model.predict(decodes) <= out.budget:
                assert model.predict(_shape(out)) <= out.budget + 1e-12 or (len(chunks) == 1
                                                                            and chunks[0] <= block_size)
        for s in out.scheduled:
            first_chunk.setdefault(s.req.request_id, step)
    assert all(r.is_finished for r in reqs)
    assert sim.kv.pool.num_free == sim.kv.num_blocks
    if policy == "fcfs" and not small_pool:  # (in a small pool a prompt also waits for blocks)
        for rid, due in bound.items():
            assert first_chunk[rid] <= due, f"{rid} got its first chunk at step {first_chunk[rid]}, due by {due}"


@settings(max_examples=60, deadline=None)
@given(ops=sched_props.ops, block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(8, 40),
       max_seqs=st.integers(1, 8), caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       c0=st.floats(0.001, 0.05), per_token=st.floats(1e-4, 0.01))
def test_time_sized_chunks_keep_the_kv_cache_right(ops, block_size, num_blocks, max_seqs, caching, policy, c0,
                                                    per_token):
    """The scheduler property test's simulated model (every KV slot read holds the request's own token; blocks
    shared only as cached prefixes; nothing leaks), with streamed requests under the automatic time budget."""
    sim = sched_props.Sim(block_size, num_blocks, 64, max_seqs, caching, policy)
    sim.sched.step_model = fake_model(c0, per_token)
    sim.sched.use_itl_budget()
    add = sim.add

    def add_streamed(*a, **kw) -> None:
        add(*a, **kw)
        for req in sim.live:
            req.streamed = True

    sim.add = add_streamed  # type: ignore[method-assign]
    sim.run(ops)


# ---------------------------------------------------------------------- the engine
def test_an_engine_under_an_unmeetable_target_streams_on_and_moves_prefill_a_block_a_step(llama_dir):
    """A real engine whose target no step can meet: while streams decode, a long prompt enters one block a step
    (and its output is what offline generation gives); the step-time model starts ready from the warm-up profile;
    /metrics reports the unmet steps, the step periods and the budget."""
    import asyncio

    from streamer import LLM, AsyncEngine

    long_prompt = " ".join(f"word{i}" for i in range(60))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline = LLM(str(llama_dir), dtype="float32").generate([long_prompt], greedy)[0].outputs[0].token_ids

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", max_itl_ms=0.001) as engine:
            core = engine.engine
            assert core.scheduler.step_model.ready and core.scheduler.itl is not None  # (the warm-up profile)
            chunks: list[int] = []
            schedule = core.scheduler.schedule

            def watched():
                out = schedule()
                decoding = any(s.req.streamed and s.req.num_output_tokens > 0 for s in out.scheduled)
                chunks.extend(s.num_tokens for s in out.scheduled
                              if s.req.request_id == "long" and s.req.num_output_tokens == 0 and decoding)
                return out

            core.scheduler.schedule = watched
            streams = [engine.stream(f"def f{i}(x):", SamplingParams(max_tokens=200, temperature=0.0,
                                                                      ignore_eos=True)) for i in range(3)]
            for s in streams:
                await s.__anext__()  # each has its first token: they decode from now on
            ids = []
            async for out in engine.stream(long_prompt, greedy, request_id="long"):
                ids += out.token_ids
            for s in streams:
                await s.aclose()
            return ids, chunks, engine.metrics.render(), core.stats()

    ids, chunks, prom, stats = asyncio.run(asyncio.wait_for(main(), 300))
    assert ids == offline
    assert len(chunks) >= 3 and all(n == 16 for n in chunks[:-1]) and 0 < chunks[-1] <= 16
    assert stats["itl_target_unmet_steps"] >= len(chunks)
    lines = dict(line.rsplit(" ", 1) for line in prom.splitlines() if line and not line.startswith("#"))
    unmet = next(v for k, v in lines.items() if k.startswith("streamer:itl_target_unmet_steps_total"))
    assert float(unmet) >= len(chunks)
    steps = next(v for k, v in lines.items() if k.startswith("streamer:step_time_seconds_count"))
    assert float(steps) > len(chunks)
    assert any(k.startswith("streamer:inter_token_stalls_total") for k in lines)
    assert any(k.startswith("streamer:step_time_prediction_error") for k in lines)


def test_stall_counter():
    from streamer.engine.metrics import StallCounter
    c = StallCounter(window=256, every=16)
    assert c.observe(1.0) == 0  # (no median yet)
    for _ in range(100):
        c.observe(0.05)
    assert c.observe(0.14) == 0
    assert c.observe(0.2, count=3) == 3
    assert c.stalls == 3

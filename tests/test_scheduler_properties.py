"""Property tests (hypothesis) for the scheduler and the KV block pool, with a simulated model.

The simulated model "writes" each scheduled token into its KV slot and then checks that every slot the
request would attend over holds the request's own token at that position: this catches blocks reused while
referenced, wrong prefix-cache hits and lost writes, not only bookkeeping slips.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer.config import EngineConfig
from streamer.core.kv_cache import KVCacheManager, cdiv
from streamer.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from streamer.core.request import Request, RequestStatus
from streamer.core.scheduler import Scheduler
from streamer.engine.lora import LoRAAdapter
from streamer.multimodal.inputs import ImageInput
from streamer.sampling_params import SamplingParams

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3),
              st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("reset")),  # reset_prefix_cache, whatever is running
), min_size=1, max_size=60)


class Sim:
    def __init__(self, block_size: int, num_blocks: int, budget: int, max_seqs: int, caching: bool,
                 policy: str, max_loras: int = 0) -> None:
        """max_loras > 0: LoRA adapters on, with that many slots for three adapters."""
        cfg = EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                           enable_prefix_caching=caching, scheduling_policy=policy, enable_lora=max_loras > 0,
                           max_loras=max(max_loras, 1))
        self.adapters = [None] + [LoRAAdapter(f"a{i}", Path("."), 1, {}) for i in range(3)]
        self.cfg = cfg
        self.kv = KVCacheManager(num_blocks, block_size, caching, kv_events=True)
        self.sched = Scheduler(cfg, self.kv, max_model_len=10_000)
        self.mirror: set[bytes] = set()  # the cache's contents as a router rebuilds them from its KV events
        self.slots: dict[int, int] = {}
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.rng = random.Random(0)
        self.n = 0
        self.owners_at_reset: dict[int, set[str]] = {}  # blocks in use at a reset_prefix_cache: their owners then

    def add(self, prompt_len: int, max_tokens: int, prefix: int, prio: int, lora: int = 0,
            image: Optional[tuple[int, int, int]] = None) -> None:
        """image: (offset, length, which of three images) of an image attending to itself both ways (Gemma 3's),
        which no chunk may end inside."""
        bs = self.cfg.block_size
        if cdiv(prompt_len + max_tokens, bs) > self.kv.num_blocks:
            return  # the engine rejects these up front
        # A few shared prefixes so that the prefix cache gets hits (and partial-block hits).
        shared = [prefix * 1000 + i for i in range(min(prompt_len, (prefix + 1) * 5))]
        prompt = shared + [self.rng.randrange(50_000) for _ in range(prompt_len - len(shared))]
        adapter = self.adapters[lora] if self.cfg.enable_lora else None
        images: tuple = ()
        if image is not None and image[0] + image[1] <= prompt_len:
            offset, length, kind = image
            prompt[offset:offset + length] = [7] * length  # (the image token)
            images = (ImageInput(offset, length, torch.zeros(1), bytes([kind]) * 16),)
        req = Request(f"r{self.n}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, block_size=bs,
                      hash_blocks=self.cfg.enable_prefix_caching, priority=prio, lora=adapter, images=images,
                      whole_images=bool(images))
        self.n += 1
        self.sched.add(req)
        self.live.append(req)

    def abort(self, k: int) -> None:
        if self.live:
            req = self.live.pop(k % len(self.live))
            self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
            self.finished.append(req)

    def step(self) -> None:
        out = self.sched.schedule()
        assert out.num_tokens <= self.cfg.max_num_batched_tokens
        assert len(out.scheduled) <= self.cfg.max_num_seqs
        assert len(self.sched.running) <= self.cfg.max_num_seqs
        assert len({id(s.req) for s in out.scheduled}) == len(out.scheduled)
        bs = self.cfg.block_size
        for s in out.scheduled:
            blocks = self.kv.blocks_of(s.req.request_id)
            assert len(blocks) * bs >= s.start + s.num_tokens
            end = s.start + s.num_tokens
            assert not any(im.offset < end < im.end for im in s.req.images), "a chunk ends inside a whole image"
            for pos in range(s.start, s.start + s.num_tokens):  # (KV depends on the adapter too)
                self.slots[blocks[pos // bs] * bs + pos % bs] = (s.req.all_token_ids[pos], id(s.req.lora))
        for s in out.scheduled:  # "attention": every context slot holds this request's token
            blocks = self.kv.blocks_of(s.req.request_id)
            for pos in range(s.start + s.num_tokens):
                assert self.slots.get(blocks[pos // bs] * bs + pos % bs) == (s.req.all_token_ids[pos], id(s.req.lora)), \
                    f"{s.req.request_id} reads a wrong KV entry at position {pos}"
        for s in out.scheduled:
            if s.samples:
                req = s.req
                req.append_token(self.rng.randrange(50_000))
                if req.num_output_tokens >= req.max_tokens:
                    self.sched.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.live.remove(req)
                    self.finished.append(req)
        self.sched.check_invariants()
        self.check_events()
        self.check_lora(out)
        shared = {}
        for rid, blocks in self.kv.req_blocks.items():
            for b in blocks:
                shared.setdefault(b, []).append(rid)
        for b, owners in shared.items():
            if len(owners) > 1 and self.kv.pool.block_hash[b] is None:  # (a reset unhashes blocks shared then)
                assert set(owners) <= self.owners_at_reset.get(b, set()), \
                    "a block is shared without being a cached prefix"

    def check_events(self) -> None:
        """Replaying the KV events (BlockStored / BlockRemoved / AllBlocksCleared) gives exactly the hashes the
        prefix cache can find now."""
        for e in self.kv.take_events():
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                assert not self.mirror & set(e.block_hashes), "a block stored twice without its removal"
                self.mirror.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.mirror, "a block removed that was never stored"
                self.mirror.difference_update(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.mirror.clear()
        assert self.mirror == set(self.kv.pool.cached), "the KV events disagree with the prefix cache"

    def check_lora(self, out) -> None:
        """Every running request with an adapter holds a slot with that adapter in it; slot users add up."""
        slots = self.sched.lora_slots
        if slots is None:
            return
        users = [0] * (slots.n + 1)
        for req in self.sched.running:
            assert (req.lora_slot > 0) == (req.lora is not None)
            if req.lora is not None:
                assert slots.adapter_in[req.lora_slot] is req.lora, "a request runs without its adapter loaded"
                users[req.lora_slot] += 1
        assert users[1:] == slots.users[1:]
        assert len({id(r.lora) for r in self.sched.running if r.lora is not None}) <= slots.n
        for req in self.sched.waiting:
            assert req.lora_slot == 0

    def run(self, ops: list[tuple]) -> None:
        """Replay `ops` (add / step / abort), then run every request to its end."""
        for op in ops:
            if op[0] == "add":
                self.add(*op[1:])
            elif op[0] == "step":
                self.step()
            elif op[0] == "reset":
                self.reset()
            else:
                self.abort(op[1])
        self.drain()

    def reset(self) -> None:
        """reset_prefix_cache between two steps: nothing cached is found afterwards (the requests' own blocks are
        still theirs; the attention check in `step` catches any wrong reuse)."""
        self.owners_at_reset = {}
        for rid, blocks in self.kv.req_blocks.items():
            for b in blocks:
                self.owners_at_reset.setdefault(b, set()).add(rid)
        self.kv.reset_prefix_cache()
        self.check_events()
        assert not self.kv.pool.cached and all(h is None for h in self.kv.pool.block_hash)
        if self.kv.checkpoints is not None:
            assert not self.kv.checkpoints.lru
        self.kv.check_consistency()

    def drain(self) -> None:
        for _ in range(5000):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work(), "requests never finished"
        assert not self.live
        assert self.kv.pool.num_free == self.kv.num_blocks, "blocks leaked"
        assert all(r.is_finished for r in self.finished)
        if self.sched.lora_slots is not None:
            assert sum(self.sched.lora_slots.users) == 0, "LoRA slots leaked"


@settings(max_examples=120, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(4, 40),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), max_loras=st.sampled_from([0, 0, 1, 2]))
def test_random_interleavings(ops, block_size, num_blocks, budget, max_seqs, caching, policy, max_loras):
    Sim(block_size, num_blocks, budget, max_seqs, caching, policy, max_loras).run(ops)


image_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(2, 40), st.integers(1, 8), st.integers(0, 2), st.integers(0, 30),
              st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
), min_size=1, max_size=50)


@settings(max_examples=80, deadline=None)
@given(ops=image_ops, block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(8, 40),
       budget=st.integers(12, 48), max_seqs=st.integers(1, 6), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_whole_images_are_never_split(ops, block_size, num_blocks, budget, max_seqs, caching, policy):
    """Images that attend to themselves both ways (no longer than the step budget, as the engine checks): no chunk
    ends inside one, whatever the prefix-cache hits (the same three images recur), preemptions and aborts; every
    request still finishes and nothing leaks."""
    sim = Sim(block_size, num_blocks, budget, max_seqs, caching, policy)
    for op in ops:
        if op[0] == "add":
            prompt_len, max_tokens, prefix, offset, length, kind = op[1:]
            sim.add(prompt_len, max_tokens, prefix, 0, image=(offset, length, kind))
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1])
    sim.drain()


class EncoderSim(Sim):
    """An encoder's requests (LLMEngine with a bidirectional model): pooling, prompts computed whole, no prefix
    caching; a request ends once its prompt is computed, as the engine finishes it with its embedding."""

    def add_encoder(self, prompt_len: int, prio: int) -> None:
        from streamer.engine.pooling import PoolingParams
        if cdiv(prompt_len, self.cfg.block_size) > self.kv.num_blocks:
            return  # (refused by LLMEngine.validate)
        req = Request(f"r{self.n}", [self.rng.randrange(50_000) for _ in range(prompt_len)], SamplingParams(), 0,
                      block_size=self.cfg.block_size, hash_blocks=False, priority=prio,
                      pooling=PoolingParams(), whole_prompt=True)
        self.n += 1
        self.sched.add(req)
        self.live.append(req)

    def step(self) -> None:
        before = {id(r): r.num_computed_tokens for r in self.live}
        super().step()
        for req in list(self.live):
            if req.num_computed_tokens != before.get(id(req), 0):
                assert before.get(id(req), 0) == 0 and req.num_computed_tokens == req.num_tokens, \
                    "an encoder's prompt was computed in pieces"
            if req.status == RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens:
                self.sched.finish(req, RequestStatus.FINISHED_STOPPED)
                self.live.remove(req)
                self.finished.append(req)


encoder_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 3)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(ops=encoder_ops, block_size=st.sampled_from([1, 2, 4, 16]), num_blocks=st.integers(3, 40),
       budget=st.integers(40, 64), max_seqs=st.integers(1, 8), policy=st.sampled_from(["fcfs", "priority"]))
def test_encoder_prompts_are_computed_whole(ops, block_size, num_blocks, budget, max_seqs, policy):
    """Encoder requests (a budget of at least the longest prompt, as the engine sets it): each prompt is computed in
    one chunk from position 0, whatever the pool's size, priorities, preemptions and aborts; every request still
    finishes and nothing leaks."""
    sim = EncoderSim(block_size, num_blocks, budget, max_seqs, False, policy)
    for op in ops:
        if op[0] == "add":
            sim.add_encoder(*op[1:])
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1])
    sim.drain()


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    sim = Sim(block_size=4, num_blocks=32, budget=100, max_seqs=4, caching=True, policy="fcfs")
    prompt = list(range(100, 112))  # exactly 3 blocks
    for i in range(2):
        req = Request(f"p{i}", prompt, SamplingParams(max_tokens=5), 5, block_size=4)
        sim.sched.add(req)
        sim.live.append(req)
        sim.step()
    a, b = sim.live
    # The second request hits the first two blocks; the third is recomputed to have logits to sample from.
    assert b.num_cached_tokens == 8
    assert sim.kv.blocks_of("p1")[:2] == sim.kv.blocks_of("p0")[:2]
    sim.drain()


def test_salt_isolates_prefix_cache():
    sim = Sim(block_size=4, num_blocks=32, budget=100, max_seqs=4, caching=True, policy="fcfs")
    prompt = list(range(100, 112))
    for i, salt in enumerate(["a", "b", "a"]):
        req = Request(f"s{i}", prompt, SamplingParams(max_tokens=5), 5, block_size=4, cache_salt=salt)
        sim.sched.add(req)
        sim.live.append(req)
        sim.step()
    assert [r.num_cached_tokens for r in sim.live] == [0, 0, 8]
    sim.drain()


def test_lora_adapter_isolates_prefix_cache_and_waits_for_a_slot():
    sim = Sim(block_size=4, num_blocks=32, budget=100, max_seqs=4, caching=True, policy="fcfs", max_loras=1)
    for lora in (1, 2, 1, 0):  # a1 runs; a2 waits for the one slot (a1 holds it), and the second a1 and the
        sim.add(12, 5, 1, 0, lora)  # base request pass it; the second a1 hits the first one's blocks
    sim.step()
    a1, a2, a1_again, base = sim.live
    assert [r.status.value for r in sim.live] == ["running", "waiting", "running", "running"]
    assert [a1.num_cached_tokens, a1_again.num_cached_tokens, base.num_cached_tokens] == [0, 8, 0]
    assert sim.sched.waiting.peek() is a2
    sim.drain()
    assert a2.num_cached_tokens == 0

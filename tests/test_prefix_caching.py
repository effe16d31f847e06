"""Prefix caching gives the same greedy tokens as no caching, in every way a hit can happen."""
from __future__ import annotations

import random

import pytest

from streamer import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BS = 8


def _rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def cold(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", block_size=BS, enable_prefix_caching=False)


@pytest.fixture()
def warm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", block_size=BS)


def _ids(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_hits_match_misses(cold, warm):
    shared = _rand(3 * BS, seed=1)
    prompts = [
        shared,  # the whole prompt cached next time: only the last block's tail is recomputed
        shared + _rand(1, 2),  # hit ends exactly on a block boundary, one new token
        shared + _rand(5, 3),  # prompt ending mid-block
        shared[:2 * BS + 3] + _rand(9, 4),  # diverges mid-block: only whole blocks are shared
    ]
    ref, _ = _ids(cold, prompts)
    _ids(warm, [shared])  # fill the cache
    got, cached = _ids(warm, prompts)
    assert got == ref
    assert cached == [2 * BS, 3 * BS, 3 * BS, 2 * BS]
    again, cached_again = _ids(warm, prompts)
    assert again == ref and min(cached_again) >= 2 * BS


def test_shared_prefix_in_one_step(cold, warm):
    shared = _rand(4 * BS, seed=5)
    prompts = [shared + _rand(3, 10 + i) for i in range(6)]
    ref, _ = _ids(cold, prompts)
    got, cached = _ids(warm, prompts)  # all admitted in the same step
    assert got == ref
    assert cached[0] == 0 and all(c == 4 * BS for c in cached[1:]), cached


def test_n_shares_prompt_blocks(cold, warm):
    p = SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = _rand(3 * BS + 2, seed=7)
    ref = cold.generate([{"prompt_token_ids": prompt}], p)[0]
    got = warm.generate([{"prompt_token_ids": prompt}], p)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in ref.outputs]


def test_eviction_and_preemption_under_pressure(llama_dir, cold):
    # 10 blocks for prompts of up to 5 blocks each: hits, evictions and preemption all happen.
    llm = LLM(str(llama_dir), dtype="float32", block_size=BS, num_kv_blocks=10, max_num_batched_tokens=16)
    shared = _rand(2 * BS, seed=8)
    prompts = [shared + _rand(random.Random(i).randrange(1, 2 * BS), 20 + i) for i in range(10)]
    ref, _ = _ids(cold, prompts)
    got, cached = _ids(llm, prompts)
    assert got == ref
    e = llm.engine
    assert e.scheduler.num_preemptions > 0 and e.kv.pool.num_evictions > 0
    assert e.kv.pool.num_free == e.kv.num_blocks
    e.scheduler.check_invariants()


def test_preempted_request_resumes_from_its_own_blocks(llama_dir, cold):
    llm = LLM(str(llama_dir), dtype="float32", block_size=BS, num_kv_blocks=7)
    prompts = [_rand(2 * BS + 1, seed=30 + i) for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref, _ = _ids(cold, prompts, params)
    hits_before = llm.engine.kv.prefix_hits
    got, _ = _ids(llm, prompts, params)
    assert got == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.prefix_hits > hits_before  # a resumed request found its own cached blocks


def test_cache_salt_isolates(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", block_size=BS)
    prompt = _rand(3 * BS, seed=9)
    eng = llm.engine
    for salt, expect in [("tenant-a", 0), ("tenant-b", 0), ("tenant-a", 2 * BS), (None, 0), (None, 2 * BS)]:
        (state,) = eng.add_request(None, prompt, GREEDY.clone(max_tokens=2), cache_salt=salt,
                                   prompt_token_ids=prompt)
        while eng.has_unfinished():
            eng.step()
        assert state.req.num_cached_tokens == expect, (salt, expect)


def test_reset_prefix_cache_forgets_everything_while_requests_run(cold, llama_dir):
    """reset_prefix_cache between steps: later prompts find nothing (also none of a running request's blocks),
    the running request goes on to the same output, nothing leaks."""
    llm = LLM(str(llama_dir), dtype="float32", block_size=BS)
    eng = llm.engine
    a, b = _rand(4 * BS, seed=11), _rand(3 * BS, seed=12)
    ref, _ = _ids(cold, [a, b])
    assert _ids(llm, [a]) == ([ref[0]], [0])
    assert _ids(llm, [a]) == ([ref[0]], [3 * BS])
    (running,) = eng.add_request(None, b, GREEDY, prompt_token_ids=b)
    for _ in range(3):
        eng.step()
    assert llm.reset_prefix_cache() >= 4 + 3  # a's blocks, and the running b's prompt blocks
    assert eng.kv.pool.cached == {}
    (again,) = eng.add_request(None, b, GREEDY, prompt_token_ids=b)  # b's own blocks are no longer findable
    while eng.has_unfinished():
        eng.step()
    assert running.req.output_token_ids == again.req.output_token_ids == ref[1]
    assert again.req.num_cached_tokens == 0
    assert _ids(llm, [a]) == ([ref[0]], [0])
    assert _ids(llm, [a]) == ([ref[0]], [3 * BS])  # caching goes on after a reset
    eng.kv.check_consistency()
    assert eng.kv.pool.num_free == eng.kv.num_blocks

"""Async scheduling: step N+1 is scheduled while step N runs, and reads step N's tokens on the device.

The outputs must be exactly those of the synchronous loop, for a mix that exercises what a token in flight can
change: stops (stop token ids, min_tokens), length limits, seeded sampling, logprobs, n > 1, penalties (whose
steps must not overlap), chunked prefill and preemption by recompute in a small KV pool. Nothing may leak.
"""
from __future__ import annotations

import asyncio

import pytest

from streamer import LLM, AsyncEngine, SamplingParams

PROMPTS = [f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(10)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _workload(llama_dir) -> list[tuple[str, SamplingParams]]:
    # Stop token ids taken from a reference run, so that stops really happen mid-stream.
    ref = LLM(str(llama_dir), dtype="float32").generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    stop_at = [r.outputs[0].token_ids[3 + i % 5] for i, r in enumerate(ref)]
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at[0]]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at[3]], min_tokens=6),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at[8]]),
        SamplingParams(max_tokens=13, temperature=0.7, top_p=0.8, seed=11, ignore_eos=True),
    ]
    return list(zip(PROMPTS, params))


async def _serve_all(llama_dir, work, async_scheduling: bool):
    async with AsyncEngine(str(llama_dir), dtype="float32", async_scheduling=async_scheduling,
                           max_num_batched_tokens=24, num_kv_blocks=14, block_size=4) as engine:
        outs = await asyncio.gather(*[engine.generate(p, sp) for p, sp in work])
        core = engine.engine
        core.batch.sync(core.kv)
        assert core.kv.pool.num_free == core.kv.num_blocks and len(core.batch) == 0 and not core.seqs
        return outs, engine.num_overlapped_steps, core.scheduler.num_preemptions


def test_async_scheduling_matches_synchronous(llama_dir):
    work = _workload(llama_dir)
    sync_outs, sync_overlaps, _ = run(_serve_all(llama_dir, work, False))
    async_outs, async_overlaps, preemptions = run(_serve_all(llama_dir, work, True))
    assert sync_overlaps == 0 and async_overlaps > 10
    assert preemptions > 0  # the small pool made the scheduler preempt (with tokens in flight)
    finish = set()
    for (prompt, sp), a, s in zip(work, async_outs, sync_outs):
        assert len(a.outputs) == sp.n
        for x, y in zip(a.outputs, s.outputs):
            assert x.token_ids == y.token_ids, prompt
            assert x.text == y.text
            assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
            assert len(x.token_ids) <= sp.max_tokens
            finish.add(x.finish_reason)
            if sp.logprobs is not None:
                assert [list(e) for e in x.logprobs] == [list(e) for e in y.logprobs]
                for e, f in zip(x.logprobs, y.logprobs):
                    for t in e:
                        assert e[t].logprob == pytest.approx(f[t].logprob, abs=1e-4)
    assert finish == {"stop", "length"}


@pytest.mark.parametrize("host_state", [{"frequency_penalty": 1.0}, {"bad_words": ["abc def"]}],
                         ids=["penalties", "bad_words"])
def test_penalty_steps_do_not_overlap(llama_dir, host_state):
    """A running request with penalties (or bad_words) makes the loop wait for each step's tokens before the
    next: the next step's penalties (bans) are built from them."""
    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", async_scheduling=True) as engine:
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **host_state)
            out = await engine.generate(PROMPTS[0], sp)
            assert len(out.outputs[0].token_ids) == 8
            assert engine.num_overlapped_steps == 0
            await engine.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            assert engine.num_overlapped_steps > 0
            return out

    out = run(main())
    ref = LLM(str(llama_dir), dtype="float32").generate(
        PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **host_state))
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_offline_generate_overlaps_and_matches(llama_dir):
    """`LLM.generate` runs the same pipeline on a worker thread."""
    work = _workload(llama_dir)
    outs = {}
    for mode in (False, True):
        llm = LLM(str(llama_dir), dtype="float32", async_scheduling=mode, max_num_batched_tokens=24,
                  num_kv_blocks=14, block_size=4)
        outs[mode] = [[o.token_ids for o in r.outputs]
                      for r in llm.generate([p for p, _ in work], [sp for _, sp in work])]
        assert (llm.engine.num_overlapped_steps > 0) == mode
        assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks and not llm.engine.seqs
    assert outs[True] == outs[False]


def test_aborts_with_steps_in_flight_leak_nothing(llama_dir):
    """Requests that leave early (break, cancel) while their next step is already queued free everything, and
    the others' outputs are unaffected."""
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def main():
        async with AsyncEngine(str(llama_dir), dtype="float32", async_scheduling=True) as engine:
            async def leave_after(prompt, k):
                got = 0
                async for out in engine.stream(prompt, long):
                    got += len(out.token_ids)
                    if got >= k:
                        break
                return got

            async def full(prompt):
                return (await engine.generate(prompt, long)).outputs[0].token_ids

            results = await asyncio.gather(*[leave_after(p, k) for p, k in zip(PROMPTS[:5], (1, 2, 3, 5, 8))],
                                           *[full(p) for p in PROMPTS[5:8]])
            core = engine.engine
            await asyncio.sleep(0.05)
            core.batch.sync(core.kv)
            assert core.kv.pool.num_free == core.kv.num_blocks and len(core.batch) == 0 and not core.seqs
            assert core.num_overlapped_steps > 0
            return results[5:]

    outs = run(main())
    ref = LLM(str(llama_dir), dtype="float32").generate(PROMPTS[5:8], long)
    assert outs == [r.outputs[0].token_ids for r in ref]

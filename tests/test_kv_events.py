"""KV cache events from a running engine: what a request's prompt stored, in order, and nothing when off."""
from __future__ import annotations

import asyncio

from streamer import SamplingParams
from streamer.core.kv_events import AllBlocksCleared, BlockStored
from streamer.engine.async_engine import AsyncEngine


def _run(llama_dir, **kw):
    async def go():
        async with AsyncEngine(str(llama_dir), dtype="float32", block_size=16, **kw) as engine:
            seen: list = []
            engine.kv_event_sinks.append(seen.extend)
            ids = list(range(10, 10 + 70))  # 4 full blocks of prompt
            await engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0))
            await engine.reset_prefix_cache()
            await engine.generate({"prompt_token_ids": ids[:20]}, SamplingParams(max_tokens=1, temperature=0))
            return ids, seen
    return asyncio.run(go())


def test_events_follow_a_request(llama_dir):
    ids, seen = _run(llama_dir, kv_events=True)
    cleared = [i for i, e in enumerate(seen) if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 1, "the reset was not published once"
    before = [e for e in seen[:cleared[0]] if isinstance(e, BlockStored)]
    tokens = [t for e in before for t in e.token_ids]
    assert tokens[:64] == ids[:64], "the stored blocks are not the prompt's, in order"
    assert before[0].parent_block_hash is None and before[0].block_size == 16
    chain = [h for e in before for h in e.block_hashes]
    assert len(set(chain)) == len(chain) >= 4
    for prev, e in zip(before, before[1:]):  # each run continues the chain
        assert e.parent_block_hash == prev.block_hashes[-1]
    # after the reset the 20-token prompt stores its first block again: the same hash as before
    after = [e for e in seen[cleared[0]:] if isinstance(e, BlockStored)]
    assert after and after[0].block_hashes[0] == chain[0]


def test_no_events_unless_asked(llama_dir):
    _, seen = _run(llama_dir)
    assert seen == []

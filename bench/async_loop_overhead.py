"""The AsyncEngine step loop on the tiny embedded demo model, where the loop's own cost is the largest share of a
step: one streamed request x 512 tokens, eager, 4 timed rounds after a warm-up; prints the median tokens/s.
Compare two trees side by side by alternating runs:

    for t in /path/to/before /path/to/after; do PYTHONPATH=$t python bench/async_loop_overhead.py; done
"""
import asyncio
import json
import statistics
import time

from streamer import AsyncEngine, SamplingParams


async def one(engine, prompt, params):
    n = 0
    async for out in engine.stream({"prompt_token_ids": prompt}, params):
        n += len(out.token_ids)
    return n

async def main():
    async with AsyncEngine(None, enforce_eager=True) as engine:
        p = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
        await one(engine, list(range(5, 21)), p)
        rates = []
        for _ in range(4):
            t = time.perf_counter()
            n = await one(engine, list(range(5, 21)), p)
            rates.append(n / (time.perf_counter() - t))
        print(json.dumps({"stream_median": statistics.median(rates), "all": [round(r) for r in rates]}))

asyncio.run(main())

"""Output delivery on the event loop: N concurrent requests through AsyncEngine, streamed (`engine.stream`, one
output per token, as an SSE response consumes them), streamed with `stream_interval` K (the first token, then K
at a time), and non-streamed (`engine.generate`, one output per sequence when it finishes, as a non-streamed HTTP
response needs them), with the model replaced by an instant stub (bench/host_overhead.py's), so that what is timed
is the engine's host work plus delivery.

    python bench/delivery_overhead.py [--sizes 64,256] [--tokens 64] [--interval 4] [--repeat 3]

All three run in one process (two engines), alternating; prints wall milliseconds per engine step (median of
the repeats) and each one's ratio to plain streaming.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch
from host_overhead import stub_model  # bench/


async def _once(engine, n: int, tokens: int, streamed: bool, seed: int) -> float:
    from streamer import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    vocab = engine.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(16)]} for _ in range(n)]

    async def consume(prompt) -> int:
        if streamed:
            got = 0
            async for out in engine.stream(prompt, params):
                got += len(out.token_ids)
            return got
        return len((await engine.generate(prompt, params)).outputs[0].token_ids)

    steps = engine.engine.num_steps
    t = time.perf_counter()
    got = await asyncio.gather(*(consume(p) for p in prompts))
    elapsed = time.perf_counter() - t
    assert got == [tokens] * n
    return elapsed * 1000 / (engine.engine.num_steps - steps)


async def main_async(args) -> None:
    from streamer import AsyncEngine
    sizes = [int(x) for x in args.sizes.split(",")]
    top = max(sizes)
    kw = dict(dtype="float32", load_format="dummy", max_num_seqs=top, max_num_batched_tokens=max(8192, top * 16),
              num_kv_blocks=top * 8 + 64)
    async with AsyncEngine(None, **kw) as every, AsyncEngine(None, stream_interval=args.interval, **kw) as spaced:
        for engine in (every, spaced):
            stub_model(engine.engine.runner)
            await _once(engine, 8, 4, True, 0)  # warm-up
        ways = {"streamed": (every, True), f"interval {args.interval}": (spaced, True),
                "non-streamed": (every, False)}
        print(f"{'running':>8}" + "".join(f" {name + ' ms/step':>22}" for name in ways) +
              "".join(f" {'x ' + name:>16}" for name in list(ways)[1:]))
        for n in sizes:
            ms: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.repeat):
                for name, (engine, streamed) in ways.items():
                    ms[name].append(await _once(engine, n, args.tokens, streamed, r))
            med = {name: statistics.median(v) for name, v in ms.items()}
            base = med["streamed"]
            print(f"{n:>8}" + "".join(f" {v:>22.3f}" for v in med.values()) +
                  "".join(f" {base / med[name]:>16.2f}" for name in list(ways)[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--interval", type=int, default=4, help="the second engine's stream_interval")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

"""Async scheduling on vs off, side by side on one AsyncEngine (issue 8): output tokens/s through `engine.stream`.

    python bench/async_scheduling.py [--model DIR] [--compile] [--rounds 3] [--threads N]

Default model: bench/make_bench_model.py's ~90M bf16 Llama (built if missing). Two workloads, each run in
alternating rounds with `async_scheduling` on and off on the same engine (the flag is read per step, so both
modes share weights, compiled graphs and warm caches):
  stream: one request generating --stream-len tokens;
  batch:  --num-prompts concurrent streamed requests, --input-len prompt tokens, --output-len tokens each.
Greedy, EOS ignored. Prints the median tokens/s per mode and the ratio on/off, and checks that both modes produced
the same tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path.home() / ".cache" / "streamer-bench" / "llama-90m"


async def _one(engine, prompt: list[int], params) -> list[int]:
    ids: list[int] = []
    async for out in engine.stream({"prompt_token_ids": prompt}, params):
        ids += out.token_ids
    return ids


async def _timed(engine, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = await asyncio.gather(*[_one(engine, p, params) for p in prompts])
    return sum(map(len, outs)) / (time.perf_counter() - t), outs


async def run(args) -> None:
    import torch

    from streamer import AsyncEngine, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    engine = AsyncEngine(str(args.model), dtype="bfloat16", enforce_eager=not args.compile,
                         kv_cache_memory=4 << 30, max_model_len=2048)
    await engine.start()
    vocab = engine.engine.vocab_size
    batch = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    workloads = {
        "stream": ([batch[0]], SamplingParams(max_tokens=args.stream_len, temperature=0.0, ignore_eos=True)),
        "batch": (batch, SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)),
    }
    await _timed(engine, [batch[0][:32]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm
    rows = []
    for name, (prompts, params) in workloads.items():
        rates: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[list[int]]] = {}
        for r in range(args.rounds):
            for mode in ((True, False) if r % 2 == 0 else (False, True)):
                engine.engine.async_scheduling = mode
                before = engine.num_overlapped_steps
                engine.engine.kv.pool.reset_prefix_cache()  # every round prefills the same way
                rate, outs = await _timed(engine, prompts, params)
                assert (engine.num_overlapped_steps > before) == mode
                rates[mode].append(rate)
                tokens[mode] = outs
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        same = tokens[True] == tokens[False]
        rows.append((name, off, on, on / off, same))
        print(f"  {name}: off {['%.1f' % x for x in rates[False]]} on {['%.1f' % x for x in rates[True]]}",
              flush=True)
    await engine.stop()
    print(f"\n{'workload':<10} {'sync tok/s':>11} {'async tok/s':>12} {'async/sync':>11} {'same tokens':>12}")
    for name, off, on, ratio, same in rows:
        print(f"{name:<10} {off:>11.1f} {on:>12.1f} {ratio:>10.3f}x {str(same):>12}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (as `streamer serve` does)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--stream-len", type=int, default=256)
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_bench_model.py"), "--out", str(args.model)], check=True)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

"""Prefix caching on vs off, side by side in one run (in-process AsyncEngine, all requests submitted at once).

    python bench/prefix_caching.py [--model DIR] [--num-requests 64] [--prefix-len 1024] [--suffix-len 64]
                                   [--output-len 64]

Workload A (shared): every request = one shared system prompt of --prefix-len tokens + its own --suffix-len
tokens. Workload B (distinct): prompts of the same total length with no shared prefix, to measure what
caching costs when it cannot help. Workload C (next turn): conversations' second turns, each its first turn (a
distinct prompt of that length, answered first, untimed) + the answer + a new --suffix-len-token message.
Prints median TTFT and output throughput for each, and the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import torch


async def run_workload(engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from streamer import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    cached = 0

    async def one(p: list[int]) -> list[int]:
        nonlocal cached
        t0 = time.perf_counter()
        tokens: list[int] = []
        async for out in engine.stream({"prompt_token_ids": p}, params):
            if not tokens and out.token_ids:
                ttfts.append(time.perf_counter() - t0)
            tokens += out.token_ids
            if out.usage:
                cached += out.usage["prompt_tokens_details"]["cached_tokens"]
        return tokens

    t = time.perf_counter()
    answers = await asyncio.gather(*[one(p) for p in prompts])
    wall = time.perf_counter() - t
    return {"median_ttft": statistics.median(ttfts), "out_tps": sum(map(len, answers)) / wall, "wall": wall,
            "cached": cached, "answers": answers}


async def measure(model, caching: bool, workloads: dict[str, list[list[int]]],
                  turns: list[tuple[list[int], list[int]]], output_len: int,
                  engine_args: dict) -> dict[str, dict[str, float]]:
    from streamer import AsyncEngine
    async with AsyncEngine(model, enable_prefix_caching=caching, **engine_args) as engine:
        warm = [[7] * 8]
        await run_workload(engine, warm, 2)
        res = {name: await run_workload(engine, ps, output_len) for name, ps in workloads.items()}
        firsts = await run_workload(engine, [first for first, _ in turns], output_len)
        res["next turn"] = await run_workload(engine, [first + answer + new for (first, new), answer in
                                                       zip(turns, firsts["answers"])], output_len)
        for r in res.values():
            del r["answers"]
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded demo model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--dummy", action="store_true", help="random weights (the folder needs only config.json)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of (caching on, caching off), alternating; the table shows per-round medians")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from streamer.config import EngineConfig
    from streamer.engine.llm_engine import resolve_model_dir
    from streamer.models.config import ModelConfig
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    rng = random.Random(args.seed)
    rand = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    system = rand(args.prefix_len)
    total = args.prefix_len + args.suffix_len
    workloads = {"shared prefix": [system + rand(args.suffix_len) for _ in range(args.num_requests)],
                 "no shared prefix": [rand(total) for _ in range(args.num_requests)]}
    turns = [(rand(total), rand(args.suffix_len)) for _ in range(args.num_requests)]
    engine_args = dict(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs,
                       max_model_len=max(2048, total + args.output_len + 1),
                       load_format="dummy" if args.dummy else "auto")
    EngineConfig(**engine_args)  # validate before the long runs
    rounds: dict[bool, list[dict[str, dict[str, float]]]] = {True: [], False: []}
    for i in range(args.repeat):  # alternating on/off, so slow drifts in machine load hit both alike
        for on in (True, False):
            rounds[on].append(asyncio.run(measure(args.model, on, workloads, turns, args.output_len, engine_args)))
            r = rounds[on][-1]
            print(f"round {i + 1} caching {'on' if on else 'off'}: " + ", ".join(
                f"{name}: TTFT {v['median_ttft']:.3f} s, {v['out_tps']:.1f} tok/s" for name, v in r.items()),
                flush=True)
    res = {on: {name: {key: statistics.median(r[name][key] for r in rounds[on]) for key in rounds[on][0][name]}
                for name in rounds[on][0]} for on in (True, False)}
    print(f"\n{args.num_requests} requests, prefix {args.prefix_len} + suffix {args.suffix_len} tokens, "
          f"{args.output_len} output tokens, model {args.model or 'demo'}, {args.dtype}")
    print(f"{args.repeat} round(s), medians")
    print(f"{'workload':<18} {'caching':<8} {'median TTFT s':>14} {'out tok/s':>10} {'cached tokens':>14}")
    for name in res[True]:
        for on in (True, False):
            r = res[on][name]
            print(f"{name:<18} {'on' if on else 'off':<8} {r['median_ttft']:>14.3f} {r['out_tps']:>10.1f} "
                  f"{r['cached']:>14.0f}")
    s_on, s_off = res[True]["shared prefix"], res[False]["shared prefix"]
    d_on, d_off = res[True]["no shared prefix"], res[False]["no shared prefix"]
    print(f"\nshared prefix: median TTFT off/on = {s_off['median_ttft'] / s_on['median_ttft']:.2f}x, "
          f"throughput on/off = {s_on['out_tps'] / s_off['out_tps']:.2f}x")
    print(f"no shared prefix: throughput on/off = {d_on['out_tps'] / d_off['out_tps']:.3f}x "
          f"(caching overhead {100 * (1 - d_on['out_tps'] / d_off['out_tps']):+.1f}%)")
    t_on, t_off = res[True]["next turn"], res[False]["next turn"]
    print(f"next turn: median TTFT off/on = {t_off['median_ttft'] / t_on['median_ttft']:.2f}x, "
          f"throughput on/off = {t_on['out_tps'] / t_off['out_tps']:.2f}x")


if __name__ == "__main__":
    main()

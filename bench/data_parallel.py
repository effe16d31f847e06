"""Data parallelism (streamer/engine/data_parallel.py): throughput, cache-aware routing, hot-prefix balance, router
overhead. On the demo model (its max_position_embeddings raised to 2048 for the 1,024-token prefixes), CPU.

    python bench/data_parallel.py [--section all|throughput|prefix|hot|overhead]

1. throughput: offline LLM.generate of --num-prompts prompts, DP=1 on one core (one thread), DP=2 (one core and
   one thread each), DP=1 on both cores (two threads). Each case runs in its own process, pinned; besides the wall
   clock, the CPU seconds the process tree spent per 1,000 output tokens (robust to other load on the machine).
2. prefix: 8 shared prefixes of 1,024 tokens (+ a 32-token suffix each request, 8 output tokens), KV sized for ~5
   prefixes per replica, DP=2, closed loop of 8 concurrent requests; cache_aware vs round_robin: prefix hit rate
   (cached prompt tokens / prompt tokens) and TTFT p50.
3. hot: one prefix takes 80% of the traffic (closed loop of 16); the replicas' in-flight counts sampled every 10 ms.
4. overhead: TTFT p50 of sequential short requests (1 output token), AsyncEngine in process vs the same engine
   behind the router (DataParallelEngine with one replica: the router, the hop and the replica's process).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

OVERRIDES = {"max_position_embeddings": 2048}
BASE = dict(dtype="float32", hf_overrides=OVERRIDES, enforce_eager=True)


# ---------------------------------------------------------------------------------------------------- 1
def throughput_case(dp: int, cores: int, num_prompts: int, output_len: int, prompt_len: int) -> dict:
    os.sched_setaffinity(0, list(range(cores)))
    import torch
    torch.set_num_threads(cores)
    from streamer import LLM, SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(prompt_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm = LLM(None, data_parallel_size=dp, max_num_seqs=256, **BASE)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=4))  # warm-up
        cpu0 = _tree_cpu()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        dt = time.perf_counter() - t0
        cpu = _tree_cpu() - cpu0
    finally:
        llm.close()
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"dp": dp, "cores": cores, "seconds": dt, "output_tok_s": toks / dt, "cpu_s_per_1k": cpu / toks * 1e3}


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every process under it (the replicas): unlike the wall
    clock, not inflated by other load on the machine."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def throughput(args) -> None:
    rows = []
    for dp, cores in ((1, 1), (2, 2), (1, 2)):
        out = subprocess.run([sys.executable, __file__, "--case", json.dumps([dp, cores]), "--num-prompts",
                              str(args.num_prompts), "--output-len", str(args.output_len), "--prompt-len", str(args.prompt_len)],
                             capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base1, base2 = rows[0]["output_tok_s"], rows[2]["output_tok_s"]
    print(f"\n## Throughput ({args.num_prompts} prompts of {args.prompt_len} tokens, {args.output_len} output tokens, offline, "
          "demo model fp32)\n")
    print("| case | seconds | output tok/s | vs DP=1 1 thread | vs DP=1 2 threads | CPU s / 1k tokens |\n"
          "|---|---|---|---|---|---|")
    for r, name in zip(rows, ("DP=1, 1 core / 1 thread", "DP=2, 1 core / 1 thread each", "DP=1, 2 cores / 2 threads")):
        print(f"| {name} | {r['seconds']:.2f} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / base1:.2f}x | "
              f"{r['output_tok_s'] / base2:.2f}x | {r['cpu_s_per_1k']:.3f} |")
    print(f"\n(load average while it ran: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: the wall-clock ratios "
          "hold only on an otherwise idle machine; CPU s / 1k tokens is what each output token cost)")


# ---------------------------------------------------------------------------------------------------- 2, 3
def _prefixes(n: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 4000) for _ in range(length)] for _ in range(n)]


async def _closed_loop(engine, pick, num_requests: int, concurrency: int, sampler=None) -> dict:
    from streamer import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = random.Random(2)
    ttfts, prompt_toks, cached = [], 0, 0
    todo = list(range(num_requests))

    async def worker() -> None:
        nonlocal prompt_toks, cached
        while todo:
            todo.pop()
            ids = pick(rng) + [rng.randrange(100, 4000) for _ in range(32)]
            t0 = time.perf_counter()
            first = None
            async for out in engine.stream({"prompt_token_ids": ids}, params):
                if first is None and out.token_ids:
                    first = time.perf_counter() - t0
                if out.usage:
                    prompt_toks += out.usage["prompt_tokens"]
                    cached += out.usage["prompt_tokens_details"]["cached_tokens"]
            ttfts.append(first)

    stop = asyncio.Event()
    samples: list[list[int]] = []

    async def sample() -> None:
        while not stop.is_set():
            samples.append([r.inflight for r in engine.router.replicas])
            await asyncio.sleep(0.01)
    s = asyncio.ensure_future(sample())
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt = time.perf_counter() - t0
    stop.set()
    await s
    return {"hit_rate": cached / prompt_toks, "ttft_p50": statistics.median(ttfts),
            "ttft_p90": statistics.quantiles(ttfts, n=10)[-1], "seconds": dt, "samples": samples,
            "routed": list(engine.router.routed)}


async def _dp_engine(policy: str, blocks: int):
    from streamer.engine.data_parallel import DataParallelEngine
    e = DataParallelEngine(None, data_parallel_size=2, dp_routing=policy, num_kv_blocks=blocks, max_num_seqs=16,
                           **BASE)
    return await e.start()


def prefix(args) -> None:
    prefixes = _prefixes(8, 1024)
    blocks = 5 * 1024 // 16 + 24  # ~5 prefixes per replica, and room for the running requests' own blocks
    res = {}
    for policy in ("cache_aware", "round_robin"):
        async def run() -> dict:
            e = await _dp_engine(policy, blocks)
            try:
                await _closed_loop(e, lambda rng: rng.choice(prefixes), 8, 8)  # (warm-up)
                await e.reset_prefix_cache()
                return await _closed_loop(e, lambda rng: rng.choice(prefixes), args.prefix_requests, 8)
            finally:
                await e.stop()
        res[policy] = asyncio.run(run())
    ca, rr = res["cache_aware"], res["round_robin"]
    print(f"\n## Prefix workload (8 prefixes x 1,024 tokens + 32, {args.prefix_requests} requests, 8 concurrent, "
          f"DP=2, {blocks} KV blocks of 16 per replica)\n")
    print("| routing | prefix hit rate | TTFT p50 ms | TTFT p90 ms | seconds | routed |\n|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['hit_rate']:.3f} | {r['ttft_p50'] * 1e3:.0f} | {r['ttft_p90'] * 1e3:.0f} | "
              f"{r['seconds']:.1f} | {r['routed']} |")
    print(f"\ncache_aware / round_robin: hit rate {ca['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
          f"TTFT p50 {rr['ttft_p50'] / ca['ttft_p50']:.2f}x lower")


def hot(args) -> None:
    prefixes = _prefixes(8, 1024)

    def pick(rng: random.Random) -> list[int]:
        return prefixes[0] if rng.random() < 0.8 else rng.choice(prefixes[1:])

    async def run() -> dict:
        e = await _dp_engine("cache_aware", 5 * 1024 // 16 + 48)
        try:
            return await _closed_loop(e, pick, args.hot_requests, 16)
        finally:
            await e.stop()
    r = asyncio.run(run())
    steady = [s for s in r["samples"] if sum(s) >= 8]  # (while the loop is full)
    means = [statistics.mean(s[i] for s in steady) for i in range(2)]
    worst = max(max(s) / max(min(s), 1) for s in steady)
    print(f"\n## Hot prefix (80% of {args.hot_requests} requests on one prefix, 16 concurrent, DP=2 cache_aware)\n")
    print("| replica | mean in flight | routed |\n|---|---|---|")
    for i in range(2):
        print(f"| {i} | {means[i]:.2f} | {r['routed'][i]} |")
    print(f"\nbusiest / idlest mean in-flight: {max(means) / min(means):.2f} (worst instantaneous max/min: "
          f"{worst:.2f}, over {len(steady)} samples); hit rate {r['hit_rate']:.3f}")


# ---------------------------------------------------------------------------------------------------- 4
def overhead(args) -> None:
    from streamer import SamplingParams
    from streamer.engine.async_engine import AsyncEngine
    from streamer.engine.data_parallel import DataParallelEngine
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = {"prompt_token_ids": list(range(100, 132))}

    async def ttfts(engine) -> list[float]:
        out = []
        for i in range(args.overhead_requests + 10):
            t0 = time.perf_counter()
            async for _ in engine.stream(prompt, params):
                break
            if i >= 10:
                out.append(time.perf_counter() - t0)
        return out

    # (one torch thread on both paths: the replica gets one core, as the in-process engine uses one thread)
    os.environ["STREAMER_DP_CORES_PER_REPLICA"] = "1"
    import torch
    torch.set_num_threads(1)

    async def run() -> tuple[list[float], list[float]]:
        kw = dict(BASE, enable_prefix_caching=False)
        async with AsyncEngine(None, **kw) as e:
            direct = await ttfts(e)
        dp = DataParallelEngine(None, **kw)  # (data_parallel_size 1: the router and one replica process)
        await dp.start()
        try:
            routed = await ttfts(dp)
        finally:
            await dp.stop()
        return direct, routed
    direct, routed = asyncio.run(run())
    d, r = statistics.median(direct), statistics.median(routed)
    print(f"\n## Router overhead ({args.overhead_requests} sequential 32-token prompts, 1 output token, demo model)\n")
    print("| path | TTFT p50 ms | TTFT p90 ms |\n|---|---|---|")
    print(f"| AsyncEngine in process | {d * 1e3:.2f} | {statistics.quantiles(direct, n=10)[-1] * 1e3:.2f} |")
    print(f"| DataParallelEngine, 1 replica | {r * 1e3:.2f} | {statistics.quantiles(routed, n=10)[-1] * 1e3:.2f} |")
    print(f"\nrouter + hop: {(r - d) * 1e3:+.2f} ms at p50")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", default="all", choices=["all", "throughput", "prefix", "hot", "overhead"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefix-requests", type=int, default=96)
    p.add_argument("--hot-requests", type=int, default=160)
    p.add_argument("--overhead-requests", type=int, default=100)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case is not None:
        dp, cores = json.loads(args.case)
        print(json.dumps(throughput_case(dp, cores, args.num_prompts, args.output_len, args.prompt_len)))
        return
    for name, fn in (("throughput", throughput), ("prefix", prefix), ("hot", hot), ("overhead", overhead)):
        if args.section in ("all", name):
            fn(args)
            sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

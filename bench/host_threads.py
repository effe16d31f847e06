"""Where host-side torch work runs, and what it does to model steps on CPU (streamer/threads.py).

Every thread that runs a parallel torch op keeps an OpenMP team; with more OpenMP threads than cores, libgomp stops
letting idle workers spin, and every op of a model step waits for its workers to wake. Two measurements, each side
by side in one process, median decode-step time (the runner's `launch`):

1. AsyncEngine, Whisper (bench/whisper_throughput.py's tiny model), 8 requests decoding 100 tokens each: prompt
   preprocessing (the audio's features) on threads of its own (what the engine does) vs on asyncio's pool
   (`asyncio.to_thread`, what it did), vs LLM.generate in the main thread. The model is written by a child
   process: the main thread here runs no torch op before the engines (a server's event loop thread runs none; one
   that did would hold a team too, and every step would slow again).
2. LLM.generate with async scheduling on the ~90M bench Llama (bench/make_bench_model.py), 32 requests x 64
   tokens: the model on the main thread, results processed on a worker (what it does), vs sync stepping.

    python bench/host_threads.py [--llama ~/.cache/streamer-bench/llama-90m]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(runner) -> list[tuple[float, int]]:
    """Wrap runner.launch: (seconds, tokens) a step."""
    log: list[tuple[float, int]] = []
    launch = runner.launch

    def wrapped(step):
        t = time.perf_counter()
        out = launch(step)
        log.append((time.perf_counter() - t, len(step.input_ids)))
        return out
    runner.launch = wrapped
    return log


def median_ms(log: list[tuple[float, int]], tokens: int) -> float:
    steps = [t for t, n in log if n == tokens]
    return 1e3 * statistics.median(steps) if steps else float("nan")


def whisper(folder: Path, rounds: int) -> dict[str, list[float]]:
    import streamer.engine.async_engine as async_engine
    from streamer import LLM, SamplingParams
    from streamer.engine.async_engine import AsyncEngine
    from tests.whisper_checkpoints import tone
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    prompts = [{"prompt": prompt, "multi_modal_data": {"audio": (tone(10.0, 200 + 10 * i, seed=i), 16000)}}
               for i in range(8)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    out: dict[str, list[float]] = {}

    async def engine(label: str) -> None:
        async with AsyncEngine(str(folder), dtype="float32", max_num_seqs=8, enforce_eager=True) as eng:
            log = timed(eng.engine.runner)

            async def one(p: dict) -> None:
                async for _ in eng.stream(p, params):
                    pass
            for _ in range(rounds):
                log.clear()
                await asyncio.gather(*(one(p) for p in prompts))
                out.setdefault(label, []).append(median_ms(log, 8))

    own = async_engine.to_own_thread
    asyncio.run(engine("AsyncEngine, preprocessing on own threads"))
    async_engine.to_own_thread = asyncio.to_thread  # (what the engine did before)
    try:
        asyncio.run(engine("AsyncEngine, preprocessing on asyncio's pool"))
    finally:
        async_engine.to_own_thread = own
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8, enforce_eager=True)
    log = timed(llm.engine.runner)
    for _ in range(rounds):
        log.clear()
        llm.generate(prompts, params, use_tqdm=False)
        out.setdefault("LLM.generate (main thread)", []).append(median_ms(log, 8))
    return out


def llama(folder: Path, rounds: int) -> dict[str, list[float]]:
    from streamer import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [(i * 7 + j) % 1000 + 10 for j in range(64)]} for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    out: dict[str, list[float]] = {}
    for label, asynchronous in (("LLM, sync steps", False), ("LLM, async scheduling", True)):
        llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=32, async_scheduling=asynchronous,
                  enforce_eager=True)
        log = timed(llm.engine.runner)
        for _ in range(rounds):
            log.clear()
            llm.generate(prompts, params, use_tqdm=False)
            out.setdefault(label, []).append(median_ms(log, 32))
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama", type=Path, default=Path.home() / ".cache/streamer-bench/llama-90m")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # (in a child process: transformers' torch ops here would give this thread an OpenMP team of its own,
        # which is the very thing measured; a server's event loop thread runs none)
        import subprocess
        subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:3]; import whisper_throughput; "
                        "whisper_throughput.make_model(__import__('pathlib').Path(sys.argv[3]), 'tiny')",
                        str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]), tmp],
                       check=True, capture_output=True)
        rows = whisper(Path(tmp), args.rounds)
    base = statistics.median(rows["LLM.generate (main thread)"])
    print("Whisper-tiny shapes, 8 requests, decode step (median of each round, ms); ratio to LLM.generate")
    for label, ms in rows.items():
        print(f"  {label:<46}{statistics.median(ms):>8.1f}{statistics.median(ms) / base:>7.2f}x   "
              f"{', '.join(f'{m:.1f}' for m in ms)}")
    if args.llama.is_dir():
        rows = llama(args.llama, args.rounds)
        base = statistics.median(rows["LLM, sync steps"])
        print(f"{args.llama.name}, 32 requests, decode step (ms); ratio to sync steps")
        for label, ms in rows.items():
            print(f"  {label:<46}{statistics.median(ms):>8.1f}{statistics.median(ms) / base:>7.2f}x   "
                  f"{', '.join(f'{m:.1f}' for m in ms)}")


if __name__ == "__main__":
    main()
